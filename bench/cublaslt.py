"""cuBLASLt products with a chosen algorithm, through the library PyTorch itself loaded (ctypes; CUDA only).

PyTorch asks cuBLASLt's heuristic for ONE algorithm per product shape and has no way to pick another
(its TunableOp has only that "Default" candidate on CUDA: bench/results/decode-ab-h200/tunableop/). The
heuristic can list many: other tile shapes, split-K counts and reduction schemes. `LtMatmul` asks for up to
`max_algos` of them for `y[M, N] = x[M, K] @ w[N, K]^T` (bf16 or fp16 in and out, float32 accumulation,
the same product `F.linear` runs) and runs any one of them on the current stream, so it can be captured in
a CUDA graph. Which one is fastest is measured, not guessed (`bench/cublaslt_tune.py`). Measured on the H200
(bench/results/cublaslt-tune-h200/): no listed algorithm beats the first by more than a few percent on the
decode step's products, so the engine keeps `F.linear` and this stays a bench tool.

In cuBLAS's column-major terms the row-major product is D[N, M] = op(A) B with A = w viewed as a K x N
column-major matrix (ld K, transposed), B = x as K x M (ld K) and D as N x M (ld N): the "TN" form whose
kernels the profiles show (`nvjet_..._TNT`).

The workspace: one buffer per CUDA stream (the engine's two tails run on two streams at once), allocated
before any graph capture by `reserve(stream)` or on first use outside capture.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import threading
from dataclasses import dataclass
from typing import ClassVar

import torch

_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_COMPUTE_32F = 68
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE_BYTES = 1
# cublasLtMatmulAlgoConfigAttributes_t, reported per algorithm
_CONFIG_ATTRS = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
                 "inner_shape": 7, "cluster_shape": 8}
_DTYPES = {torch.bfloat16: _CUDA_R_16BF, torch.float16: _CUDA_R_16F}
WORKSPACE_BYTES = 32 << 20


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    pass


def _loaded_library_path() -> str | None:
    """The libcublasLt this process has mapped (PyTorch's own), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "libcublasLt.so" in path:
                    return path
    except OSError:
        return None
    return None


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def _library() -> ctypes.CDLL:
    """libcublasLt, loaded once: the copy PyTorch uses (after one cuBLAS product has loaded it)."""
    global _lib
    with _lib_lock:
        if _lib is None:
            if not torch.cuda.is_available():
                raise CublasLtError("cuBLASLt needs CUDA")
            a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
            torch.nn.functional.linear(a, a)  # makes PyTorch map its cuBLASLt
            torch.cuda.synchronize()
            path = _loaded_library_path() or ctypes.util.find_library("cublasLt")
            if path is None:
                raise CublasLtError("libcublasLt not found")
            lib = ctypes.CDLL(path)
            vp, i64, u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64
            pp = ctypes.POINTER(ctypes.c_void_p)
            sigs = {
                "cublasLtCreate": [pp],
                "cublasLtMatmulDescCreate": [pp, ctypes.c_int, ctypes.c_int],
                "cublasLtMatmulDescSetAttribute": [vp, ctypes.c_int, vp, ctypes.c_size_t],
                "cublasLtMatrixLayoutCreate": [pp, ctypes.c_int, u64, u64, i64],
                "cublasLtMatmulPreferenceCreate": [pp],
                "cublasLtMatmulPreferenceSetAttribute": [vp, ctypes.c_int, vp, ctypes.c_size_t],
                "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int,
                                                   ctypes.POINTER(_Heuristic), ctypes.POINTER(ctypes.c_int)],
                "cublasLtMatmulAlgoConfigGetAttribute": [ctypes.POINTER(_Algo), ctypes.c_int, vp, ctypes.c_size_t,
                                                         ctypes.POINTER(ctypes.c_size_t)],
                "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(_Algo), vp,
                                   ctypes.c_size_t, vp],
            }
            for name, argtypes in sigs.items():
                fn = getattr(lib, name)
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int
            _lib = lib
        return _lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} failed with cublasStatus {status}")


