"""`ForwardBatch`: everything one model forward needs, passed to the model as an argument.

Lengths follow one vocabulary everywhere:
- `prefix_len`: tokens of a request already in the KV cache before this forward;
- `extend_len`: new tokens of the request in this forward (1 in DECODE, N tree nodes in VERIFY);
- `seq_len = prefix_len + extend_len`: KV length after this forward.
Token-major tensors are flattened over the batch in request order.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill of new tokens over a cached prefix, causal
    DECODE = "decode"  # one new token per request
    TARGET_VERIFY = "target_verify"  # a draft tree per request, custom mask over its nodes
    DRAFT_EXTEND = "draft_extend"  # draft model/head catching up on accepted tokens (causal)
    DRAFT_DECODE = "draft_decode"  # draft model/head one step over tree frontier nodes

    @property
    def uses_custom_mask(self) -> bool:
        return self in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE)


@dataclass(slots=True)
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64, T = sum(extend_lens)
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: KV slots the new tokens are written to
    extend_lens: list[int]  # [B]
    prefix_lens: list[int]  # [B]
    # Slots of every KV token each request attends to (prefix then new tokens), CSR layout:
    kv_indices: torch.Tensor  # [sum(seq_lens)] int64
    # Which rows of the hidden states get logits: [num_logits] int64 into [0, T)
    logits_indices: torch.Tensor
    # CUSTOM MASK modes: per request an [extend_len, extend_len] bool mask over its own new
    # tokens (True = may attend); the prefix is always fully visible.
    custom_masks: list[torch.Tensor] | None = None
    # Layers whose output hidden states the caller wants back (e.g. EAGLE-3: low/mid/high).
    capture_layers: tuple[int, ...] = ()
    # Set by the attention backend's `init_forward_metadata`, reused by every layer.
    attn_metadata: Any = field(default=None)
    # >= 0: some request wants logprobs from these logits, with this many alternatives; an
    # engine that can computes each row's log-sum-exp and top entries with its argmax
    # (ModelOutput.logit_stats); -1: nobody asked
    logit_top: int = -1

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def check(self) -> None:
        assert len(self.prefix_lens) == len(self.extend_lens), "prefix/extend lengths differ in B"
        assert self.num_tokens == sum(self.extend_lens), "input_ids do not match extend_lens"
        assert self.positions.numel() == self.num_tokens, "positions do not match input_ids"
        assert self.out_cache_loc.numel() == self.num_tokens, "out_cache_loc mismatch"
        assert self.kv_indices.numel() == sum(self.seq_lens), "kv_indices mismatch"
        if self.mode.uses_custom_mask:
            assert self.custom_masks is not None, f"{self.mode} needs custom_masks"
            for m, e in zip(self.custom_masks, self.extend_lens):
                assert tuple(m.shape) == (e, e), f"custom mask {tuple(m.shape)} for {e} tokens"

    def to(self, device: torch.device) -> ForwardBatch:
        if self.input_ids.device == device:
            return self
        for name in ("input_ids", "positions", "out_cache_loc", "kv_indices", "logits_indices"):
            setattr(self, name, getattr(self, name).to(device, non_blocking=True))
        if self.custom_masks is not None:
            self.custom_masks = [m.to(device) for m in self.custom_masks]
        return self

    @staticmethod
    def build(
        mode: ForwardMode,
        new_tokens: list[list[int]],
        kv_slots: list[torch.Tensor],
        prefix_lens: list[int],
        positions: list[torch.Tensor] | torch.Tensor | None = None,
        custom_masks: list[torch.Tensor] | None = None,
        logits: str = "last",
        capture_layers: tuple[int, ...] = (),
        logit_top: int = -1,
    ) -> ForwardBatch:
        """Assemble a batch from per-request pieces.

        `kv_slots[b]` holds all `seq_len` slots of request b (prefix first); the new tokens'
        KV goes to its last `extend_len` entries. `positions[b]` defaults to
        prefix_len + arange(extend_len) (trees pass prefix_len + depth); one [T] tensor of every
        new token's position, requests in order, may stand for the list. `logits` is "last"
        (one row per request) or "all" (every new token: verification).
        """
        # Index arithmetic in Python lists, then one tensor per field: after a forward has
        # streamed the weights through the caches, each small torch op costs 20-60 us cold (a
        # 3 us torch.cat measured 56-79 us there), so a per-request slice or arange of a batch
        # of 32 was ~1 ms of bookkeeping a step (`python -m benchmark.bench_step_bookkeeping`).
        extend_lens = [len(t) for t in new_tokens]
        seq_lens = [s.numel() for s in kv_slots]
        for b, (n, p, e) in enumerate(zip(seq_lens, prefix_lens, extend_lens)):
            assert n == p + e, f"request {b}: {n} slots for {p}+{e} tokens"
        if positions is None:
            positions = torch.tensor([p + i for p, e in zip(prefix_lens, extend_lens)
                                      for i in range(e)], dtype=torch.int64)
        elif not isinstance(positions, torch.Tensor):
            positions = torch.cat(positions)
        kv_indices = torch.cat(kv_slots)
        new_rows, off = [], 0  # where each request's new tokens' slots sit in kv_indices
        for n, p in zip(seq_lens, prefix_lens):
            new_rows.extend(range(off + p, off + n))
            off += n
        if logits == "last":
            logits_indices = torch.tensor([end - 1 for end in accumulate(extend_lens)],
                                          dtype=torch.int64)
        else:
            logits_indices = torch.arange(len(new_rows))
        return ForwardBatch(
            mode=mode,
            input_ids=torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.int64),
            positions=positions.to(torch.int64),
            out_cache_loc=kv_indices[torch.tensor(new_rows, dtype=torch.int64)],
            extend_lens=extend_lens,
            prefix_lens=list(prefix_lens),
            kv_indices=kv_indices,
            logits_indices=logits_indices,
            custom_masks=custom_masks,
            capture_layers=capture_layers,
            logit_top=logit_top,
        )
