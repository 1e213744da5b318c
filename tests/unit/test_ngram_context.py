"""specserve/speculative/ngram_context: own-context drafts for short matches, and the drafter using
them."""

from __future__ import annotations

import random

from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.speculative.base import RunnerReq, SpecConfig
from specserve.speculative.drafters.ngram import NgramDrafter
from specserve.speculative.ngram_context import (
    OWN_CONTEXT_MAX_MATCH,
    ContextIndex,
    own_context_tree,
)


def _index(tokens: list[int]) -> ContextIndex:
    idx = ContextIndex()
    idx.catch_up(tokens)
    return idx


def _brute_starts(tokens: list[int], m: int, want: int) -> list[int]:
    n, out, seen = len(tokens), [], set()
    for j in range(n - 2, m - 2, -1):
        if tokens[j - m + 1 : j + 1] == tokens[n - m :] and tokens[j + 1] not in seen:
            seen.add(tokens[j + 1])
            out.append(j + 1)
    return out[:want]


def test_continuations_are_distinct_most_recent_first_and_match_the_suffix():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [7, 1, 2, 9, 1, 3, 5, 1, 2, 4, 5, 1]
    idx = _index(tokens)
    # after "1": 2 (pos 8), 3 (pos 5), then 2 again (pos 2, a duplicate token)
    assert idx.continuations(tokens, 1, want=5) == [8, 5]
    assert idx.continuations(tokens, 1, want=1) == [8]
    # after "5 1": only pos 7 -> 8
    assert idx.continuations(tokens, 2, want=5) == [8]
    # a suffix that never occurred before
    tokens.append(42)
    idx.catch_up(tokens)
    assert idx.continuations(tokens, 1, want=5) == []


def test_continuations_equal_a_brute_force_search_on_random_histories():
    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(2, 60))]
        idx = ContextIndex()
        # index in pieces, as a request grows
        cut = rng.randrange(len(tokens) + 1)
        idx.catch_up(tokens[:cut])
        idx.catch_up(tokens)
        for m in (1, 2, 3):
            for want in (1, 3, 8):
                assert idx.continuations(tokens, m, want, scan=10**9) == _brute_starts(
                    tokens, m, want)


def test_scan_limit_bounds_the_work_and_a_shorter_history_is_reindexed():
    tokens = [5, 0] * 200 + [5]
    idx = _index(tokens)
    assert idx.continuations(tokens, 1, want=3, scan=1) == [len(tokens) - 2]
    short = [1, 2, 1]
    idx.catch_up(short)  # not a continuation of the indexed history: start over
    assert len(idx) == 3 and idx.continuations(short, 1, want=3) == [1]


def test_own_context_tree_puts_siblings_first_then_chains_then_the_fill():
    #         0  1  2  3  4  5  6  7  8
    tokens = [1, 2, 3, 4, 1, 6, 7, 8, 1]
    starts = [5, 1]  # after "1": 6 (most recent) then 2
    t, p = own_context_tree(tokens, starts, budget=6)
    assert t[0] == 1 and p[0] == -1
    assert t[1:3] == [6, 2] and p[1:3] == [0, 0]  # siblings
    # the first start's chain 7, 8, 1 fills the budget
    assert t[3:] == [7, 8, 1] and p[3:] == [1, 3, 4]
    # the chain stops at the end of the context; a fill tree merges where it agrees (6, 6 7)
    # and adds where it does not (9), within the budget (5 is left out)
    short = [1, 2, 1, 6, 7, 1]
    t2, p2 = own_context_tree(short, [3], budget=5, fill_tokens=[1, 6, 9, 7, 5],
                              fill_parents=[-1, 0, 0, 1, 0])
    assert t2 == [1, 6, 7, 1, 9] and p2 == [-1, 0, 1, 2, 0]
    assert all(q < i for i, q in enumerate(p2) if i)
    assert len(own_context_tree(tokens, starts, budget=2)[0]) == 2


def _drafter(own: bool) -> NgramDrafter:
    return NgramDrafter(SpecConfig("NGRAM", num_draft_tokens=8, ngram_disable_own_context=not own),
                        runner=None)


GREEDY = SamplingParams(temperature=0.0)


