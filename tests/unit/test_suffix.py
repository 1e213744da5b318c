"""SUFFIX (suffix decoding): the shared suffix-matching core's removal and scored trees, the
drafter's per-request and global trees, their memory bounds under a long run, and greedy
output equal to plain decoding on the tiny model at batch 1 and 8."""

from __future__ import annotations

import random

import pytest

from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.speculative.base import RunnerReq, SpecConfig, create_drafter
from specserve.speculative.ngram_cache import NgramCache, NgramConfig
from specserve.speculative.worker import SpeculativeWorker
from tests.integration.test_spec_lossless import copy_heavy_prompts
from tests.unit.test_scheduler import Harness, reference, tiny  # noqa: F401


def all_ngrams(seqs, depth):
    return {tuple(s[i:j]) for s in seqs for i in range(len(s))
            for j in range(i + 1, min(i + depth, len(s)) + 1)}


def test_remove_uncounts_exactly_one_insert():
    rng = random.Random(0)
    cfg = NgramConfig(capacity=100_000, max_trie_depth=6)
    seqs = [[rng.randrange(12) for _ in range(rng.randrange(20, 120))] for _ in range(6)]
    both, kept = NgramCache(cfg), NgramCache(cfg)
    for s in seqs:
        both.insert(s)
    for s in seqs[3:]:
        kept.insert(s)
    for s in seqs[:3]:
        both.remove(s)
    both.check_integrity()
    assert both.num_nodes == kept.num_nodes
    for g in all_ngrams(seqs, 6):
        assert both.count(g) == kept.count(g), g
    for s in seqs[3:]:
        both.remove(s)
    both.check_integrity()
    assert both.num_nodes == 0


def test_remove_after_eviction_keeps_the_trie_consistent():
    rng = random.Random(1)
    cache = NgramCache(NgramConfig(capacity=300, max_trie_depth=5))
    seqs = [[rng.randrange(30) for _ in range(80)] for _ in range(20)]
    for i, s in enumerate(seqs):
        cache.insert(s)
        if i >= 3:
            cache.remove(seqs[i - 3])
        cache.check_integrity()
        assert cache.num_nodes <= 300


def scored(cache, ctx, n=16, factor=1.0, offset=0.0, p=0.1):
    return cache.draft_scored(ctx, n, spec_factor=factor, spec_offset=offset, min_prob=p)


def test_scored_tree_follows_frequencies_and_the_match_length():
    cache = NgramCache(NgramConfig(capacity=10_000, max_trie_depth=8))
    for _ in range(3):
        cache.insert([1, 2, 3, 4, 5, 6, 7])
    cache.insert([1, 2, 3, 9, 9])
    tokens, parents, probs, score, m = scored(cache, [0, 1, 2, 3], factor=2.0)
    assert m == 3  # [1, 2, 3] matched
    # 4 follows 3 times in 4 (p .75), 9 once (.25): best first, the chain of 4 (p .75 each)
    # then 9 (.25) and its own 9 (.25)
    assert tokens[:5] == [3, 4, 5, 6, 7] and parents[:5] == [-1, 0, 1, 2, 3]
    assert tokens[5:] == [9, 9] and parents[5:] == [0, 5]  # 6 drafts: 2 x the match
    assert score == pytest.approx(0.75 * 4 + 0.25 * 2) == pytest.approx(sum(probs[1:]))
    # the size follows the match: factor 1 x 3 tokens
    tokens, _, _, score, _ = scored(cache, [0, 1, 2, 3], factor=1.0)
    assert len(tokens) == 4 and score == pytest.approx(2.25)
    # min_prob prunes the rare branch
    tokens, _, _, _, _ = scored(cache, [0, 1, 2, 3], factor=4.0, p=0.3)
    assert 9 not in tokens
    # nothing matches: the root alone
    assert scored(cache, [42])[:4] == ([42], [-1], [1.0], 0.0)


