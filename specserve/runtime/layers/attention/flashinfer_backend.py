"""`flashinfer` attention (CUDA, for users who have FlashInfer). NOT YET RUN ON A GPU.

Paged KV with page size 1 (our pool's `k[layer]` [slots, KVH, D] viewed as FlashInfer's NHD
cache [pages, 1, KVH, D]); per batch, once, the arrays of `flashinfer_inputs.py` (tested on the
CPU against a reference that computes attention from exactly those arrays) plan one wrapper:

- DECODE: `BatchDecodeWithPagedKVCacheWrapper`;
- EXTEND / DRAFT_EXTEND: `BatchPrefillWithPagedKVCacheWrapper`, causal;
- TARGET_VERIFY / DRAFT_DECODE: the same prefill wrapper with the bit-packed tree mask
  (`packed_custom_mask`, per-request segments, little-endian bits).

Every layer then writes its new K/V into the pool and calls `wrapper.run(q, (k, v))`. The call
shapes follow FlashInfer's `plan()` / `run()` API (0.2+); tests/unit/test_flashinfer_inputs.py
checks the parameter names against the installed package where it imports. Speed, and whether
these calls behave as the reference says, only a GPU will tell (`make gpu-check`).
"""

from __future__ import annotations

import torch

from specserve.runtime.errors import SpecserveError
from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.layers.attention.base import AttentionBackend
from specserve.runtime.layers.attention.flashinfer_inputs import (
    FlashInferInputs,
    build_flashinfer_inputs,
)
from specserve.runtime.mem_cache.kv_pool import KVPool

WORKSPACE_BYTES = 128 * 1024 * 1024


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


class FlashInferAttentionBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool, num_heads: int, scale: float) -> None:
        super().__init__(kv_pool, num_heads, scale)
        if torch.device(kv_pool.device).type != "cuda":
            raise SpecserveError("--attention-backend flashinfer runs on CUDA only "
                                 f"(the KV pool is on {kv_pool.device}); use torch_native")
        try:
            import flashinfer
        except ImportError as e:
            raise SpecserveError("--attention-backend flashinfer needs the flashinfer package "
                                 "(pip install flashinfer-python, matching your torch/CUDA)") from e
        ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=kv_pool.device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="NHD")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout="NHD")

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        inputs = build_flashinfer_inputs(batch)
        dev = self.kv_pool.device
        common = dict(num_kv_heads=self.num_kv_heads, page_size=1,
                      q_data_type=self.kv_pool.dtype, kv_data_type=self.kv_pool.dtype,
                      sm_scale=self.scale)
        if batch.mode == ForwardMode.DECODE:
            self._decode.plan(inputs.kv_indptr.to(dev), inputs.kv_indices.to(dev),
                              inputs.kv_last_page_len.to(dev), num_qo_heads=self.num_heads,
                              head_dim=self.head_dim, **common)
            wrapper = self._decode
        else:
            extra = {}
            if inputs.packed_mask is not None:
                extra["packed_custom_mask"] = inputs.packed_mask.to(dev)
            self._prefill.plan(inputs.qo_indptr.to(dev), inputs.kv_indptr.to(dev),
                               inputs.kv_indices.to(dev), inputs.kv_last_page_len.to(dev),
                               num_qo_heads=self.num_heads, head_dim_qk=self.head_dim,
                               causal=inputs.causal, **common, **extra)
            wrapper = self._prefill
        batch.attn_metadata = (inputs, wrapper)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        inputs, wrapper = batch.attn_metadata
        assert isinstance(inputs, FlashInferInputs)
        self.kv_pool.write(layer_id, batch.out_cache_loc, k, v)
        kc = self.kv_pool.k[layer_id].unsqueeze(1)  # [pages, page_size 1, KVH, D]
        vc = self.kv_pool.v[layer_id].unsqueeze(1)
        out = wrapper.run(q.to(kc.dtype).contiguous(), (kc, vc))
        return out.to(q.dtype)
