"""Token-slot allocator: hands out indices into the KV pool.

Invariant (checked by `check_integrity`): every slot in [1, capacity] is either free or owned by
exactly one holder; `num_free` returns to `capacity` once everything allocated has been freed.
Slot 0 is never handed out: it is the padding slot that batched gathers may point at.
"""

from __future__ import annotations

import torch


class OutOfSlotsError(RuntimeError):
    """The pool has fewer free slots than requested (the scheduler retracts or waits)."""


class TokenSlotAllocator:
    def __init__(self, capacity: int) -> None:
        assert capacity > 0, "capacity must be positive"
        self.capacity = capacity
        self.clear()

    def clear(self) -> None:
        # A stack of free slots; the top is the end of the tensor. Slots are 1..capacity.
        self._free = torch.arange(self.capacity, 0, -1, dtype=torch.int64)
        self._num_free = self.capacity
        self._owned = torch.zeros(self.capacity + 1, dtype=torch.bool)

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
        out = self._free[self._num_free - n : self._num_free].flip(0).clone()
        self._num_free -= n
        self._owned[out] = True
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Give slots back. Freeing a slot that is not allocated is a bug and asserts."""
        if slots.numel() == 0:
            return
        slots = slots.to(torch.int64).flatten().cpu()
        assert bool(self._owned[slots].all()), "double free or foreign slot"
        assert slots.unique().numel() == slots.numel(), "duplicate slots in one free"
        self._owned[slots] = False
        n = slots.numel()
        self._free[self._num_free : self._num_free + n] = slots.flip(0)
        self._num_free += n

    def check_integrity(self) -> None:
        free = self._free[: self._num_free]
        assert free.unique().numel() == self._num_free, "free list holds duplicates"
        assert not bool(self._owned[free].any()), "a free slot is marked owned"
        assert int(self._owned.sum()) == self.capacity - self._num_free, "owned count mismatch"
        assert not bool(self._owned[0]), "slot 0 is padding and is never owned"
