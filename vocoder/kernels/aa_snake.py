"""One Triton kernel for BigVGAN's anti-aliased (Snake|SnakeBeta) activation: upsample x2, snake, downsample x2.

The package's `Activation1d` runs replicate pad, a depthwise transposed conv, the snake (several
elementwise kernels at twice the rate) and a padded depthwise strided conv; this kernel reads x once and
writes y once. Polyphase form of that composition (12-tap filters, ratio 2; derivation in
`vocoder/aa_activation.py`, whose `aa_snake_reference` is the same arithmetic in PyTorch, tested on CPU):

    y[t] = sum_j hd[j] * S(u[clamp(2t + j - 5, 0, 2T - 1)])
    u[p] = 2 * sum_{k = p + 5 (mod 2)} hu[k] * x[clamp((p + 5 - k) / 2, 0, T - 1)]

For p inside [0, 2T) the x index is t + (j - k) / 2 (11 shifts of the same row, shared by all taps);
p outside is u[0] or u[2T - 1], two numbers per row. Arithmetic in float32, output in x's dtype.
Only imported when Triton is present (see vocoder/kernels/__init__.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kernels.launch import pdl_args, pdl_enter
from vocoder.layout import is_channels_last


@triton.jit
def _snake_coefficients(alpha_ptr, beta_ptr, c, LOG_SCALE: tl.constexpr, HAS_BETA: tl.constexpr):
    """(alpha, 1 / (beta + 1e-9)) of channel c in float32, as bigvgan's Snake / SnakeBeta use them."""
    a = tl.load(alpha_ptr + c).to(tl.float32)
    if HAS_BETA:
        b = tl.load(beta_ptr + c).to(tl.float32)
    else:
        b = a
    if LOG_SCALE:
        a = tl.exp(a)
        b = tl.exp(b)
    return a, 1.0 / (b + 1e-9)


