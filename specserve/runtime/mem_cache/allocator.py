"""Token-slot allocator: hands out indices into the KV pool.

Invariant (checked by `check_integrity`): every slot in [1, capacity] is either free or owned by
exactly one holder; `num_free` returns to `capacity` once everything allocated has been freed.
Slot 0 is never handed out: it is the padding slot that batched gathers may point at.
"""

from __future__ import annotations

import numpy as np
import torch


class OutOfSlotsError(RuntimeError):
    """The pool has fewer free slots than requested (the scheduler retracts or waits)."""


class TokenSlotAllocator:
    """The free stack and the ownership marks are numpy arrays: every decode step allocates and
    (speculative steps) frees a few slots per request, and torch's per-op dispatch made that
    tens of microseconds per request and step, a visible part of a batch-1 step's time outside
    the forward (docs/benchmarks.md, "Step time outside the forward"). Slots go in and out as
    int64 tensors."""

    def __init__(self, capacity: int) -> None:
        assert capacity > 0, "capacity must be positive"
        self.capacity = capacity
        self.clear()

    def clear(self) -> None:
        # A stack of free slots; the top is the end of the array. Slots are 1..capacity.
        self._free = np.arange(self.capacity, 0, -1, dtype=np.int64)
        self._num_free = self.capacity
        self._owned = np.zeros(self.capacity + 1, dtype=bool)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.capacity - self._num_free

    def alloc(self, n: int) -> torch.Tensor:
        """Return `n` free slot indices ([n] int64) or raise OutOfSlotsError."""
        assert n >= 0, f"cannot allocate {n} slots"
        if n > self._num_free:
            raise OutOfSlotsError(f"need {n} KV slots, {self._num_free} free")
        out = self._free[self._num_free - n : self._num_free][::-1].copy()
        self._num_free -= n
        self._owned[out] = True
        return torch.from_numpy(out)

    def free(self, slots: torch.Tensor) -> None:
        """Give slots back. Freeing a slot that is not allocated is a bug and asserts."""
        if slots.numel() == 0:
            return
        if slots.dtype == torch.int64 and slots.dim() == 1 and slots.device.type == "cpu":
            idx = slots.numpy()
        else:
            idx = slots.detach().to("cpu", torch.int64).reshape(-1).numpy()
        n = idx.size
        if n <= 64:  # a step's few slots: plain Python checks beat numpy's per-call cost
            lst = idx.tolist()
            assert 0 <= min(lst) and max(lst) <= self.capacity, "slot out of range"
            assert len(set(lst)) == n, "duplicate slots in one free"
        else:
            assert 0 <= idx.min() and idx.max() <= self.capacity, "slot out of range"
            assert np.unique(idx).size == n, "duplicate slots in one free"
        assert self._owned[idx].all(), "double free or foreign slot"
        self._owned[idx] = False
        self._free[self._num_free : self._num_free + n] = idx[::-1]
        self._num_free += n

    def check_integrity(self) -> None:
        free = self._free[: self._num_free]
        assert np.unique(free).size == self._num_free, "free list holds duplicates"
        assert not self._owned[free].any(), "a free slot is marked owned"
        assert int(self._owned.sum()) == self.capacity - self._num_free, "owned count mismatch"
        assert not self._owned[0], "slot 0 is padding and is never owned"
