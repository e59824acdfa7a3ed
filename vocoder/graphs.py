"""CUDA graph replay of tensor functions per input shape (the vocoder's per-chunk encoder, flow and BigVGAN).

Eager PyTorch spends most of a small chunk's time launching kernels (BigVGAN's anti-aliased activations,
10 Euler steps x 2 CFG branches of the estimator). A captured graph launches them all at once. Shapes are
fixed per (batch, chunk) layout, so one graph per input signature is kept; a signature is captured the
second time it is seen (one-off shapes, e.g. a stream's tail, stay eager).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

Signature = tuple[tuple[tuple[int, ...], torch.dtype, str], ...]
SEEN_PER_GRAPH = 8  # signatures whose sightings are counted, per graph the function may keep


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph, or None when emulated on CPU
    inputs: list[torch.Tensor]  # static input buffers
    outputs: list[torch.Tensor]  # static output buffers
    spec: pytree.TreeSpec


class GraphedFunction:
    """Calls `fn(*tensors)`, replaying one captured CUDA graph per input signature (shapes, dtypes, device).

    `fn` must be a pure function of its tensor arguments and of tensors whose storage does not move
    (module weights; the caller resets after reallocating any other state it reads). Inputs are copied
    into the graph's static buffers and outputs are cloned out, so callers never hold a buffer that a
    later replay overwrites. On CPU the same buffer path runs with `fn` re-executed instead of a graph
    (so tests can check the plumbing). At most `max_graphs` signatures are kept; others run eagerly.
    After `freeze()` only the signatures captured by then are ever captured (again, after a `reset`), so
    the graphs' memory stays what it was then. Sightings are counted only for signatures that could still
    be captured, and for at most `SEEN_PER_GRAPH * max_graphs` of them (the oldest forgotten first), so a
    caller whose shapes keep changing does not grow the count without end.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        max_graphs: int = 32,
        capture_after_calls: int = 2,
        pool: Any = None,
        warmup_runs: int = 2,
    ):
        self.fn = fn
        self.max_graphs = max_graphs
        self.capture_after_calls = capture_after_calls
        self.pool = pool
        self.warmup_runs = warmup_runs
        self._graphs: dict[Signature, _Captured] = {}
        self._seen: dict[Signature, int] = {}
        self._allowed: frozenset[Signature] | None = None  # set by freeze()
        self.num_replays = 0
        self.num_eager_calls = 0

    @property
    def num_graphs(self) -> int:
        """Signatures captured."""
        return len(self._graphs)

    def reset(self) -> None:
        """Drop every captured graph (e.g. after state the function reads was reallocated). A frozen
        function stays frozen: it captures its signatures again on their second sighting, no others."""
        self._graphs.clear()
        self._seen.clear()

    def freeze(self) -> None:
        """Capture no signature beyond those captured now: any other runs eagerly from here on."""
        self._allowed = frozenset(self._graphs)

    def _capturable(self, sig: Signature) -> bool:
        """Whether a signature not captured now may be: room for a graph, and allowed if frozen."""
        return len(self._graphs) < self.max_graphs and (self._allowed is None or sig in self._allowed)

    @property
    def frozen(self) -> bool:
        return self._allowed is not None

    def __call__(self, *args: torch.Tensor) -> Any:
        assert all(isinstance(a, torch.Tensor) for a in args), "graphed functions take tensors only"
        sig: Signature = tuple((tuple(a.shape), a.dtype, str(a.device)) for a in args)
        captured = self._graphs.get(sig)
        if captured is None:
            capturable = self._capturable(sig)
            if capturable:
                if sig not in self._seen and len(self._seen) >= SEEN_PER_GRAPH * self.max_graphs:
                    del self._seen[next(iter(self._seen))]
                self._seen[sig] = self._seen.get(sig, 0) + 1
            if not capturable or self._seen[sig] < self.capture_after_calls:
                self.num_eager_calls += 1
                return self.fn(*args)
            captured = self._capture(args)
            self._graphs[sig] = captured
        for buf, a in zip(captured.inputs, args):
            buf.copy_(a)
        if captured.graph is not None:
            captured.graph.replay()
        else:  # CPU emulation: recompute into the static outputs
            fresh, _ = pytree.tree_flatten(self.fn(*captured.inputs))
            for buf, value in zip(captured.outputs, fresh):
                buf.copy_(value)
        self.num_replays += 1
        return pytree.tree_unflatten([o.clone() for o in captured.outputs], captured.spec)

    def _capture(self, args: tuple[torch.Tensor, ...]) -> _Captured:
        inputs = [a.clone() for a in args]
        if not args or args[0].device.type != "cuda":
            outputs, spec = pytree.tree_flatten(self.fn(*inputs))
            return _Captured(None, inputs, [o.clone() for o in outputs], spec)
        # Warm up on a side stream (lazy cuBLAS/cuDNN initialisation must not happen during capture).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_runs):
                self.fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine may run CUDA work on its own thread in the same process meanwhile.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            result = self.fn(*inputs)
        outputs, spec = pytree.tree_flatten(result)
        assert all(isinstance(o, torch.Tensor) for o in outputs), "graphed functions return tensors only"
        return _Captured(graph, inputs, outputs, spec)
