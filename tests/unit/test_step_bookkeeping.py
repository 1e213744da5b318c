"""A step's index bookkeeping, built from Python lists (ForwardBatch.build, the CPU attention
plan, the scheduler's slices and slot bytes): the same tensors as the per-request torch ops it
replaced, for every batch shape; and benchmark/bench_step_bookkeeping runs."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.layers.attention.cpu import plan
from specserve.runtime.messages import pack_ints, unpack_ints
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.runtime.scheduler.req import Req
from specserve.speculative.tree import DraftTree


def reference_build(new_tokens, kv_slots, prefix_lens, logits):
    """What build assembled before, one torch op per request."""
    ext = [len(t) for t in new_tokens]
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, ext)])
    ends = torch.tensor(ext).cumsum(0)
    return {
        "input_ids": torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.int64),
        "positions": positions,
        "out_cache_loc": torch.cat([s[p:] for s, p in zip(kv_slots, prefix_lens)]),
        "kv_indices": torch.cat(kv_slots),
        "logits_indices": ends - 1 if logits == "last" else torch.arange(int(ends[-1])),
    }


def reference_plan(ext_l, pre_l):
    ext = torch.tensor(ext_l, dtype=torch.int32)
    pre = torch.tensor(pre_l, dtype=torch.int32)
    t = int(ext.sum())
    tok_req = torch.repeat_interleave(torch.arange(len(ext_l), dtype=torch.int32), ext)
    starts = torch.cumsum(ext, 0, dtype=torch.int32) - ext
    tok_local = torch.arange(t, dtype=torch.int32) - torch.repeat_interleave(starts, ext)
    kv_indptr = torch.zeros(len(ext_l) + 1, dtype=torch.int64)
    torch.cumsum(ext.to(torch.int64) + pre, 0, out=kv_indptr[1:])
    return tok_req, tok_local, kv_indptr


def random_batch(rng, batch, max_new):
    prefix = [rng.randrange(0, 40) for _ in range(batch)]
    ext = [rng.randrange(1, max_new + 1) for _ in range(batch)]
    pool = rng.sample(range(10_000), sum(prefix) + sum(ext))
    slots, off = [], 0
    for p, e in zip(prefix, ext):
        slots.append(torch.tensor(pool[off : off + p + e], dtype=torch.int64))
        off += p + e
    tokens = [[rng.randrange(3, 500) for _ in range(e)] for e in ext]
    return tokens, slots, prefix


@pytest.mark.parametrize("batch,max_new", [(1, 1), (1, 9), (5, 1), (7, 1), (6, 5), (32, 1)])
@pytest.mark.parametrize("logits", ["last", "all"])
def test_build_and_plan_give_the_per_request_ops_tensors(batch, max_new, logits):
    rng = random.Random(batch * 100 + max_new)
    for _ in range(5):
        tokens, slots, prefix = random_batch(rng, batch, max_new)
        mode = ForwardMode.DECODE if max_new == 1 else ForwardMode.EXTEND
        b = ForwardBatch.build(mode, tokens, slots, prefix, logits=logits)
        b.check()
        ref = reference_build(tokens, slots, prefix, logits)
        for name, want in ref.items():
            got = getattr(b, name)
            assert got.dtype == torch.int64, name
            assert torch.equal(got, want), name
        meta = plan(b)
        for got, want in zip((meta.tok_req, meta.tok_local, meta.kv_indptr),
                             reference_plan(b.extend_lens, b.prefix_lens)):
            assert got.dtype == want.dtype and torch.equal(got, want)
        assert torch.equal(meta.extend_len, torch.tensor(b.extend_lens, dtype=torch.int32))
        assert torch.equal(meta.prefix_len, torch.tensor(prefix, dtype=torch.int32))


def test_verify_plan_offsets_each_tree_mask():
    masks = [torch.tril(torch.ones(n, n, dtype=torch.bool)) for n in (1, 3, 2)]
    tokens = [[1] * m.shape[0] for m in masks]
    slots = [torch.arange(i * 100, i * 100 + 4 + m.shape[0]) for i, m in enumerate(masks)]
    b = ForwardBatch.build(ForwardMode.TARGET_VERIFY, tokens, slots, [4, 4, 4],
                           positions=torch.tensor([4, 4, 5, 6, 4, 5]), custom_masks=masks,
                           logits="all")
    meta = plan(b)
    assert meta.mask_indptr.tolist() == [0, 1, 10, 14]
    assert torch.equal(meta.masks, torch.cat([m.reshape(-1) for m in masks]).to(torch.uint8))
    assert b.positions.tolist() == [4, 4, 5, 6, 4, 5]


def test_list_built_trees_make_their_tensors_on_first_use():
    t = DraftTree.from_parents([5, 6, 7, 8], [-1, 0, 0, 2])
    ref = DraftTree(torch.tensor([5, 6, 7, 8]), torch.tensor([-1, 0, 0, 2]))
    assert torch.equal(t.tokens, ref.tokens) and torch.equal(t.parents, ref.parents)
    assert t.tokens.dtype == t.parents.dtype == torch.int64 and t.tokens is t.tokens
    assert t.token_list == [5, 6, 7, 8] and torch.equal(t.depth, ref.depth)
    r = DraftTree.root(9)
    assert r.tokens.tolist() == [9] and r.parents.tolist() == [-1] and r.num_nodes == 1
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        t.nonexistent  # noqa: B018


def test_fill_slice_is_the_slice_of_fill_ids():
    req = Req(rid="r", prompt_ids=[10, 11, 12, 13], params=SamplingParams())
    req.output_ids = [20, 21, 22]
    fill = req.fill_ids
    for start in range(len(fill) + 1):
        for end in range(start, len(fill) + 2):
            assert req.fill_slice(start, end) == fill[start:end], (start, end)


@pytest.mark.parametrize("t", [
    torch.arange(5, dtype=torch.int64),
    torch.arange(12, dtype=torch.int64)[3:9],
    torch.arange(12, dtype=torch.int64)[::2],
    torch.tensor([7, 1 << 30, -3], dtype=torch.int32),
    torch.tensor([7, 1 << 40, -3], dtype=torch.int64),
    torch.empty(0, dtype=torch.int64),
])
def test_pack_ints_is_little_endian_int64_for_any_tensor(t):
    b = pack_ints(t)
    assert b == np.asarray(t.tolist(), dtype="<i8").tobytes()
    assert unpack_ints(b).tolist() == t.to(torch.int64).tolist()


def test_bench_step_bookkeeping_reports_every_case(tmp_path):
    from benchmark.bench_step_bookkeeping import main

    assert main(["--batch-sizes", "1,4", "--context", "20", "--reps", "3", "--evict-mb", "1",
                 "--output", str(tmp_path / "b.json")]) == 0
    import json

    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [(r["batch"], r["mode"]) for r in rows] == [
        (1, "decode"), (1, "spec root"), (1, "verify 4"),
        (4, "decode"), (4, "spec root"), (4, "verify 4"),
        (1, "scheduler decode step"), (4, "scheduler decode step")]
    assert all(r["cold_us"] > 0 for r in rows)
