"""Request → token-slot table: row r lists the KV slots of request r's tokens in order.

Rows are handed out like slots: `alloc_row` / `free_row`. Invariant: a row in use belongs to one
request; `num_free_rows` returns to `max_requests` when every request has finished.
"""

from __future__ import annotations

import torch


class ReqToTokenTable:
    def __init__(self, max_requests: int, max_context_len: int) -> None:
        self.max_requests = max_requests
        self.max_context_len = max_context_len
        # [max_requests, max_context_len] slot indices; 0 = padding
        self.table = torch.zeros((max_requests, max_context_len), dtype=torch.int64)
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise RuntimeError("no free request rows")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        assert row not in self._free_rows, f"row {row} freed twice"
        self.table[row].zero_()
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        end = start + slots.numel()
        assert end <= self.max_context_len, f"context {end} exceeds {self.max_context_len}"
        self.table[row, start:end] = slots

    def slots(self, row: int, length: int) -> torch.Tensor:
        return self.table[row, :length]
