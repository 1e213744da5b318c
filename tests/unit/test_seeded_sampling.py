"""Counter-based seeded sampling and per-tree-node penalties, as pure functions."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specserve.runtime.sampling import (
    RowHistory,
    SamplingBatchInfo,
    SamplingParams,
    apply_penalties,
)
from specserve.runtime.sampling.sampler import process_logits
from specserve.runtime.sampling.seeded import (
    _mix,
    gumbel,
    gumbel_noise,
    row_keys,
    seed_to_int64,
    seeded_sample,
)
from specserve.speculative.tree import DraftTree
from specserve.speculative.verify import verify_greedy, verify_seeded

MASK = (1 << 64) - 1


def splitmix64_reference(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_int64_mix_is_splitmix64_bit_for_bit():
    # the published first output of splitmix64 seeded with 0
    assert splitmix64_reference(0) == 0xE220A8397B1DCDAF
    rng = random.Random(0)
    xs = [rng.randrange(1 << 64) for _ in range(5000)] + [0, 1, (1 << 63) - 1, 1 << 63, MASK]
    got = _mix(torch.tensor([seed_to_int64(x) for x in xs])).tolist()
    assert [g & MASK for g in got] == [splitmix64_reference(x) for x in xs]


def test_noise_is_the_same_whatever_the_batch_shape():
    seeds = torch.tensor([seed_to_int64(s) for s in (0, 7, 2**64 - 1)])
    positions = torch.tensor([5, 5, 123456])
    toks = torch.arange(300)
    batch = gumbel(row_keys(seeds, positions)[:, None], toks[None, :])  # [3, 300]
    for i, (s, p) in enumerate(zip((0, 7, 2**64 - 1), positions.tolist())):
        assert torch.equal(batch[i], gumbel_noise(s, p, toks))
        assert torch.equal(batch[i, 17:40], gumbel_noise(s, p, toks[17:40]))
    assert not torch.equal(batch[0], batch[1])


def test_noise_is_standard_gumbel():
    g = gumbel(row_keys(torch.tensor([3]), torch.arange(200)[:, None]).flatten()[:, None],
               torch.arange(1000)[None, :]).flatten()  # 200k values
    euler_gamma = 0.5772156649
    assert abs(float(g.mean()) - euler_gamma) < 0.01
    assert abs(float(g.var()) - math.pi**2 / 6) < 0.03
    # P(G <= 0) = exp(-1)
    assert abs(float((g <= 0).double().mean()) - math.exp(-1)) < 0.005


@pytest.mark.parametrize("cut", [0.2, 0.0001, 0.0])  # sparse support, dense, full
def test_seeded_sample_is_the_argmax_of_the_perturbed_scores_over_the_support(cut):
    gen = torch.Generator().manual_seed(0)
    probs = torch.rand(6, 500, generator=gen) ** 4
    probs[probs < cut] = 0.0  # 0.2: a filtered distribution, most tokens have no mass
    seeds = [seed_to_int64(s) for s in (1, 2, 3, 1, 1, 2**63 + 5)]
    positions = [10, 10, 10, 11, 12, 10]
    got = seeded_sample(probs, seeds, positions)
    for i in range(6):
        g = gumbel(row_keys(torch.tensor([seeds[i]]), torch.tensor([positions[i]])),
                   torch.arange(500))
        score = torch.where(probs[i] > 0, probs[i].double().log() + g, -torch.inf)
        assert int(got[i]) == int(score.argmax())
        assert probs[i, got[i]] > 0
    # unnormalised rows give the same draw as normalised ones
    assert torch.equal(got, seeded_sample(probs / probs.sum(-1, keepdim=True), seeds, positions))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.1, top_k=50, min_p=0.05),
])
def test_process_logits_rows_are_bit_identical_at_any_batch_size(params):
    # a seeded verify row must equal the decode row; a 49k-vocabulary row summed alone is split
    # across threads by torch's reductions, so the renormalisation must not use one
    vocab = 49152
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(1)) * 3
    full = process_logits(logits, SamplingBatchInfo.from_params([params] * 9, vocab))
    for b in (1, 2, 3, 8):
        part = process_logits(logits[:b], SamplingBatchInfo.from_params([params] * b, vocab))
        assert torch.equal(part, full[:b]), f"batch {b} differs from batch 9"


def random_tree(rng: random.Random, n: int, vocab: int) -> DraftTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return DraftTree.from_parents([rng.randrange(vocab) for _ in range(n)], parents)


def test_tree_penalties_equal_plain_penalties_on_each_nodes_own_history():
    rng = random.Random(0)
    vocab = 40
    params = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.3),
              SamplingParams(frequency_penalty=1.1),
              SamplingParams(repetition_penalty=0.8)]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 20))] for _ in params]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 20))] for _ in params]
    trees = [random_tree(rng, n, vocab) for n in (7, 1, 5)]
    for t, out in zip(trees, outputs):
        t.tokens[0] = out[-1]  # the root is the last output token
    sizes = [t.num_nodes for t in trees]
    logits = torch.randn(sum(sizes), vocab, generator=torch.Generator().manual_seed(2)) * 2
    # the worker's description: request history + each node's ancestors-or-self below the root
    request, extra_rows, extra_tokens, off = [], [], [], 0
    for j, t in enumerate(trees):
        request += [j] * t.num_nodes
        node, token = t.path_tokens()
        extra_rows.append(off + node)
        extra_tokens.append(token)
        off += t.num_nodes
    hist = RowHistory(torch.tensor(request), torch.cat(extra_rows), torch.cat(extra_tokens))
    rows = [params[j] for j in request]
    info = SamplingBatchInfo.from_params(rows, vocab)
    got = apply_penalties(logits, info, prompts, outputs, hist)
    # reference: every node alone, with its full history spelled out
    off = 0
    for j, t in enumerate(trees):
        for u in range(t.num_nodes):
            path = [int(t.tokens[a]) for a in range(1, t.num_nodes) if t.ancestor_mask[u, a]]
            one = SamplingBatchInfo.from_params([params[j]], vocab)
            want = apply_penalties(logits[off + u : off + u + 1], one, [prompts[j]],
                                   [outputs[j] + path])
            assert torch.equal(got[off + u], want[0]), f"request {j} node {u}"
        off += t.num_nodes


def test_verify_seeded_accepts_exactly_the_children_equal_to_the_draws():
    #   root(0) ── 1:10 ── 3:20
    #          └── 2:11 ── 4:21
    tree = DraftTree.from_parents([99, 10, 11, 20, 21], [-1, 0, 0, 1, 2])
    draws = torch.tensor([11, 5, 21, 0, 8])
    res = verify_seeded(tree, draws)
    assert res.accepted_nodes == [0, 2, 4] and res.output_tokens == [11, 21, 8]
    assert res == verify_greedy(tree, draws)  # the same walk, draws in place of the argmax
    assert verify_seeded(tree, torch.tensor([12, 0, 0, 0, 0])).output_tokens == [12]