@pytest.mark.parametrize("seed", range(6))
def test_the_positional_index_draws_the_tries_trees(seed):
    """A request's own history is indexed by position (one int per token), not counted into
    a trie; its scored trees must be the trie's over the same tokens, at every context."""
    import math

    from specserve.speculative.ngram_context import ContextIndex

    rng = random.Random(seed)
    depth, p = rng.choice([(5, 0.1), (8, 0.05), (12, 0.2)])
    vocab = rng.choice([3, 6, 20])
    motif = [rng.randrange(vocab) for _ in range(15)]
    seq = []
    while len(seq) < 400:  # repeats with edits, so long and short matches both occur
        seq += motif if rng.random() < 0.5 else [rng.randrange(vocab) for _ in range(7)]
    checked = 0
    # the trie counts, token by token, exactly the tokens indexed at each check
    trie = NgramCache(NgramConfig(capacity=1_000_000, max_trie_depth=depth,
                                  max_bfs_breadth=math.ceil(1 / p)))
    index = ContextIndex()
    for n in range(1, len(seq) + 1):
        trie.extend("r", seq[:n - 1], seq[n - 1:n])
        index.catch_up(seq[:n])
        if n % 7:
            continue
        for max_nodes, factor, offset in ((8, 1.0, 0.0), (16, 2.0, 1.0), (4, 0.5, 0.0)):
            a = trie.draft_scored(seq[:n], max_nodes, spec_factor=factor, spec_offset=offset,
                                  min_prob=p)
            b = index.draft_scored(seq[:n], max_nodes, spec_factor=factor, spec_offset=offset,
                                   min_prob=p, max_depth=depth, scan=10**9)
            assert b[3] == pytest.approx(a[3]) and b[4] == a[4], (n, a, b)
            assert sorted(b[2]) == pytest.approx(sorted(a[2]))
            assert len(b[0]) == len(a[0])
            checked += a[3] > 0
    assert checked > 20


def suffix(**kw):
    return create_drafter(SpecConfig("SUFFIX", 8, **kw), None)


def feed(d, rid, prompt, output):
    d.observe(rid, list(prompt), len(prompt))
    toks = list(prompt)
    for t in output:
        toks.append(t)
        d.observe(rid, list(toks), 1)
    return toks


def test_drafts_from_the_request_itself_and_from_earlier_outputs():
    d = suffix(suffix_max_draft_tokens=16)
    answer = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]
    feed(d, "a", [7, 8, 9], answer)
    d.release("a")
    ctx = [20, 21, 22] + answer[:4]
    d.observe("b", ctx, len(ctx))
    tokens, parents = d.draft_lists(RunnerReq.drafting("b", ctx, 16))
    assert d.last_source == "global" and tokens == [53, 54, 55, 56, 57]  # m = 4 -> 4 drafts
    own = [1, 2, 3, 4, 5, 6, 90, 1, 2, 3]
    d.observe("c", own, len(own))
    tokens, _ = d.draft_lists(RunnerReq.drafting("c", own, 16))
    assert d.last_source == "request" and tokens == [3, 4, 5, 6]
    # a request kept back drafts only a confident tree (expected accepted >= 2)
    assert d.draft_lists(RunnerReq.drafting("c", own, 16, confident_only=True))[0] == [3, 4, 5, 6]
    short = [1, 2, 3, 4, 5, 99, 5]
    d.observe("e", short, len(short))
    assert d.draft_lists(RunnerReq.drafting("e", short, 16, confident_only=True))[0] == [5]
    # the global tree counts outputs, not prompts
    assert d.global_tree.count([7, 8, 9]) == 0 and d.global_tree.count(answer[:3]) == 1


def test_memory_stays_within_its_bounds_over_a_long_run():
    rng = random.Random(2)
    d = suffix(suffix_max_cached_requests=20, suffix_cache_capacity=3000, suffix_max_tree_depth=8)
    template = [rng.randrange(100) for _ in range(30)]
    for i in range(300):
        out = [t if rng.random() < 0.7 else rng.randrange(100) for t in template]
        prompt = [rng.randrange(100) for _ in range(rng.randrange(5, 60))]
        toks = feed(d, f"r{i}", prompt, out)
        d.draft_lists(RunnerReq.drafting(f"r{i}", toks, 8))
        d.release(f"r{i}")
        mem = d.memory_nodes()
        assert mem["global"] <= 3000 and mem["cached_requests"] <= 20
        assert mem["live_requests"] == 0 and mem["requests"] == 0
    d.global_tree.check_integrity()
    # what is left counts exactly the last 20 outputs (nothing was evicted at this size)
    assert d.global_tree.num_nodes < 3000


