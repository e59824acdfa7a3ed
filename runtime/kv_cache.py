"""Paged KV cache storage: one tensor pair shared by all layer instances, addressed by block id.

Layout: `k`, `v` are `[L, num_blocks, block_size, kv_heads, head_dim]` with L = num_layer_instances
(shared 0..S-1, text tail S..S+M-1, audio tail S+M..S+2M-1). A block id therefore addresses the same
slot in every layer instance, so the block manager allocates one id per `block_size` positions and
both tails keep their own K/V at every position.

FP8 cache (`EngineConfig(kv_cache_dtype="fp8")`, docs/engine.md): `k`, `v` hold float8 e4m3 codes, and
`k_scale`, `v_scale` `[L, num_blocks, kv_heads, block_size]` one float32 scale per (position, KV head):
scale = max|row| x (1/448) over the head's D values (448: the largest finite e4m3), code = row / scale rounded
to nearest even, value = code x scale; a zero row has scale 0 and codes 0. A head's scales within one block
are contiguous, so a kernel reading a key tile loads them in one piece. `store_rows` / `read_rows` are the
reference (PyTorch) of what the Triton kernels store and read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.config import ModelConfig

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # largest finite float8 e4m3fn
SCALE_BYTES = 4  # one float32 scale per (position, KV head) for K and for V
KV_CACHE_DTYPES = ("auto", "fp8")  # "auto": the model's dtype


class KVCacheConfigError(ValueError):
    """A KV cache was asked for with an impossible size."""


@dataclass
class KVCache:
    """The paged K and V tensors of every layer instance (with their scales when they hold FP8 codes)."""

    k: torch.Tensor  # [L, num_blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor  # [L, num_blocks, block_size, kv_heads, head_dim]
    block_size: int
    k_scale: torch.Tensor | None = None  # [L, num_blocks, kv_heads, block_size] float32; FP8 codes only
    v_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        assert self.k.shape == self.v.shape and self.k.dim() == 5, (self.k.shape, self.v.shape)
        assert self.k.shape[2] == self.block_size, (self.k.shape, self.block_size)
        quantized = self.k.dtype == FP8_KV_DTYPE
        assert quantized == (self.k_scale is not None) == (self.v_scale is not None), self.k.dtype
        if quantized:
            layers, blocks, block_size, kv_heads, _ = self.k.shape
            for scale in (self.k_scale, self.v_scale):
                assert scale.shape == (layers, blocks, kv_heads, block_size) and scale.dtype == torch.float32

    @property
    def quantized(self) -> bool:
        """The cache holds FP8 codes with per-(position, KV head) scales."""
        return self.k_scale is not None

    @property
    def num_blocks(self) -> int:
        """Blocks per layer instance (the same id is valid in every layer instance)."""
        return int(self.k.shape[1])

    @property
    def num_layer_instances(self) -> int:
        """Length of the layer axis."""
        return int(self.k.shape[0])

    def scales(self, layer_idx: int) -> dict[str, torch.Tensor]:
        """The layer's `k_scale` / `v_scale` as keyword arguments of the attention ops ({} for a plain cache)."""
        if self.k_scale is None or self.v_scale is None:
            return {}
        return {"k_scale": self.k_scale[layer_idx], "v_scale": self.v_scale[layer_idx]}


def kv_storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The element type of the cache for `kv_cache_dtype` ("auto": the model's `dtype`; "fp8": e4m3 codes)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise KVCacheConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return FP8_KV_DTYPE if kv_cache_dtype == "fp8" else dtype


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block id costs across all layer instances, K and V together (with FP8 codes, their scales)."""
    if block_size < 1:
        raise KVCacheConfigError(f"block_size must be >= 1, got {block_size}")
    element_size = torch.empty((), dtype=dtype).element_size()
    per_head = config.head_dim * element_size + (SCALE_BYTES if dtype == FP8_KV_DTYPE else 0)
    per_token = 2 * config.num_layer_instances * config.num_key_value_heads * per_head
    return per_token * block_size


def num_blocks_for_budget(config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many whole blocks fit into `budget_bytes` (0 when not even one does)."""
    if budget_bytes < 0:
        raise KVCacheConfigError(f"KV cache budget must be >= 0 bytes, got {budget_bytes}")
    return int(budget_bytes) // kv_bytes_per_block(config, block_size, dtype)


def allocate_kv_cache(
    config: ModelConfig, num_blocks: int, block_size: int, device: torch.device | str, dtype: torch.dtype
) -> KVCache:
    """Zero-filled cache of `num_blocks` blocks for every layer instance of `config` (`dtype` FP8_KV_DTYPE:
    codes and their scales)."""
    if num_blocks < 1:
        raise KVCacheConfigError(f"num_blocks must be >= 1, got {num_blocks}")
    if block_size < 1:
        raise KVCacheConfigError(f"block_size must be >= 1, got {block_size}")
    shape = (config.num_layer_instances, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    k = torch.zeros(shape, device=device, dtype=dtype)
    v = torch.zeros(shape, device=device, dtype=dtype)
    if dtype != FP8_KV_DTYPE:
        return KVCache(k=k, v=v, block_size=block_size)
    scale_shape = (config.num_layer_instances, num_blocks, config.num_key_value_heads, block_size)
    k_scale = torch.zeros(scale_shape, device=device, dtype=torch.float32)
    v_scale = torch.zeros(scale_shape, device=device, dtype=torch.float32)
    return KVCache(k=k, v=v, block_size=block_size, k_scale=k_scale, v_scale=v_scale)


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., D] -> (e4m3 codes [..., D], float32 scales [...]) as the module docstring defines them."""
    rows = rows.float()
    scale = rows.abs().amax(dim=-1) * (1.0 / FP8_KV_MAX)  # a float32 product, on every device alike
    codes = rows / torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    return codes.to(FP8_KV_DTYPE), scale


def store_rows(
    cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, rows: torch.Tensor
) -> None:
    """Write rows [N, KV, D] at `slots` [N] of one layer's cache [num_blocks, block_size, KV, D] (FP8 codes and
    their scale [num_blocks, KV, block_size] when `scale` is given, else cast to the cache's dtype)."""
    kv_heads, head_dim = cache.shape[2], cache.shape[3]
    flat = cache.view(-1, kv_heads, head_dim)  # [slots, KV, D]
    if scale is None:
        flat.index_copy_(0, slots, rows.to(flat.dtype))
        return
    codes, row_scale = quantize_rows(rows)
    flat.view(torch.uint8).index_copy_(0, slots, codes.view(torch.uint8))  # no FP8 index_copy on CPU
    block_size = cache.shape[1]
    scale[slots // block_size, :, slots % block_size] = row_scale


def read_rows(
    cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rows at `slots` (any shape) of one layer's cache [num_blocks, block_size, KV, D] -> [*slots.shape, KV, D]
    in `dtype` (FP8 codes times their scale, rounded once to `dtype`)."""
    kv_heads, head_dim = cache.shape[2], cache.shape[3]
    rows = cache.view(-1, kv_heads, head_dim)[slots]
    if scale is None:
        return rows.to(dtype)
    block_size = cache.shape[1]
    row_scale = scale[slots // block_size, :, slots % block_size]  # [*slots.shape, KV]
    return (rows.float() * row_scale[..., None]).to(dtype)
