"""FlashInfer's paged-attention inputs, built from a `ForwardBatch` by pure torch functions.

The `flashinfer` backend (flashinfer_backend.py) plans FlashInfer's wrappers with these arrays;
they are built and tested here on the CPU, against `attention_from_flashinfer_inputs`, which
computes attention from exactly these arrays by FlashInfer's documented semantics:

- page size 1: a page is a KV slot of our pool, so `kv_indices` are slot ids and every
  `kv_last_page_len` is 1;
- `qo_indptr[b]:qo_indptr[b+1]` are request b's query rows (its new tokens),
  `kv_indptr[b]:kv_indptr[b+1]` index `kv_indices` for its whole KV (prefix, then the new tokens,
  whose K/V the backend writes before attending);
- causal prefill (EXTEND, DRAFT_EXTEND) aligns the query block to the bottom right: query i of
  a request with q_len rows and kv_len columns sees columns `<= kv_len - q_len + i`;
- decode: one query row per request over all its KV;
- tree verify (TARGET_VERIFY, DRAFT_DECODE): `custom_mask` is one flat bool array holding each
  request's `[q_len, kv_len]` block row-major (prefix columns all True, then its tree mask), at
  offsets `mask_indptr = cumsum(q_len * kv_len)`; FlashInfer bit-packs it per request segment
  with little-endian bit order (`segment_packbits(mask, mask_indptr, bitorder="little")`:
  element j of a segment is bit j % 8 of byte j // 8), `packed_mask_indptr = cumsum(ceil(q_len
  * kv_len / 8))`.

Not yet run on a GPU: the arrays are proven here; the wrapper calls only a GPU will check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specserve.runtime.forward_batch import ForwardBatch, ForwardMode


@dataclass(slots=True)
class FlashInferInputs:
    mode: ForwardMode
    qo_indptr: Tensor  # [B + 1] int32
    kv_indptr: Tensor  # [B + 1] int32
    kv_indices: Tensor  # [sum(seq_lens)] int32: slot ids (page size 1)
    kv_last_page_len: Tensor  # [B] int32, all 1
    causal: bool
    custom_mask: Tensor | None = None  # flat bool (tree modes)
    mask_indptr: Tensor | None = None  # [B + 1] int32 into custom_mask
    packed_mask: Tensor | None = None  # uint8, per-request segments bit-packed (little)
    packed_mask_indptr: Tensor | None = None  # [B + 1] int32 into packed_mask

    @property
    def batch_size(self) -> int:
        return int(self.qo_indptr.numel()) - 1


def _indptr(lens: list[int]) -> Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    if lens:
        out[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    return out


def flat_tree_mask(batch: ForwardBatch) -> tuple[Tensor, Tensor]:
    """Each request's [extend_len, seq_len] mask (prefix all True, then its tree mask),
    flattened row-major and concatenated, and its indptr."""
    blocks, sizes = [], []
    for m, p, e in zip(batch.custom_masks, batch.prefix_lens, batch.extend_lens):
        block = torch.ones((e, p + e), dtype=torch.bool)
        block[:, p:] = m.to("cpu", torch.bool)
        blocks.append(block.reshape(-1))
        sizes.append(e * (p + e))
    flat = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool)
    return flat, _indptr(sizes)


def segment_packbits(mask: Tensor, indptr: Tensor) -> tuple[Tensor, Tensor]:
    """Bit-pack each segment `mask[indptr[b]:indptr[b+1]]` on its own, little-endian bit order
    (FlashInfer's `segment_packbits(..., bitorder="little")`); returns (bytes, their indptr)."""
    weights = (1 << torch.arange(8, dtype=torch.int32))
    segs, sizes = [], []
    for b in range(indptr.numel() - 1):
        seg = mask[int(indptr[b]): int(indptr[b + 1])].to(torch.int32)
        nbytes = (seg.numel() + 7) // 8
        padded = torch.zeros(nbytes * 8, dtype=torch.int32)
        padded[: seg.numel()] = seg
        segs.append((padded.view(nbytes, 8) * weights).sum(1).to(torch.uint8))
        sizes.append(nbytes)
    packed = torch.cat(segs) if segs else torch.zeros(0, dtype=torch.uint8)
    return packed, _indptr(sizes)


def segment_unpackbits(packed: Tensor, packed_indptr: Tensor, indptr: Tensor) -> Tensor:
    """Inverse of `segment_packbits` (segment lengths from `indptr`)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    out = []
    for b in range(indptr.numel() - 1):
        n = int(indptr[b + 1] - indptr[b])
        seg = packed[int(packed_indptr[b]): int(packed_indptr[b + 1])]
        bits = ((seg[:, None] >> shifts) & 1).reshape(-1)[:n]
        out.append(bits.bool())
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.bool)


def build_flashinfer_inputs(batch: ForwardBatch, pack: bool = True) -> FlashInferInputs:
    """FlashInfer's plan() arrays for `batch` (on the CPU; the backend moves them)."""
    inputs = FlashInferInputs(
        mode=batch.mode,
        qo_indptr=_indptr(batch.extend_lens),
        kv_indptr=_indptr(batch.seq_lens),
        kv_indices=batch.kv_indices.to("cpu", torch.int32),
        kv_last_page_len=torch.ones(batch.batch_size, dtype=torch.int32),
        causal=batch.mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND),
    )
    if batch.mode.uses_custom_mask:
        inputs.custom_mask, inputs.mask_indptr = flat_tree_mask(batch)
        if pack:
            inputs.packed_mask, inputs.packed_mask_indptr = segment_packbits(
                inputs.custom_mask, inputs.mask_indptr)
    return inputs


def attention_from_flashinfer_inputs(q: Tensor, k_cache: Tensor, v_cache: Tensor,
                                     inputs: FlashInferInputs, sm_scale: float) -> Tensor:
    """Reference: attention computed from the arrays alone (float64), FlashInfer's semantics.

    q [T, H, D]; k_cache / v_cache [num_slots, KVH, D] (page size 1, NHD). Returns [T, H, D].
    """
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    mask = inputs.custom_mask
    if mask is None and inputs.packed_mask is not None:
        raise ValueError("a packed mask needs the flat mask's indptr: unpack it first")
    for b in range(inputs.batch_size):
        q0, q1 = int(inputs.qo_indptr[b]), int(inputs.qo_indptr[b + 1])
        k0, k1 = int(inputs.kv_indptr[b]), int(inputs.kv_indptr[b + 1])
        q_len, kv_len = q1 - q0, k1 - k0
        slots = inputs.kv_indices[k0:k1].long()
        keys = k_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        values = v_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        if mask is not None:
            m0 = int(inputs.mask_indptr[b])
            allowed = mask[m0: m0 + q_len * kv_len].view(q_len, kv_len)
        elif inputs.causal:
            allowed = (torch.arange(kv_len)[None, :]
                       <= (kv_len - q_len + torch.arange(q_len))[:, None])
        else:
            allowed = torch.ones((q_len, kv_len), dtype=torch.bool)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), keys) * sm_scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out
