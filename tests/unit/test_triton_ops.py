"""The Triton speculative ops (specserve/kernels/triton_ops.py) under Triton's interpreter on the
CPU equal their torch references (specserve/kernels/reference.py) exactly, on random trees and
batches."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: run kernels on the CPU

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from specserve.kernels import reference as ref  # noqa: E402
from specserve.kernels import triton_ops as tri  # noqa: E402


def random_batch(bsz: int, width: int, seed: int):
    """Parents [B, M] (random trees, tail padding), seq_lens, candidates, target argmax."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((bsz, width), -1, dtype=torch.int64)
    for b in range(bsz):
        n = int(torch.randint(1, width + 1, (1,), generator=gen))
        for i in range(1, n):
            parents[b, i] = int(torch.randint(0, i, (1,), generator=gen))
    seq_lens = torch.randint(1, 50, (bsz,), generator=gen)
    vocab = 4  # small: many accepts
    candidates = torch.randint(0, vocab, (bsz, width), generator=gen)
    return parents, seq_lens, candidates, vocab, gen


@pytest.mark.parametrize("bsz,width,seed", [(1, 1, 0), (1, 8, 1), (4, 6, 2), (6, 12, 3)])
def test_build_tree_masks_equals_reference(bsz, width, seed):
    parents, seq_lens, *_ = random_batch(bsz, width, seed)
    want = ref.build_tree_masks(parents, seq_lens)
    got = tri.build_tree_masks(parents, seq_lens)
    for name in want._fields:
        w, g = getattr(want, name), getattr(got, name)
        if name in ("positions", "depth"):  # padding rows: the reference's values
            valid = want.retrive_index >= 0
            assert torch.equal(g[valid], w[valid]), name
        elif name == "tree_mask":
            valid = want.retrive_index >= 0
            assert torch.equal(g[valid], w[valid]), name
        else:
            assert torch.equal(g, w), name


@pytest.mark.parametrize("bsz,width,seed", [(1, 8, 4), (5, 6, 5), (8, 10, 6), (3, 1, 7)])
def test_verify_tree_greedy_equals_reference(bsz, width, seed):
    parents, seq_lens, candidates, vocab, gen = random_batch(bsz, width, seed)
    t = ref.build_tree_masks(parents, seq_lens)
    total = int(t.num_nodes.sum())
    target = torch.randint(0, vocab, (total,), generator=gen)
    # the root's and most nodes' target choice is a child's token: accepted paths
    for b in range(bsz):
        for i in range(int(t.num_nodes[b])):
            kids = [j for j in range(width) if int(parents[b, j]) == i and j > 0]
            if kids and (i == 0 or float(torch.rand(1, generator=gen)) < 0.7):
                pick = kids[int(torch.randint(0, len(kids), (1,), generator=gen))]
                target[int(t.retrive_index[b, i])] = candidates[b, pick]
    want = ref.verify_tree_greedy(candidates, t.retrive_index, t.retrive_next_token,
                                  t.retrive_next_sibling, target)
    got = tri.verify_tree_greedy(candidates, t.retrive_index, t.retrive_next_token,
                                 t.retrive_next_sibling, target)
    for name in want._fields:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    # the walks went somewhere (fixed seeds: deterministic)
    assert int(t.num_nodes.max()) == 1 or int(want.accept_token_num.max()) >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_commit_kv_equals_reference_with_overlapping_slots(dtype):
    gen = torch.Generator().manual_seed(8)
    layers = [torch.randn(40, 2, 24, generator=gen).to(dtype) for _ in range(3)]
    src = torch.tensor([5, 9, 12, 13])
    dst = torch.tensor([9, 10, 11, 12])  # dst 9 and 12 are also sources: read before written
    want_k, want_v = [t.clone() for t in layers], [t.clone() * 2 for t in layers]
    got_k, got_v = [t.clone() for t in layers], [t.clone() * 2 for t in layers]
    ref.commit_kv(want_k, want_v, src, dst)
    tri.commit_kv(got_k, got_v, src, dst)
    for w, g in zip(want_k + want_v, got_k + got_v):
        assert torch.equal(g, w)
    assert torch.equal(want_k[0][10], layers[0][9])  # the reference really moved rows


