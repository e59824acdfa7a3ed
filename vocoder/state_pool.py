"""Slot pool for the flow estimator's per-session conv caches (one slot per open session).

Layer l's caches of all sessions live in one tensor [capacity, num_steps, branches, C_l, ctx_l], so a
batched step reads and writes every session's state with one index op per layer and Euler step.
"""

from __future__ import annotations

import threading

import torch


class FlowStatePool:
    """Fixed-shape conv caches per slot; zeros = the start of a stream (same as zero padding)."""

    def __init__(
        self,
        shapes: list[tuple[int, int]],
        num_steps: int,
        num_branches: int,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        capacity: int = 8,
    ):
        self.shapes = shapes
        self.num_steps = num_steps
        self.num_branches = num_branches
        self.device = torch.device(device)
        self.dtype = dtype
        self.tensors = [self._zeros(capacity, c, ctx) for c, ctx in shapes]
        self.free_slots = list(range(capacity - 1, -1, -1))
        self.generation = 0  # bumped when the tensors are reallocated (captured graphs must be dropped)
        self._lock = threading.Lock()  # slots are taken and given back from more than one thread (lanes)

    def _zeros(self, capacity: int, channels: int, context: int) -> torch.Tensor:
        return torch.zeros(
            capacity,
            self.num_steps,
            self.num_branches,
            channels,
            context,
            device=self.device,
            dtype=self.dtype,
        )

    @property
    def capacity(self) -> int:
        """Number of slots currently allocated."""
        return self.tensors[0].shape[0] if self.tensors else 0

    @property
    def num_used(self) -> int:
        """Slots held by sessions."""
        return self.capacity - len(self.free_slots)

    def reserve(self, capacity: int) -> None:
        """Grow to at least `capacity` slots now, so no later `allocate` has to (which would drop every
        captured graph that reads the pool)."""
        with self._lock:
            if capacity > self.capacity:
                self._grow(capacity)

    def _grow(self, new: int) -> None:
        old = self.capacity
        self.tensors = [
            torch.cat([t, self._zeros(new - old, c, ctx)]) for t, (c, ctx) in zip(self.tensors, self.shapes)
        ]
        # lowest free slot first: pop() takes from the end
        self.free_slots = sorted(self.free_slots + list(range(old, new)), reverse=True)
        self.generation += 1

    def allocate(self) -> int:
        """A zeroed slot; doubles the pool when full."""
        with self._lock:
            if not self.free_slots:
                self._grow(max(1, 2 * self.capacity))
            slot = self.free_slots.pop()
        self.zero(slot)
        return slot

    def take(self, count: int) -> list[int] | None:
        """`count` free slots, not zeroed (`zero` them where they will be used), or None when fewer are
        free; never grows, so it is safe while another thread's work reads the pool's tensors."""
        with self._lock:
            if len(self.free_slots) < count:
                return None
            return [self.free_slots.pop() for _ in range(count)]

    def zero(self, slot: int) -> None:
        """Reset `slot` to the start of a stream."""
        for t in self.tensors:
            t[slot].zero_()

    def release(self, slot: int) -> None:
        """Give a slot back."""
        with self._lock:
            assert slot not in self.free_slots, slot
            self.free_slots.append(slot)

    def read(self, slots: torch.Tensor, step: int) -> list[torch.Tensor]:
        """Caches of Euler step `step` for `slots` [B]: list of [branches*B, C, ctx], branch-major rows."""
        return [layer[step] for layer in self.read_steps(slots)]

    def read_steps(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """Caches of every Euler step for `slots` [B]: per layer [num_steps, branches*B, C, ctx], rows
        branch-major; two kernels per layer, whatever the number of steps (the flow solve reads them so)."""
        out = []
        for t in self.tensors:
            x = t[slots]  # [B, steps, branches, C, ctx]
            out.append(x.permute(1, 2, 0, 3, 4).reshape(self.num_steps, -1, x.shape[3], x.shape[4]))
        return out

    def write(self, slots: torch.Tensor, step: int, caches: list[torch.Tensor]) -> None:
        """Inverse of `read`."""
        assert len(caches) == len(self.tensors)
        b = slots.shape[0]
        for t, c in zip(self.tensors, caches):
            t[slots, step] = (
                c.reshape(self.num_branches, b, c.shape[1], c.shape[2]).transpose(0, 1).to(t.dtype)
            )

    def write_steps(self, slots: torch.Tensor, stacked: list[torch.Tensor]) -> None:
        """All Euler steps at once: stacked[l] is layer l's caches [num_steps, branches*B, C, ctx]."""
        assert len(stacked) == len(self.tensors)
        b = slots.shape[0]
        for t, c in zip(self.tensors, stacked):
            k, _, ch, ctx = c.shape
            t[slots] = c.reshape(k, self.num_branches, b, ch, ctx).permute(2, 0, 1, 3, 4).to(t.dtype)

    def snapshot(self, slot: int) -> list[torch.Tensor]:
        """A copy of `slot`'s caches (every layer, every Euler step), for `restore`."""
        return [t[slot].clone() for t in self.tensors]

    def restore(self, slot: int, snapshot: list[torch.Tensor]) -> None:
        """Overwrite `slot`'s caches with a `snapshot` (same shapes)."""
        assert len(snapshot) == len(self.tensors)
        for t, saved in zip(self.tensors, snapshot):
            t[slot].copy_(saved)
