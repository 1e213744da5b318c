"""The attention-backend interface. Device differences live below it, never above.

A backend is created once per model runner with the KV pool. Per forward, the runner calls
`init_forward_metadata(batch)` once (plans indices/masks, stores them in `batch.attn_metadata`);
then every layer calls `forward(q, k, v, layer_id, batch)`, which writes the new tokens' K/V into
the pool at `batch.out_cache_loc` and attends over each request's prefix + new tokens with the
mode's mask: causal (EXTEND, DRAFT_EXTEND), one token over everything (DECODE), or the request's
custom `[extend_len, extend_len]` tree mask over its own tokens plus the full prefix
(TARGET_VERIFY, DRAFT_DECODE).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from specserve.runtime.forward_batch import ForwardBatch
from specserve.runtime.mem_cache.kv_pool import KVPool


class AttentionBackend(ABC):
    def __init__(self, kv_pool: KVPool, num_heads: int, scale: float) -> None:
        self.kv_pool = kv_pool
        self.num_heads = num_heads
        self.num_kv_heads = kv_pool.num_kv_heads
        self.head_dim = kv_pool.head_dim
        self.scale = scale

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Plan the batch once; layers reuse what is stored in `batch.attn_metadata`."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """q [T, num_heads, head_dim], k/v [T, num_kv_heads, head_dim] → [T, heads, head_dim]."""

    def forward_window(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
        batch: ForwardBatch, window: int,
    ) -> torch.Tensor:
        """`forward` with each query also limited to the keys less than `window` positions
        before its own (a sliding-window layer). Models call it only when some request's
        sequence is longer than the window (else it is `forward`)."""
        raise NotImplementedError(
            f"the {type(self).__name__} attention backend has no sliding-window attention; "
            f"use torch_native, or the CPU engine (--weight-format auto), or a context of at "
            f"most {window} tokens")