@dataclass(frozen=True)
class Algorithm:
    """One heuristic result: the opaque algorithm and what it says about itself."""

    index: int  # rank in the heuristic's list (0 = what PyTorch would run, given the same workspace)
    algo: bytes  # the 64-byte cublasLtMatmulAlgo_t
    workspace_bytes: int
    waves: float
    config: dict[str, int]

    def describe(self) -> dict:
        return {"index": self.index, "workspace_bytes": self.workspace_bytes, "waves": round(self.waves, 3),
                **self.config}


class LtMatmul:
    """y[M, N] = x[M, K] @ w[N, K]^T for one (M, N, K, dtype) with any of cuBLASLt's listed algorithms."""

    _handle: ClassVar[ctypes.c_void_p | None] = None
    _workspaces: ClassVar[dict[int, torch.Tensor]] = {}  # stream handle -> workspace

    def __init__(self, m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16, *, max_algos: int = 32) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype}")
        lib = _library()
        self.m, self.n, self.k, self.dtype = m, n, k, dtype
        if LtMatmul._handle is None:
            handle = ctypes.c_void_p()
            _check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
            LtMatmul._handle = handle
        self._desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), _COMPUTE_32F, _CUDA_R_32F), "MatmulDescCreate")
        for attr, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            val = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(self._desc, attr, ctypes.byref(val), 4), "DescSetAttribute")
        t = _DTYPES[dtype]
        self._a, self._b, self._d = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._a), t, k, n, k), "LayoutCreate(A)")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._b), t, k, m, k), "LayoutCreate(B)")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self._d), t, n, m, n), "LayoutCreate(D)")
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        ws = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
               "PreferenceSetAttribute")
        results = (_Heuristic * max_algos)()
        count = ctypes.c_int(0)
        _check(lib.cublasLtMatmulAlgoGetHeuristic(LtMatmul._handle, self._desc, self._a, self._b, self._d, self._d,
                                                  pref, max_algos, results, ctypes.byref(count)), "AlgoGetHeuristic")
        self.algorithms: list[Algorithm] = []
        for i in range(count.value):
            r = results[i]
            if r.state != 0:
                continue
            self.algorithms.append(Algorithm(i, bytes(r.algo), int(r.workspace_size), float(r.waves),
                                             _config(lib, r.algo)))
        self._alpha = ctypes.c_float(1.0)
        self._beta = ctypes.c_float(0.0)

    @staticmethod
    def reserve(stream: torch.cuda.Stream) -> torch.Tensor:
        """The workspace of `stream` (allocate it here, before any graph capture that uses the stream)."""
        key = stream.cuda_stream
        ws = LtMatmul._workspaces.get(key)
        if ws is None:
            if torch.cuda.is_current_stream_capturing():
                raise CublasLtError("cuBLASLt workspace for a new stream requested during graph capture")
            ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=stream.device)
            LtMatmul._workspaces[key] = ws
        return ws

    def __call__(self, x: torch.Tensor, w: torch.Tensor, algorithm: Algorithm,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape != (self.m, self.k) or w.shape != (self.n, self.k):
            raise ValueError(f"shapes {tuple(x.shape)} x {tuple(w.shape)} do not match {(self.m, self.n, self.k)}")
        if x.dtype != self.dtype or w.dtype != self.dtype or not (x.is_contiguous() and w.is_contiguous()):
            raise ValueError("x and w must be contiguous and of the plan's dtype")
        if out is None:
            out = torch.empty(self.m, self.n, dtype=self.dtype, device=x.device)
        stream = torch.cuda.current_stream(x.device)
        ws = self.reserve(stream)
        algo = _Algo.from_buffer_copy(algorithm.algo)
        lib = _library()
        _check(lib.cublasLtMatmul(LtMatmul._handle, self._desc, ctypes.byref(self._alpha), w.data_ptr(), self._a,
                                  x.data_ptr(), self._b, ctypes.byref(self._beta), out.data_ptr(), self._d,
                                  out.data_ptr(), self._d, ctypes.byref(algo), ws.data_ptr(), WORKSPACE_BYTES,
                                  stream.cuda_stream), "cublasLtMatmul")
        return out


def _config(lib: ctypes.CDLL, algo: _Algo) -> dict[str, int]:
    out = {}
    for name, attr in _CONFIG_ATTRS.items():
        val = ctypes.c_uint64(0)
        written = ctypes.c_size_t(0)
        status = lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(val), 8,
                                                          ctypes.byref(written))
        if status == 0:
            out[name] = int(val.value)
    return out
