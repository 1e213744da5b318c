"""The `triton` attention backend under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors)
against torch_native: EXTEND / DECODE / TARGET_VERIFY / DRAFT_* on random batches with different
prefix lengths (0 included), random trees, GQA, a head size that is not a power of two.
Tolerances: fp32 1e-5 (both accumulate in fp32, only the order differs); fp16 inputs 2e-3
(the kernel accumulates in fp32, torch_native's SDPA in fp16 on the CPU)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run kernels on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from specserve.runtime.forward_batch import ForwardMode  # noqa: E402
from specserve.runtime.layers.attention import TorchNativeBackend  # noqa: E402
from specserve.runtime.layers.attention.triton_backend import (  # noqa: E402
    BLOCK_M,
    TritonAttentionBackend,
    plan_query_blocks,
)
from tests.unit.test_attention_torch_native import make_case  # noqa: E402

MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
         ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_DECODE]


def _run(cls, mode, bsz, seed, dtype=torch.float32, **kw):
    pool, batch, q, k, v, _ = make_case(mode, bsz, seed, **kw)
    if dtype != torch.float32:
        pool.k = [t.to(dtype) for t in pool.k]
        pool.v = [t.to(dtype) for t in pool.v]
        pool.dtype = dtype
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    backend = cls(pool, q.shape[1], q.shape[2] ** -0.5)
    backend.init_forward_metadata(batch)
    return backend.forward(q, k, v, 0, batch).float(), batch


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bsz,seed", [(1, 0), (3, 1), (6, 2)])
def test_triton_equals_torch_native_fp32(mode, bsz, seed):
    want, batch = _run(TorchNativeBackend, mode, bsz, seed)
    got, _ = _run(TritonAttentionBackend, mode, bsz, seed)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.DECODE,
                                  ForwardMode.TARGET_VERIFY])
def test_triton_equals_torch_native_fp16(mode):
    want, _ = _run(TorchNativeBackend, mode, 4, 5, torch.float16)
    got, _ = _run(TritonAttentionBackend, mode, 4, 5, torch.float16)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(6, 1, 24), (4, 4, 8)])
def test_triton_gqa_and_odd_head_dim(heads, kv_heads, head_dim):
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    want, _ = _run(TorchNativeBackend, ForwardMode.TARGET_VERIFY, 3, 9, **kw)
    got, _ = _run(TritonAttentionBackend, ForwardMode.TARGET_VERIFY, 3, 9, **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY])
def test_prefix_zero_and_queries_over_several_blocks(mode):
    """Requests without a prefix next to one with a prefix, and more new tokens than BLOCK_M
    (several query blocks per request)."""
    from specserve.runtime.forward_batch import ForwardBatch
    from specserve.runtime.mem_cache import KVPool, TokenSlotAllocator
    from tests.unit.test_attention_torch_native import ancestor_mask, random_parents

    prefixes, extends = [0, 30, 0], [40, 3, 2 * BLOCK_M + 1]
    outs = []
    for cls in (TorchNativeBackend, TritonAttentionBackend):
        gen = torch.Generator().manual_seed(3)
        pool = KVPool(256, 1, 2, 16, torch.float32, "cpu")
        alloc = TokenSlotAllocator(256)
        slots, masks, positions = [], [], []
        for p, e in zip(prefixes, extends):
            s_ = alloc.alloc(p + e)
            slots.append(s_[torch.randperm(p + e, generator=gen)])
            pool.k[0][slots[-1][:p]] = torch.randn(p, 2, 16, generator=gen)
            pool.v[0][slots[-1][:p]] = torch.randn(p, 2, 16, generator=gen)
            m = ancestor_mask(random_parents(e, gen))
            masks.append(m)
            positions.append(p + m.sum(1) - 1)
        tree = mode.uses_custom_mask
        batch = ForwardBatch.build(mode, [[0] * e for e in extends], slots, prefixes,
                                   positions if tree else None, masks if tree else None,
                                   logits="all")
        t = sum(extends)
        q = torch.randn(t, 4, 16, generator=gen)
        k, v = torch.randn(t, 2, 16, generator=gen), torch.randn(t, 2, 16, generator=gen)
        backend = cls(pool, 4, 0.25)
        backend.init_forward_metadata(batch)
        outs.append(backend.forward(q, k, v, 0, batch))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_query_blocks_plan():
    assert plan_query_blocks([3, 17, 1], 16) == ([0, 1, 1, 2], [0, 0, 16, 0])