@pytest.mark.parametrize("concurrency", [1, 8])
def test_tiny_model_suffix_greedy_equals_plain(tiny, concurrency):  # noqa: F811
    prompts = copy_heavy_prompts(50, seed=10 + concurrency)
    ref = reference(tiny, prompts, ignore_eos=True, max_new_tokens=20)
    h = Harness(tiny, num_draft_tokens=8, max_running_requests=concurrency)
    cfg = SpecConfig("SUFFIX", 8, suffix_max_draft_tokens=8)
    runner = tiny[1]
    h.worker = RunnerWorker(runner, SpeculativeWorker(cfg, create_drafter(cfg, runner), runner))
    h.sched.run_batch = h.worker.run
    for i, p in enumerate(prompts):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=20)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(50)] == ref
    assert h.sched.info()["spec_decode_num_accepted_tokens"] > 0
    h.sched.check_no_leak()


def test_the_cpu_engine_cost_curve_cuts_the_unlikely_tail():
    from specserve.runtime.verify_cost import VERIFY_COST

    d = create_drafter(SpecConfig("SUFFIX", 8), None)
    d.verify_cost = VERIFY_COST["cpu"]  # as the worker sets it (measured; here the table's)
    # CPU curve: C(2) 1.21, C(3) 1.40, C(4) 1.33, C(6) 2.16, C(8) 2.27
    assert d.worth_drafting([1.0, 0.9, 0.8, 0.7, 0.3, 0.2]) == 4  # 3.4 / 1.33 beats the rest
    assert d.worth_drafting([1.0, 0.1]) == 1  # 1.1 / 1.21 < 1: not worth a row
    assert d.worth_drafting([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]) == 8
    assert suffix().worth_drafting([1.0, 0.1]) == 2  # no runner: no curve, no cut
    # in a batch of 8 (C(8) 2.27, C(16) 4.26: ~0.25 a row, 11% of the batch's step) a row
    # must bring about 0.9 tokens: a sure chain stays, a likely one does not
    assert d.worth_drafting([1.0, 0.99, 0.98, 0.97], batch_size=8) == 4
    assert d.worth_drafting([1.0, 0.8, 0.7, 0.6], batch_size=8) == 1
    assert d.worth_drafting([1.0, 0.8, 0.7, 0.6], batch_size=1) == 4


def test_a_batch_where_no_draft_can_pay_skips_drafting_and_cuts_the_same_trees():
    """can_pay is exact: wherever it says no, worth_drafting cuts every tree of probabilities
    <= 1 to its root; and then nothing is drafted (neither tree is read)."""
    from specserve.runtime.verify_cost import VERIFY_COST, VerifyCost

    rng = random.Random(3)
    curves = [VERIFY_COST["cpu"], VerifyCost((1, 2, 8, 64), (1.0, 1.05, 1.5, 12.0)),
              VerifyCost((1, 4, 16), (1.0, 1.1, 4.5)),
              VerifyCost((1, 8, 32, 64), (1.0, 3.56, 8.85, 16.25))]
    d = create_drafter(SpecConfig("SUFFIX", 8), None)
    said_no = 0
    for curve in curves:
        d.verify_cost = curve
        for batch in (1, 2, 4, 8, 16, 32, 64):
            for budget in (2, 4, 8, 16):
                if d.can_pay(batch, budget):
                    continue
                said_no += 1
                for _ in range(50):
                    probs = sorted((rng.random() ** rng.choice([0.1, 1, 3])
                                    for _ in range(budget - 1)), reverse=True)
                    assert d.worth_drafting([1.0, *probs], batch) == 1
    assert said_no > 10
    # a step of 64 on a curve measured at start-up on an AMX machine (2026-11-28, rounded):
    # a tree of certain drafts is cut, so nothing is drafted
    d.verify_cost = VerifyCost((1, 2, 8, 16, 32, 48, 64),
                               (1.0, 2.29, 3.56, 5.86, 8.85, 11.84, 16.25))
    assert not d.can_pay(64, 8) and d.can_pay(1, 8) and d.can_pay(32, 8)
    toks = [5, 6, 7, 8, 9] * 6
    d.observe("a", toks, len(toks))
    # alone, a sure chain pays
    assert d.propose([RunnerReq.drafting("a", toks, 8)])[0].num_nodes > 1
    calls = []
    d.global_tree.draft_scored = lambda *a, **k: calls.append(a)
    trees = d.propose([RunnerReq.drafting("a", toks, 8)] + [RunnerReq.drafting(f"b{i}", toks[:5], 8)
                                                 for i in range(63)])
    assert trees[0].num_nodes == 1 and not calls