def _teach(d: NgramDrafter, rid: str, tokens: list[int]) -> None:
    """A request that came, drafted and finished: its n-grams are in the trie."""
    d.observe(rid, tokens, len(tokens))
    d.propose([RunnerReq.drafting(rid, tokens, 8, GREEDY)])
    d.release(rid)


def _ngram_counts(cache) -> dict[tuple[int, ...], int]:
    """Every n-gram the trie holds, with its count."""
    return dict(cache.dump())


def test_the_trie_counts_a_request_before_it_drafts_and_all_of_it_when_it_ends():
    """Counting is lazy: nothing while a request only decodes; before a draft, its whole
    history so far (the same counts as one insert of it); at release, the rest. A request
    that never drafted leaves no n-grams."""
    from specserve.speculative.ngram_cache import NgramCache

    rng = random.Random(5)
    history = [rng.randrange(50) for _ in range(40)]
    d = _drafter(True)
    d.observe("r", history[:30], 30)
    for n in range(31, 36):
        d.observe("r", history[:n], 1)
    assert d.cache.num_nodes == 0  # decoding only: nothing counted yet
    d.propose([RunnerReq.drafting("r", history[:35], 8, GREEDY)])
    whole = NgramCache(d.cache.cfg)
    whole.insert(history[:35])
    assert _ngram_counts(d.cache) == _ngram_counts(whole)
    # no budget: no counting either way
    d.propose([RunnerReq.drafting("r", history[:35], 1, GREEDY)])
    for n in range(36, 41):
        d.observe("r", history[:n], 1)
    d.release("r")
    whole = NgramCache(d.cache.cfg)
    whole.insert(history)
    assert _ngram_counts(d.cache) == _ngram_counts(whole)
    # one that only decoded (a busy batch's plan gave it no draft slots) leaves nothing
    before = _ngram_counts(d.cache)
    other = [rng.randrange(50, 90) for _ in range(20)]
    d.observe("q", other, 20)
    d.propose([RunnerReq.drafting("q", other, 1, GREEDY)])
    d.release("q")
    assert _ngram_counts(d.cache) == before
    assert not d.reqs


def test_a_short_match_drafts_the_requests_own_continuation_first():
    rng = random.Random(1)
    passage = [rng.randrange(100, 5000) for _ in range(60)]
    results = {}
    for own in (True, False):
        d = _drafter(own)
        # another request taught the trie that token 77 is followed by 88 (most recently)
        _teach(d, "old", [3, 77, 88, 4, 5])
        # this request's prompt: ... 77 then the passage; its output rewrote one word and
        # ends in 77, so the longest match is the single token 77
        prompt = [1, 77, *passage, 2]
        d.observe("r", prompt, len(prompt))
        d.propose([RunnerReq.drafting("r", prompt, 16, GREEDY)])  # it drafted on its prompt
        _teach(d, "old2", [6, 77, 88, 9])  # the other continuation is the most recent
        history = [*prompt, 11, 77]
        d.observe("r", history, 2)
        tree = d.propose([RunnerReq.drafting("r", history, 16, GREEDY)])[0]
        assert d.cache.last_match_len <= OWN_CONTEXT_MAX_MATCH
        results[own] = tree
    own_tree, trie_tree = results[True], results[False]
    assert own_tree.num_nodes == trie_tree.num_nodes  # same verify cost
    own_first_child = int(own_tree.tokens[1])
    assert own_first_child == passage[0]  # the request's own continuation of 77 leads
    # ... and continues as a chain along the passage
    depth = own_tree.depth.tolist()
    assert max(depth) >= 2
    assert int(trie_tree.tokens[1]) == 88  # the trie alone leads with the most recent one


def test_release_and_reset_drop_request_contexts_and_the_count_is_bounded():
    d = _drafter(True)
    d._max_reqs = 3
    for i in range(5):
        toks = [1, 2, 1, 2, 1]
        d.observe(f"r{i}", toks, len(toks))
        d.propose([RunnerReq.drafting(f"r{i}", toks, 8, SamplingParams(temperature=0.0))])
    assert len(d.reqs) == 3 and "r0" not in d.reqs
    assert all(q.context is not None for q in d.reqs.values())
    d.release("r4")
    assert "r4" not in d.reqs
    d.reset()
    assert not d.reqs