@triton.jit
def _aa_snake_kernel(
    x_ptr,
    y_ptr,
    alpha_ptr,
    beta_ptr,
    hu_ptr,
    hd_ptr,
    C,
    T,
    LOG_SCALE: tl.constexpr,
    HAS_BETA: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    a, inv_b = _snake_coefficients(alpha_ptr, beta_ptr, row % C, LOG_SCALE, HAS_BETA)

    base = x_ptr + row * T
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    t_mask = t < T
    last = T - 1

    # u[0] (p = 0: odd taps) and u[2T-1] (p = 2T-1: even taps), the replicate-padded ends of u.
    u_first = 0.0
    u_last = 0.0
    for r in tl.static_range(6):
        i_first = tl.minimum(tl.maximum(T * 0 + (2 - r), 0), last)
        i_last = tl.maximum(tl.minimum(T + (2 - r), last), 0)
        u_first += tl.load(hu_ptr + 2 * r + 1).to(tl.float32) * tl.load(base + i_first).to(tl.float32)
        u_last += tl.load(hu_ptr + 2 * r).to(tl.float32) * tl.load(base + i_last).to(tl.float32)
    u_first = 2.0 * u_first
    u_last = 2.0 * u_last

    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(12):
        u = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(6):
            k = (j % 2) + 2 * r
            shift = (j - k) // 2
            idx = tl.minimum(tl.maximum(t + shift, 0), last)
            xv = tl.load(base + idx, mask=t_mask, other=0.0).to(tl.float32)
            u += tl.load(hu_ptr + k).to(tl.float32) * xv
        u = 2.0 * u
        p = 2 * t + (j - 5)
        u = tl.where(p < 0, u_first, u)
        u = tl.where(p > 2 * T - 1, u_last, u)
        s = tl.sin(u * a)
        acc += tl.load(hd_ptr + j).to(tl.float32) * (u + inv_b * s * s)
    tl.store(y_ptr + row * T + t, acc.to(y_ptr.dtype.element_ty), mask=t_mask)


@triton.jit
def _fast_sin(x):
    # sin.approx after reducing to [-pi, pi]: absolute error ~1e-6 for the arguments snake sees.
    return tl.inline_asm_elementwise(
        "sin.approx.f32 $0, $1;",
        "=r,r",
        [x - 6.283185307179586 * tl.floor(x * 0.15915494309189535 + 0.5)],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _aa_snake_gather_kernel(
    x_ptr,
    y_ptr,
    alpha_ptr,
    beta_ptr,
    hu_ptr,
    hd_ptr,
    C,
    T,
    LOG_SCALE: tl.constexpr,
    HAS_BETA: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Each program makes BLOCK - 8 outputs; the snake runs once per upsampled position.

    Lane l holds q = t0 - 4 + l and both phases of u there: ue = u[2q] (odd up-taps), uo = u[2q + 1]
    (even up-taps), replicate-clamped as u[0] for q < 0 and u[2T - 1] for q >= T. Output t = t0 + l then
    reads se at lanes l + 2 .. l + 7 and so at lanes l + 1 .. l + 6 (tl.gather across the block):
    y[t] = sum_a hd[2a + 1] se[t + a - 2] + hd[2a] so[t + a - 3].
    """
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    a, inv_b = _snake_coefficients(alpha_ptr, beta_ptr, row % C, LOG_SCALE, HAS_BETA)

    base = x_ptr + row * T
    t0 = tl.program_id(1) * (BLOCK - 8)
    lanes = tl.arange(0, BLOCK)
    q = t0 - 4 + lanes
    last = T - 1
    qc = tl.minimum(tl.maximum(q, 0), last)
    ue = tl.zeros([BLOCK], dtype=tl.float32)
    uo = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(6):
        xe = tl.load(base + tl.minimum(tl.maximum(qc + (2 - r), 0), last)).to(tl.float32)
        xo = tl.load(base + tl.minimum(tl.maximum(qc + (3 - r), 0), last)).to(tl.float32)
        ue += tl.load(hu_ptr + 2 * r + 1).to(tl.float32) * xe
        uo += tl.load(hu_ptr + 2 * r).to(tl.float32) * xo
    ue_fixed = tl.where(q > last, uo, ue) * 2.0
    uo_fixed = tl.where(q < 0, ue, uo) * 2.0
    se = _fast_sin(ue_fixed * a)
    so = _fast_sin(uo_fixed * a)
    se = ue_fixed + inv_b * se * se
    so = uo_fixed + inv_b * so * so

    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(6):
        ie = tl.minimum(lanes + (i + 2), BLOCK - 1)
        io = tl.minimum(lanes + (i + 1), BLOCK - 1)
        acc += tl.load(hd_ptr + 2 * i + 1).to(tl.float32) * tl.gather(se, ie, 0)
        acc += tl.load(hd_ptr + 2 * i).to(tl.float32) * tl.gather(so, io, 0)
    t = t0 + lanes
    tl.store(y_ptr + row * T + t, acc.to(y_ptr.dtype.element_ty), mask=(lanes < BLOCK - 8) & (t < T))


@triton.jit
def _nwc_tile(x_ptr, alpha_ptr, beta_ptr, C, T, BC: tl.constexpr, LOG_SCALE: tl.constexpr, HAS_BETA: tl.constexpr):
    """A channels-last program's channels: (c, c_ok [1, BC], alpha and 1 / beta [1, BC], its row's x + c)."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(2) * BC + tl.arange(0, BC)
    cc = tl.minimum(c, C - 1)  # lanes past C read channel C - 1's coefficients and store nothing
    a, inv_b = _snake_coefficients(alpha_ptr, beta_ptr, cc, LOG_SCALE, HAS_BETA)
    # c itself, not cc, in the addresses: runs of contiguous channels, vector loads
    return c, (c < C)[None, :], a[None, :], inv_b[None, :], x_ptr + b * T * C + c[None, :]


@triton.jit
def _nwc_phases(base, qc, c_ok, hu_ptr, C, T, ROWS: tl.constexpr, BC: tl.constexpr):
    """Both upsampled phases at the (clamped) rows qc of a channels-last tile, before the replicate-end
    fix-ups: ue = u[2q] / 2 (odd up-taps), uo = u[2q + 1] / 2 (even up-taps), [ROWS, BC] float32."""
    last = T - 1
    ue = tl.zeros([ROWS, BC], dtype=tl.float32)
    uo = tl.zeros([ROWS, BC], dtype=tl.float32)
    for r in tl.static_range(6):
        xe = tl.load(base + (tl.minimum(tl.maximum(qc + (2 - r), 0), last) * C)[:, None], mask=c_ok,
                     other=0.0).to(tl.float32)
        xo = tl.load(base + (tl.minimum(tl.maximum(qc + (3 - r), 0), last) * C)[:, None], mask=c_ok,
                     other=0.0).to(tl.float32)
        ue += tl.load(hu_ptr + 2 * r + 1).to(tl.float32) * xe
        uo += tl.load(hu_ptr + 2 * r).to(tl.float32) * xo
    return ue, uo


@triton.jit
def _snake(u, a, inv_b, FAST_SIN: tl.constexpr):
    """u + sin(a u)^2 / b."""
    if FAST_SIN:
        s = _fast_sin(u * a)
    else:
        s = tl.sin(u * a)
    return u + inv_b * s * s


@triton.jit
def _aa_snake_nwc_kernel(
    x_ptr,
    y_ptr,
    alpha_ptr,
    beta_ptr,
    hu_ptr,
    hd_ptr,
    C,
    T,
    LOG_SCALE: tl.constexpr,
    HAS_BETA: tl.constexpr,
    FAST_SIN: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The polyphase form on a channels-last tensor (element (b, c, t) at b*T*C + t*C + c): a program makes
    a [BT, BC] tile of outputs, each lane a channel, so every load is a run of BC contiguous channels. With
    no neighbour exchange across lanes, each output recomputes the 7 upsampled pairs it reads: for
    q = t - 3 .. t + 3, ue = u[2q] and uo = u[2q + 1] (replicate ends as in `_aa_snake_gather_kernel`);
    y[t] = sum_a hd[2a + 1] S(ue[t + a - 2]) + hd[2a] S(uo[t + a - 3])."""
    pdl_enter(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    c, c_ok, a, inv_b, base = _nwc_tile(x_ptr, alpha_ptr, beta_ptr, C, T, BC, LOG_SCALE, HAS_BETA)
    last = T - 1
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for dq in tl.static_range(7):
        q = t + (dq - 3)
        ue, uo = _nwc_phases(base, tl.minimum(tl.maximum(q, 0), last), c_ok, hu_ptr, C, T, BT, BC)
        if dq >= 1:  # ue at q = t + i - 2, i = dq - 1
            se = _snake(tl.where((q > last)[:, None], uo, ue) * 2.0, a, inv_b, FAST_SIN)
            acc += tl.load(hd_ptr + 2 * dq - 1).to(tl.float32) * se
        if dq <= 5:  # uo at q = t + i - 3, i = dq
            so = _snake(tl.where((q < 0)[:, None], ue, uo) * 2.0, a, inv_b, FAST_SIN)
            acc += tl.load(hd_ptr + 2 * dq).to(tl.float32) * so
    mask = (t < T)[:, None] & c_ok
    tl.store(y_ptr + b * T * C + t[:, None] * C + c[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _aa_snake_nwc_gather_kernel(
    x_ptr,
    y_ptr,
    alpha_ptr,
    beta_ptr,
    hu_ptr,
    hd_ptr,
    C,
    T,
    LOG_SCALE: tl.constexpr,
    HAS_BETA: tl.constexpr,
    FAST_SIN: tl.constexpr,
    R: tl.constexpr,
    BC: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """`_aa_snake_gather_kernel` on a channels-last tensor: a program holds R time rows x BC channels and
    makes the first R - 8 rows of outputs. Row l holds q = t0 - 4 + l and both upsampled phases there
    (7 loads of contiguous channel runs, one snake each); output t0 + l gathers, along the tile's time
    axis, the snakes of rows l + 1 .. l + 7 (12 gathers, lowered to warp shuffles). Gathering 7 rows that
    already sum both phases weighted by their taps was slower on the H200: 4.10 vs 3.15 ms over the six
    stage shapes of bench/aa_snake_tune.py (layout conversions through shared memory around each gather)."""
    pdl_enter(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    t0 = tl.program_id(1) * (R - 8)
    rows = tl.arange(0, R)
    c, c_ok, a, inv_b, base = _nwc_tile(x_ptr, alpha_ptr, beta_ptr, C, T, BC, LOG_SCALE, HAS_BETA)
    last = T - 1
    q = t0 - 4 + rows
    ue, uo = _nwc_phases(base, tl.minimum(tl.maximum(q, 0), last), c_ok, hu_ptr, C, T, R, BC)
    se = _snake(tl.where((q > last)[:, None], uo, ue) * 2.0, a, inv_b, FAST_SIN)
    so = _snake(tl.where((q < 0)[:, None], ue, uo) * 2.0, a, inv_b, FAST_SIN)
    acc = tl.zeros([R, BC], dtype=tl.float32)
    zero = tl.zeros([R, BC], dtype=tl.int32)
    for i in tl.static_range(6):
        ie = zero + tl.minimum(rows + (i + 2), R - 1)[:, None]
        io = zero + tl.minimum(rows + (i + 1), R - 1)[:, None]
        acc += tl.load(hd_ptr + 2 * i + 1).to(tl.float32) * tl.gather(se, ie, 0)
        acc += tl.load(hd_ptr + 2 * i).to(tl.float32) * tl.gather(so, io, 0)
    t = t0 + rows
    mask = ((rows < R - 8) & (t < T))[:, None] & c_ok
    tl.store(y_ptr + b * T * C + t[:, None] * C + c[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def nwc_launch(channels: int) -> tuple[int, int, int]:
    """(rows, channel block, warps) of `_aa_snake_nwc_gather_kernel` for a channel count: 64 rows (56 outputs)
    x 32 channels over 4 warps, or x 16 channels over 2 warps where 32 does not divide the channels. On the
    H200 (bench/results/vocoder-nwc-h200/, 14 shapes timed at the six BigVGAN stages of a 64-stream step)
    64 x 32 x 4 had the lowest total; at 48 channels 64 x 16 x 2 took 0.52 ms against 0.66."""
    return (64, 32, 4) if channels % 32 == 0 else (64, 16, 2)


def _aa_snake_nwc(x: torch.Tensor, alpha_beta: tuple, filters: tuple, flags: dict, *, fast_sin: bool = True,
                  gather: bool | None = None, launch: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Launch a channels-last kernel: the gathering one where `tl.gather` exists (gather None), else the
    direct one (7 upsampled pairs and 12 snakes recomputed per output). `launch` overrides `nwc_launch`
    (bench/aa_snake_tune.py)."""
    bsz, channels, length = x.shape
    y = torch.empty_like(x)  # same strides
    if HAS_GATHER if gather is None else gather:
        rows, block_c, warps = launch or nwc_launch(channels)
        grid = (bsz, triton.cdiv(length, rows - 8), triton.cdiv(channels, block_c))
        _aa_snake_nwc_gather_kernel[grid](x, y, *alpha_beta, *filters, channels, length, **flags,
                                          FAST_SIN=fast_sin, R=rows, BC=block_c, num_warps=warps, **pdl_args())
        return y
    # [16, 64] tiles over 4 warps (8 outputs per thread) or [8, 32] over one: no register spills (ptxas for
    # sm_90); [32, 64] over 4 warps spilled 1.3 kB per thread and ran ~40x slower on the H200
    block_t, block_c, warps = (16, 64, 4) if channels % 64 == 0 else (8, 32, 1)
    grid = (bsz, triton.cdiv(length, block_t), triton.cdiv(channels, block_c))
    _aa_snake_nwc_kernel[grid](x, y, *alpha_beta, *filters, channels, length, **flags, FAST_SIN=fast_sin,
                               BT=block_t, BC=block_c, num_warps=warps, **pdl_args())
    return y


HAS_GATHER = hasattr(tl, "gather")


def aa_snake(
    x: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor | None,
    up_filter: torch.Tensor,
    down_filter: torch.Tensor,
    *,
    log_scale: bool,
    direct: bool = False,
    block: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """x [B, C, T] (CUDA) -> [B, C, T]: downsample2(snake(upsample2(x))) as in bigvgan's Activation1d.
    A channels-last x (`is_channels_last`) runs `_aa_snake_nwc_kernel` and gives a channels-last y.

    alpha, beta: [C] snake parameters (log scale if `log_scale`); beta None for plain Snake.
    up_filter, down_filter: the 12-tap float32 filters of UpSample1d / DownSample1d.
    direct: use the per-output kernel (12 snakes per output) even where tl.gather exists (checks).
    block, num_warps: override the launch shape (bench/aa_snake_tune.py).
    """
    assert x.dim() == 3 and x.is_cuda
    assert up_filter.numel() == 12 and down_filter.numel() == 12
    alpha_beta = (alpha, beta if beta is not None else alpha)
    filters = (up_filter.reshape(-1).float().contiguous(), down_filter.reshape(-1).float().contiguous())
    flags = {"LOG_SCALE": log_scale, "HAS_BETA": beta is not None}
    if x.numel() and is_channels_last(x) and not direct:
        return _aa_snake_nwc(x, alpha_beta, filters, flags)
    x = x.contiguous()
    bsz, channels, length = x.shape
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    if HAS_GATHER and not direct:
        # One warp per program measured fastest on the H200 (bench/results/aa-snake-tune-h200.json).
        block = block or (512 if length >= 16384 else 256 if length >= 96 else 32)
        warps = num_warps or 1
        grid = (bsz * channels, triton.cdiv(length, block - 8))
        _aa_snake_gather_kernel[grid](
            x, y, *alpha_beta, *filters, channels, length, **flags, BLOCK=block, num_warps=warps, **pdl_args()
        )
        return y
    block = 256 if length >= 256 else max(16, triton.next_power_of_2(length))
    grid = (bsz * channels, triton.cdiv(length, block))
    _aa_snake_kernel[grid](
        x,
        y,
        *alpha_beta,
        *filters,
        channels,
        length,
        **flags,
        BLOCK=block,
        num_warps=4 if block >= 128 else 1,
        **pdl_args(),
    )
    return y