def test_the_request_and_global_trees_merge_best_first():
    from specserve.speculative.drafters.suffix import merge_best_first

    own = ([5, 6, 7, 8], [-1, 0, 1, 0], [1.0, 0.9, 0.8, 0.1])  # 6 -> 7, and 8
    glob = ([5, 6, 9, 4], [-1, 0, 1, 0], [1.0, 0.5, 0.45, 0.4])  # 6 -> 9, and 4
    tokens, parents, probs = merge_best_first([own, glob], 8)
    # 6 (.9: the higher of .9 and .5), 7 (.8), 9 (.45), 4 (.4), 8 (.1); parents first
    assert tokens == [5, 6, 7, 9, 4, 8] and parents == [-1, 0, 1, 1, 0, 0]
    assert probs == [1.0, 0.9, 0.8, 0.45, 0.4, 0.1]
    assert merge_best_first([own, glob], 3)[0] == [5, 6, 7]



def test_source_calibration_trusts_the_global_tree_only_as_far_as_it_is_accepted():
    from specserve.speculative.drafters.suffix import MIN_GLOBAL_TRUST, SourceCalibration

    cal = SourceCalibration()
    assert cal.global_trust() == 1.0
    for _ in range(200):  # both accepted as estimated: full trust
        cal.update({"request": 2.0, "global": 2.0}, {"request": 2.0, "global": 2.0})
    assert cal.global_trust() == pytest.approx(1.0)
    for _ in range(2000):  # the request tree's drafts land, the global tree's do not
        cal.update({"request": 2.0, "global": 2.0}, {"request": 1.5, "global": 0.1})
    assert cal.global_trust() < 0.1
    for _ in range(5000):
        cal.update({"request": 1.0, "global": 1.0}, {"request": 1.0, "global": 0.0})
    assert cal.global_trust() == MIN_GLOBAL_TRUST
    for _ in range(3000):  # it recovers when other requests' outputs predict again
        cal.update({"request": 1.0, "global": 1.0}, {"request": 0.7, "global": 0.7})
    assert cal.global_trust() == pytest.approx(1.0, abs=0.02)


def test_global_drafts_that_keep_missing_are_scaled_down_and_request_ones_are_not():
    d = suffix(suffix_max_draft_tokens=16)
    answer = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]
    feed(d, "a", [7, 8, 9], answer)
    d.release("a")
    for i in range(60):  # each new request goes elsewhere after answer[:4]
        ctx = [200 + i, 21, 22] + answer[:4]
        d.observe(f"b{i}", ctx, len(ctx))
        tokens, _ = d.draft_lists(RunnerReq.drafting(f"b{i}", ctx, 16))
        assert tokens[:2] == [53, 54] and d.last_source == "global"
        d.observe(f"b{i}", ctx + [99], 1)  # the target's token: no draft accepted
        d.release(f"b{i}")
    trust = d.calibration.global_trust()
    assert trust < 0.5
    ctx = [1, 2, 3] + answer[:4]
    d.observe("c", ctx, len(ctx))
    d.draft_lists(RunnerReq.drafting("c", ctx, 16))
    assert d.last_probs[1] == pytest.approx(trust)  # count 1 of 1, scaled by the record
    own = [1, 2, 3, 4, 5, 6, 90, 1, 2, 3]  # the request's own history: not scaled
    d.observe("e", own, len(own))
    assert d.draft_lists(RunnerReq.drafting("e", own, 16))[0] == [3, 4, 5, 6]
    assert d.last_source == "request" and d.last_probs[1:] == [1.0, 1.0, 1.0]
