"""FlashInfer's inputs built from our batches
(specserve/runtime/layers/attention/flashinfer_inputs.py): attention computed from exactly those
arrays, by FlashInfer's documented semantics, equals the torch_native backend on random batches and
trees; the packed mask is FlashInfer's segment_packbits layout; the wrapper parameters we pass exist
where flashinfer imports."""

from __future__ import annotations

import inspect

import pytest
import torch

from specserve.runtime.forward_batch import ForwardMode
from specserve.runtime.layers.attention import TorchNativeBackend
from specserve.runtime.layers.attention.flashinfer_inputs import (
    attention_from_flashinfer_inputs,
    build_flashinfer_inputs,
    segment_packbits,
    segment_unpackbits,
)
from tests.unit.test_attention_torch_native import make_case

MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
         ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_DECODE]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bsz,seed", [(1, 11), (4, 12), (7, 13)])
def test_attention_from_the_arrays_equals_torch_native(mode, bsz, seed):
    pool, batch, q, k, v, masks = make_case(mode, bsz, seed)
    scale = 16**-0.5
    backend = TorchNativeBackend(pool, 4, scale)
    backend.init_forward_metadata(batch)
    want = backend.forward(q, k, v, 0, batch)  # also writes the new K/V into the pool
    inputs = build_flashinfer_inputs(batch)
    assert inputs.causal == (mode in (ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND))
    assert inputs.kv_indices.dtype == torch.int32 and inputs.kv_last_page_len.eq(1).all()
    assert inputs.qo_indptr.tolist()[-1] == batch.num_tokens
    assert inputs.kv_indptr.tolist()[-1] == sum(batch.seq_lens)
    got = attention_from_flashinfer_inputs(q, pool.k[0], pool.v[0], inputs, scale)
    torch.testing.assert_close(got, want.double(), atol=1e-5, rtol=1e-5)
    if mode.uses_custom_mask:
        sizes = [e * (p + e) for p, e in zip(batch.prefix_lens, batch.extend_lens)]
        assert inputs.mask_indptr.diff().tolist() == sizes
        # each block: prefix columns visible, then the request's own tree mask
        for b, (p, e) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
            m0 = int(inputs.mask_indptr[b])
            block = inputs.custom_mask[m0: m0 + e * (p + e)].view(e, p + e)
            assert block[:, :p].all() and torch.equal(block[:, p:], masks[b])
    else:
        assert inputs.custom_mask is None and inputs.packed_mask is None


def test_causal_is_bottom_right_aligned_not_top_left():
    """A request extending a prefix: query i sees the prefix and new tokens 0..i, which is
    FlashInfer's bottom-right causal alignment; top-left alignment would hide the prefix."""
    pool, batch, q, k, v, _ = make_case(ForwardMode.EXTEND, 3, 5)
    assert min(batch.prefix_lens) > 0
    backend = TorchNativeBackend(pool, 4, 0.25)
    backend.init_forward_metadata(batch)
    want = backend.forward(q, k, v, 0, batch)
    inputs = build_flashinfer_inputs(batch)
    inputs.causal = False  # full attention over the new tokens: differs
    wrong = attention_from_flashinfer_inputs(q, pool.k[0], pool.v[0], inputs, 0.25)
    assert not torch.allclose(wrong, want.double(), atol=1e-3)


@pytest.mark.parametrize("seed", range(4))
def test_packed_mask_is_segment_packbits_little(seed):
    gen = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(0, 40, (5,), generator=gen)]
    indptr = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    mask = torch.rand(int(indptr[-1]), generator=gen) < 0.5
    packed, pindptr = segment_packbits(mask, indptr)
    assert pindptr.diff().tolist() == [(n + 7) // 8 for n in lens]  # each segment on its own
    assert torch.equal(segment_unpackbits(packed, pindptr, indptr), mask)
    # little-endian bits: element j of a segment is bit j % 8 of the segment's byte j // 8
    for b, n in enumerate(lens):
        seg, base = mask[int(indptr[b]): int(indptr[b + 1])], int(pindptr[b])
        for j in range(n):
            assert bool((int(packed[base + j // 8]) >> (j % 8)) & 1) == bool(seg[j])


def test_tree_batch_packs_every_request_separately():
    _, batch, *_ = make_case(ForwardMode.TARGET_VERIFY, 5, 21)
    inputs = build_flashinfer_inputs(batch)
    assert torch.equal(segment_unpackbits(inputs.packed_mask, inputs.packed_mask_indptr,
                                          inputs.mask_indptr), inputs.custom_mask)


def test_flashinfer_wrapper_parameters_exist_where_it_imports():
    flashinfer = pytest.importorskip("flashinfer")
    prefill = inspect.signature(flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan).parameters
    for name in ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len",
                 "num_qo_heads", "num_kv_heads", "head_dim_qk", "page_size",
                 "packed_custom_mask", "causal", "sm_scale", "q_data_type", "kv_data_type"):
        assert name in prefill, name
    decode = inspect.signature(flashinfer.BatchDecodeWithPagedKVCacheWrapper.plan).parameters
    for name in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size", "sm_scale",
                 "q_data_type", "kv_data_type"):
        assert name in decode, name


def test_flashinfer_backend_refuses_the_cpu_with_a_clear_error():
    from specserve.runtime.errors import SpecserveError
    from specserve.runtime.layers.attention.flashinfer_backend import FlashInferAttentionBackend

    pool, *_ = make_case(ForwardMode.DECODE, 1, 0)
    with pytest.raises(SpecserveError, match="CUDA only"):
        FlashInferAttentionBackend(pool, 4, 0.25)