def test_triton_ops_are_picked_on_cuda_and_only_asked_for_on_the_cpu():
    """On CUDA the Triton ops are registered for "cuda" (picked first); under the interpreter
    they are device-agnostic, after the references: the CPU still gets the torch op unless a
    caller asks for backend "triton"."""
    from specserve.kernels.registry import REGISTRY

    impls = {i.backend: i for i in REGISTRY._ops["verify_tree_greedy"]}
    want = None if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",)
    assert impls["triton"].device_types == want
    assert REGISTRY.get("verify_tree_greedy", "cpu") is ref.verify_tree_greedy
    assert REGISTRY.get("verify_tree_greedy", "cpu", backend="triton") is tri.verify_tree_greedy


@pytest.mark.parametrize("q_mode", ["one_hot", "iid", "without_replacement"])
@pytest.mark.parametrize("bsz,width,seed", [(1, 6, 10), (5, 8, 11), (4, 12, 12)])
def test_tree_speculative_sampling_equals_reference(q_mode, bsz, width, seed):
    parents, seq_lens, candidates, vocab, gen = random_batch(bsz, width, seed)
    vocab = 37  # more than one vocabulary block is not needed; an odd size is
    candidates = torch.randint(0, 6, (bsz, width), generator=gen)  # frequent tokens
    t = ref.build_tree_masks(parents, seq_lens)
    total = int(t.num_nodes.sum())
    logits = torch.randn(total, vocab, generator=gen) * 2
    logits[:, :6] += 4.0
    target = logits.softmax(-1)
    draft = (logits + torch.randn(total, vocab, generator=gen)).softmax(-1)
    accepted = 0
    for trial in range(4):
        u = torch.rand(bsz, width, generator=gen, dtype=torch.float64)
        args = (candidates, t.retrive_index, t.retrive_next_token, t.retrive_next_sibling, u,
                target, None if q_mode == "one_hot" else draft, q_mode)
        want = ref.tree_speculative_sampling(*args)
        got = tri.tree_speculative_sampling(*args)
        for name in want._fields:
            assert torch.equal(getattr(got, name), getattr(want, name)), (name, trial)
        accepted += int(want.accept_token_num.sum())
    # vocab 37 with 6 frequent tokens: accepted paths and rejected siblings both occur
    assert int(t.num_nodes.max()) == 1 or accepted > 0


@pytest.mark.parametrize("q_mode", ["one_hot", "without_replacement"])
def test_tree_sampling_lossy_thresholds_and_vocab_over_one_block_equal_reference(q_mode):
    """SGLang's accept thresholds below 1, and a vocabulary wider than one BLOCK_V (1024) so
    the residual, its sum and the final inverse-CDF walk span several blocks."""
    parents, seq_lens, *_ = random_batch(3, 8, 15)
    gen = torch.Generator().manual_seed(14)
    vocab = 1100
    candidates = torch.arange(8).repeat(3, 1) % 4  # siblings mostly differ; 4 likely tokens
    t = ref.build_tree_masks(parents, seq_lens)
    total = int(t.num_nodes.sum())
    logits = torch.randn(total, vocab, generator=gen)
    logits[:, :4] += 7.0
    logits[:, -2:] += 7.0  # mass in the last block: the bonus token can land there
    target = logits.softmax(-1)
    draft = (logits + torch.randn(total, vocab, generator=gen)).softmax(-1)
    accepted = {"lossless": 0, "lossy": 0}
    bonus_in_last_block = 0
    for trial in range(4):
        u = torch.rand(3, 8, generator=gen, dtype=torch.float64)
        for kind, thresholds in (("lossless", (1.0, 1.0)), ("lossy", (0.15, 0.3))):
            args = (candidates, t.retrive_index, t.retrive_next_token, t.retrive_next_sibling,
                    u, target, None if q_mode == "one_hot" else draft, q_mode, *thresholds)
            want = ref.tree_speculative_sampling(*args)
            got = tri.tree_speculative_sampling(*args)
            for name in want._fields:
                assert torch.equal(getattr(got, name), getattr(want, name)), (name, kind, trial)
            accepted[kind] += int(want.accept_token_num.sum())
            bonus_in_last_block += int((want.predicts >= 1024).sum())
    # the thresholds changed the walks, and the final sample crossed a block boundary
    assert accepted["lossy"] > accepted["lossless"], accepted
    assert bonus_in_last_block > 0
