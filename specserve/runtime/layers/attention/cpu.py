"""`cpu` attention: the CPU engine's query-invariant kernel (specserve/kernels/cpu/csrc).

Each query row attends exactly the keys it may see, in position order: its request's prefix,
then its ancestors in the draft tree (TARGET_VERIFY / DRAFT_DECODE) or the new tokens up to itself
(causal modes). Masked keys are skipped, not multiplied by zero, and each row's reductions run in
a fixed order over that list, so a verify row's output equals the same token's decode-step output
bit for bit. `init_forward_metadata` turns the batch into the kernel's index arrays once; the
fused CPU model reads them for all layers, and `forward` serves any model that calls the backend
per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from specserve.runtime.forward_batch import ForwardBatch
from specserve.runtime.layers.attention.base import AttentionBackend

_EMPTY_U8 = torch.empty(0, dtype=torch.uint8)
_EMPTY_I64 = torch.empty(0, dtype=torch.int64)


@dataclass(slots=True)
class CpuAttnMetadata:
    tok_req: torch.Tensor  # [T] int32: request of each new token
    tok_local: torch.Tensor  # [T] int32: its index among the request's new tokens
    kv_indptr: torch.Tensor  # [B + 1] int64 into batch.kv_indices
    prefix_len: torch.Tensor  # [B] int32
    extend_len: torch.Tensor  # [B] int32
    masks: torch.Tensor  # [sum n_b^2] uint8, each request's tree mask row-major; empty: causal
    mask_indptr: torch.Tensor  # [B + 1] int64, empty when causal


def plan(batch: ForwardBatch) -> CpuAttnMetadata:
    # Python lists, then one tensor each: small torch ops run with cold caches right after a
    # forward (20-60 us each, see ForwardBatch.build)
    ext_l, pre_l = batch.extend_lens, batch.prefix_lens
    ext = torch.tensor(ext_l, dtype=torch.int32)
    pre = torch.tensor(pre_l, dtype=torch.int32)
    t = batch.num_tokens
    if batch.batch_size == 1:
        tok_req = torch.zeros(t, dtype=torch.int32)
        tok_local = torch.arange(t, dtype=torch.int32)
        kv_indptr = torch.tensor([0, pre_l[0] + ext_l[0]])
    else:
        req_l, local_l = [], []
        for b, e in enumerate(ext_l):
            req_l.extend([b] * e)
            local_l.extend(range(e))
        tok_req = torch.tensor(req_l, dtype=torch.int32)
        tok_local = torch.tensor(local_l, dtype=torch.int32)
        kv_indptr = torch.tensor(list(accumulate((p + e for p, e in zip(pre_l, ext_l)),
                                                 initial=0)), dtype=torch.int64)
    masks, mask_indptr = _EMPTY_U8, _EMPTY_I64
    if batch.mode.uses_custom_mask:
        masks = torch.cat([m.reshape(-1) for m in batch.custom_masks]).to(torch.uint8)
        mask_indptr = torch.tensor(list(accumulate((e * e for e in ext_l), initial=0)),
                                   dtype=torch.int64)
    return CpuAttnMetadata(tok_req, tok_local, kv_indptr, pre, ext, masks, mask_indptr)


class CpuAttentionBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        assert batch.input_ids.device.type == "cpu", "the cpu attention backend runs on the CPU"
        batch.attn_metadata = plan(batch)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        from specserve.kernels import cpu

        meta: CpuAttnMetadata = batch.attn_metadata
        self.kv_pool.write(layer_id, batch.out_cache_loc, k, v)
        num_tokens = q.shape[0]
        out = cpu.load().attention(
            q.reshape(num_tokens, -1), self.kv_pool.k[layer_id], self.kv_pool.v[layer_id],
            self.num_heads, meta.tok_req, meta.tok_local, meta.kv_indptr, batch.kv_indices,
            meta.prefix_len, meta.extend_len, meta.masks, meta.mask_indptr, self.scale,
            torch.get_num_threads(), "",
        )
        return out.view(num_tokens, self.num_heads, self.head_dim).to(q.dtype)
