"""torch_native attention vs a dense float64 reference, per mode, on random batches."""

from __future__ import annotations

import pytest
import torch

from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.layers.attention import TorchNativeBackend
from specserve.runtime.layers.attention.torch_native import slot_run
from specserve.runtime.mem_cache import KVPool, TokenSlotAllocator


def random_parents(n: int, gen: torch.Generator) -> list[int]:
    # node 0 is the root; every other node hangs under an earlier node
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    mask = torch.zeros((n, n), dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    return mask


def dense_attention(q, keys, values, allowed, scale):
    # q [h, d]; keys/values [S, kvh, d]; allowed [S] bool → [h, d], in float64
    h, kvh = q.shape[0], keys.shape[1]
    k = keys.double().repeat_interleave(h // kvh, dim=1)[allowed]  # [S', h, d]
    v = values.double().repeat_interleave(h // kvh, dim=1)[allowed]
    scores = torch.einsum("hd,shd->hs", q.double(), k) * scale
    return torch.einsum("hs,shd->hd", scores.softmax(-1), v)


def make_case(mode, bsz, seed, num_heads=4, num_kv_heads=2, head_dim=16, contiguous=False):
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(512, 1, num_kv_heads, head_dim, torch.float32, "cpu")
    alloc = TokenSlotAllocator(512)
    prefix_lens = [int(torch.randint(0, 40, (1,), generator=gen)) for _ in range(bsz)]
    if mode == ForwardMode.DECODE:
        prefix_lens = [p + 1 for p in prefix_lens]
        extend_lens = [1] * bsz
    else:
        extend_lens = [int(torch.randint(1, 12, (1,), generator=gen)) for _ in range(bsz)]
    slots, masks, positions = [], [], []
    for p, e in zip(prefix_lens, extend_lens):
        # non-contiguous slots: allocate, free some, allocate again
        s = alloc.alloc(p + e)
        slots.append(s if contiguous else s[torch.randperm(p + e, generator=gen)])
        pool.k[0][slots[-1][:p]] = torch.randn(p, num_kv_heads, head_dim, generator=gen)
        pool.v[0][slots[-1][:p]] = torch.randn(p, num_kv_heads, head_dim, generator=gen)
        if mode.uses_custom_mask:
            parents = random_parents(e, gen)
            m = ancestor_mask(parents)
            masks.append(m)
            positions.append(p + m.sum(1) - 1)  # prefix_len + depth
        else:
            positions.append(torch.arange(p, p + e))
    batch = ForwardBatch.build(
        mode, [[0] * e for e in extend_lens], slots, prefix_lens, positions,
        masks if mode.uses_custom_mask else None, logits="all",
    )
    t = batch.num_tokens
    q = torch.randn(t, num_heads, head_dim, generator=gen)
    k = torch.randn(t, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(t, num_kv_heads, head_dim, generator=gen)
    return pool, batch, q, k, v, masks


@pytest.mark.parametrize(
    "mode", [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY]
)
@pytest.mark.parametrize("bsz,seed", [(1, 0), (3, 1), (5, 2), (8, 3)])
def test_torch_native_matches_dense_reference(mode, bsz, seed):
    pool, batch, q, k, v, masks = make_case(mode, bsz, seed)
    scale = 16**-0.5
    backend = TorchNativeBackend(pool, 4, scale)
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, 0, batch)
    tok = 0
    for b, (p, e) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
        prefix_slots = batch.kv_indices[sum(batch.seq_lens[:b]) :][:p]
        keys = torch.cat([pool.k[0][prefix_slots], k[tok : tok + e]])
        vals = torch.cat([pool.v[0][prefix_slots], v[tok : tok + e]])
        for i in range(e):
            allowed = torch.zeros(p + e, dtype=torch.bool)
            allowed[:p] = True
            if mode.uses_custom_mask:
                allowed[p:] = masks[b][i]
            else:
                allowed[p : p + i + 1] = True
            ref = dense_attention(q[tok + i], keys, vals, allowed, scale)
            torch.testing.assert_close(out[tok + i].double(), ref, atol=1e-5, rtol=1e-5)
        tok += e


def test_tree_node_attention_equals_its_path_as_a_chain():
    """A tree node's output equals causal attention over prefix + its root-to-node path."""
    pool, batch, q, k, v, masks = make_case(ForwardMode.TARGET_VERIFY, 4, 7)
    backend = TorchNativeBackend(pool, 4, 0.25)
    backend.init_forward_metadata(batch)
    tree_out = backend.forward(q, k, v, 0, batch)
    tok = 0
    for b, (p, e) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
        prefix_slots = batch.kv_indices[sum(batch.seq_lens[:b]):][:p]
        for node in range(e):
            path = torch.nonzero(masks[b][node]).flatten()  # ancestors in topological order
            chain_pool = KVPool(64 + p, 1, 2, 16, torch.float32, "cpu")
            chain_slots = torch.arange(1, p + len(path) + 1)
            chain_pool.k[0][chain_slots[:p]] = pool.k[0][prefix_slots]
            chain_pool.v[0][chain_slots[:p]] = pool.v[0][prefix_slots]
            chain = ForwardBatch.build(
                ForwardMode.EXTEND, [[0] * len(path)], [chain_slots], [p], logits="all"
            )
            chain_backend = TorchNativeBackend(chain_pool, 4, 0.25)
            chain_backend.init_forward_metadata(chain)
            idx = tok + path
            chain_out = chain_backend.forward(q[idx], k[idx], v[idx], 0, chain)
            torch.testing.assert_close(tree_out[tok + node], chain_out[-1], atol=1e-5, rtol=1e-5)
        tok += e


def test_new_kv_lands_in_out_cache_loc():
    pool, batch, q, k, v, _ = make_case(ForwardMode.EXTEND, 3, 11)
    backend = TorchNativeBackend(pool, 4, 0.25)
    backend.init_forward_metadata(batch)
    backend.forward(q, k, v, 0, batch)
    torch.testing.assert_close(pool.k[0][batch.out_cache_loc], k)
    torch.testing.assert_close(pool.v[0][batch.out_cache_loc], v)


def test_slot_run():
    assert slot_run(torch.tensor([5, 6, 7, 8])) == (5, 4)
    assert slot_run(torch.tensor([9])) == (9, 1)
    assert slot_run(torch.tensor([], dtype=torch.int64)) is None
    assert slot_run(torch.tensor([5, 7, 6, 8])) is None  # same ends, not one run
    assert slot_run(torch.tensor([5, 6, 8])) is None
    assert slot_run(torch.tensor([8, 7, 6])) is None


@pytest.mark.parametrize(
    "mode", [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_run_of_slots_reads_a_view_equal_to_the_gather(mode, seed):
    """Batch 1 with its slots in one ascending run reads the pool as a view: same output, bit
    for bit, as the gathered path, and equal to the dense reference."""
    pool, batch, q, k, v, masks = make_case(mode, 1, seed, contiguous=True)
    backend = TorchNativeBackend(pool, 4, 0.25)
    backend.init_forward_metadata(batch)
    assert batch.attn_metadata.kv_run == (int(batch.kv_indices[0]), batch.kv_indices.numel())
    viewed = backend.forward(q, k, v, 0, batch)
    batch.attn_metadata.kv_run = None
    gathered = backend.forward(q, k, v, 0, batch)
    assert torch.equal(viewed, gathered)
    p, e = batch.prefix_lens[0], batch.extend_lens[0]
    keys, vals = pool.k[0][batch.kv_indices], pool.v[0][batch.kv_indices]
    for i in range(e):
        allowed = torch.zeros(p + e, dtype=torch.bool)
        allowed[:p] = True
        if mode.uses_custom_mask:
            allowed[p:] = masks[0][i]
        else:
            allowed[p : p + i + 1] = True
        ref = dense_attention(q[i], keys, vals, allowed, 0.25)
        torch.testing.assert_close(viewed[i].double(), ref, atol=1e-5, rtol=1e-5)
