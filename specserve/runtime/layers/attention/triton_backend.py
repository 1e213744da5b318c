"""`triton` attention: one Triton kernel per layer for every mode, paged KV (page size 1).

For CUDA; proven on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`, which runs the
kernel's exact indexing and masking on CPU tensors): tests/unit/test_triton_attention.py checks
it against torch_native on random batches, and a slow test serves the default model through it.
Its speed, and compile-time limits such as block sizes and shared memory, only a GPU will tell.

Per batch, once (`init_forward_metadata`): `qo_indptr` / `kv_indptr` / `kv_indices` (the same
arrays as the flashinfer backend, `flashinfer_inputs.py`), the query blocks (BLOCK_M rows of one
request each: its request and first row), and for tree modes the flat mask of each request's
`[q_len, kv_len]` block (prefix columns True, then its tree mask) with `mask_indptr`, SGLang's
Triton layout. Per layer: the new K/V are written into the pool, then one launch over
(query blocks, heads). A program loads its BLOCK_M query rows and walks the request's KV in
BLOCK_N slots gathered through `kv_indices`, with an online softmax in fp32 (running max and
sum), masking by mode: everything (DECODE), bottom-right causal (EXTEND, DRAFT_EXTEND: row i of
q_len sees columns <= kv_len - q_len + i), or the flat mask (TARGET_VERIFY, DRAFT_DECODE).
GQA: head h reads KV head h // (heads / kv_heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.runtime.errors import SpecserveError
from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.layers.attention.base import AttentionBackend
from specserve.runtime.layers.attention.flashinfer_inputs import build_flashinfer_inputs
from specserve.runtime.mem_cache.kv_pool import KVPool

BLOCK_M = 16  # query rows per program (tl.dot wants >= 16 on a GPU)
BLOCK_N = 32  # KV slots per inner step
MODE_FULL, MODE_CAUSAL, MODE_MASK = 0, 1, 2

try:
    import triton
    import triton.language as tl
except ImportError:  # the backend reports it when asked for
    triton = None


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _attention_kernel(
        Q, K, V, OUT, KV_INDICES, QO_INDPTR, KV_INDPTR, BLOCK_REQ, BLOCK_ROW, MASK, MASK_INDPTR,
        sm_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        b = tl.load(BLOCK_REQ + pid_m)
        row0 = tl.load(BLOCK_ROW + pid_m)  # first query row of this block, within the request
        q_start = tl.load(QO_INDPTR + b)
        q_len = tl.load(QO_INDPTR + b + 1) - q_start
        kv_start = tl.load(KV_INDPTR + b)
        kv_len = tl.load(KV_INDPTR + b + 1) - kv_start

        rows = row0 + tl.arange(0, BLOCK_M)  # [M]
        row_ok = rows < q_len
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q_ptr = Q + (q_start + rows)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)

        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        if MODE == 2:
            mask_base = tl.load(MASK_INDPTR + b)
        for start in range(0, kv_len, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)  # [N]
            col_ok = cols < kv_len
            slots = tl.load(KV_INDICES + kv_start + cols, mask=col_ok, other=0).to(tl.int64)
            kv_off = slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
            kv_ok = col_ok[:, None] & d_ok[None, :]
            k = tl.load(K + kv_off, mask=kv_ok, other=0.0).to(tl.float32)  # [N, D]
            v = tl.load(V + kv_off, mask=kv_ok, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale  # [M, N]
            allowed = row_ok[:, None] & col_ok[None, :]
            if MODE == 1:
                allowed = allowed & (cols[None, :] <= (kv_len - q_len + rows)[:, None])
            if MODE == 2:
                m_ptr = MASK + mask_base + rows[:, None] * kv_len + cols[None, :]
                bits = tl.load(m_ptr, mask=allowed, other=0)
                allowed = allowed & (bits != 0)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # rows with nothing visible yet keep m = -inf: shift by 0 so exp() gives 0, not nan
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptr = OUT + (q_start + rows)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@dataclass(slots=True)
class TritonMetadata:
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    block_req: torch.Tensor  # [num blocks] request of each query block
    block_row: torch.Tensor  # [num blocks] its first row within the request
    mask: torch.Tensor  # flat uint8 (tree modes) or a 1-element dummy
    mask_indptr: torch.Tensor
    mode: int


def plan_query_blocks(extend_lens: list[int], block_m: int = BLOCK_M) -> tuple[list, list]:
    """(request, first row) of every BLOCK_M-row query block, request-major."""
    reqs, rows = [], []
    for b, e in enumerate(extend_lens):
        for r in range(0, e, block_m):
            reqs.append(b)
            rows.append(r)
    return reqs, rows


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool, num_heads: int, scale: float) -> None:
        if triton is None:
            raise SpecserveError("--attention-backend triton needs the triton package "
                                 "(pip install triton)")
        super().__init__(kv_pool, num_heads, scale)
        if num_heads % self.num_kv_heads:
            raise SpecserveError(f"{num_heads} attention heads are not a multiple of "
                                 f"{self.num_kv_heads} KV heads")

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        dev = self.kv_pool.device
        inputs = build_flashinfer_inputs(batch, pack=False)
        reqs, rows = plan_query_blocks(batch.extend_lens)
        if batch.mode.uses_custom_mask:
            mode = MODE_MASK
            mask = inputs.custom_mask.to(torch.uint8)
            mask_indptr = inputs.mask_indptr
        else:
            mode = MODE_CAUSAL if batch.mode in (ForwardMode.EXTEND,
                                                 ForwardMode.DRAFT_EXTEND) else MODE_FULL
            mask = torch.zeros(1, dtype=torch.uint8)
            mask_indptr = torch.zeros(batch.batch_size + 1, dtype=torch.int32)
        batch.attn_metadata = TritonMetadata(
            inputs.qo_indptr.to(dev), inputs.kv_indptr.to(dev), inputs.kv_indices.to(dev),
            torch.tensor(reqs, dtype=torch.int32, device=dev),
            torch.tensor(rows, dtype=torch.int32, device=dev),
            mask.to(dev), mask_indptr.to(dev), mode)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        meta: TritonMetadata = batch.attn_metadata
        self.kv_pool.write(layer_id, batch.out_cache_loc, k, v)
        kc, vc = self.kv_pool.k[layer_id], self.kv_pool.v[layer_id]
        q = q.to(kc.dtype).contiguous()
        out = torch.empty_like(q)
        grid = (int(meta.block_req.numel()), self.num_heads)
        _attention_kernel[grid](
            q, kc, vc, out, meta.kv_indices, meta.qo_indptr, meta.kv_indptr, meta.block_req,
            meta.block_row, meta.mask, meta.mask_indptr, self.scale,
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), out.stride(0), out.stride(1),
            GROUP=self.num_heads // self.num_kv_heads, HEAD_DIM=self.head_dim,
            BLOCK_D=max(16, triton.next_power_of_2(self.head_dim)), BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N, MODE=meta.mode,
        )
        return out
