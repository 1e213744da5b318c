"""The n-gram trie (`specserve.speculative.ngram_cache.NgramCache`, C++): counting, recency orders,
BFS and PROB trees, tree sizing, LRU eviction within capacity, corpus loading. Its drafts against a
Python reference on random operations: test_ngram_reference.py."""

from __future__ import annotations

import gc
import json
import random
from collections import Counter

import pytest

from specserve.speculative.ngram_cache import (
    NgramCache,
    NgramConfig,
    bfs_breadths,
    tree_size_for_match,
)


def _cache(**kw) -> NgramCache:
    """A cache whose trees fill their budget (the builders' own behaviour); the tests of
    sizing by match length pass size_by_match=True."""
    return NgramCache(NgramConfig(**{"size_by_match": False, **kw}))


def _dump(cache) -> list[tuple[tuple[int, ...], int]]:
    """Every stored n-gram with its count, children in the trie's recency order."""
    return cache.dump()


def _brute_counts(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    c: Counter[tuple[int, ...]] = Counter()
    for s in seqs:
        for i in range(len(s)):
            for k in range(1, min(depth, len(s) - i) + 1):
                c[tuple(s[i : i + k])] += 1
    return dict(c)


def _children(parents: list[int], i: int) -> list[int]:
    return [j for j, p in enumerate(parents) if p == i]


def _paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    out = set()
    for i in range(len(tokens)):
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
@pytest.mark.parametrize("budget", [2, 5, 8, 16])
def test_repeated_passage_drafts_its_exact_continuation_as_a_chain(
    match_type: str, budget: int
) -> None:
    rng = random.Random(0)
    passage = list(range(1000, 1060))
    noise = [rng.randrange(200) for _ in range(300)]
    cache = _cache(match_type=match_type)
    ctx = noise[:150] + passage + noise[150:] + passage[:20]
    cache.insert(ctx)
    tree = cache.draft(ctx, budget)
    assert tree.tokens.tolist() == passage[19 : 19 + budget]
    assert tree.parents.tolist() == list(range(-1, budget - 1))
    assert cache.draft(ctx).num_nodes == cache.cfg.num_draft_tokens


@pytest.mark.parametrize("seed", range(5))
def test_insert_counts_every_ngram_up_to_max_depth(seed: int) -> None:
    rng = random.Random(seed)
    seqs = [[rng.randrange(6) for _ in range(rng.randint(1, 60))] for _ in range(4)]
    cache = _cache(max_trie_depth=5)
    for s in seqs:
        cache.insert(s)
    assert dict(_dump(cache)) == _brute_counts(seqs, 5)
    assert cache.num_nodes == len(_brute_counts(seqs, 5))
    for gram, n in list(_brute_counts(seqs, 5).items())[:20]:
        assert cache.count(gram) == n
    assert cache.count([99, 98]) == 0
    cache.check_integrity()


def test_bfs_takes_the_most_recent_children_within_decaying_breadth() -> None:
    depth, max_b, min_b = 6, 5, 1
    cache = _cache(max_trie_depth=depth, max_bfs_breadth=max_b, min_bfs_breadth=min_b)
    # breadth index m + level - 2 spans exactly max_b .. min_b and never grows
    breadth = bfs_breadths(cache.cfg)
    assert breadth[0] == max_b and breadth[depth - 2] == min_b
    assert all(a >= b for a, b in zip(breadth, breadth[1:]))
    # after token 7: 30 continuations c, each followed by 6 continuations d, then e
    for c in range(100, 130):
        for d in range(200, 206):
            cache.insert([7, c, d, 300 + d])
    tokens, parents = cache.draft_lists([7], 200)
    assert parents[0] == -1 and all(0 <= p < i for i, p in enumerate(parents) if i)
    assert len(tokens) <= 200
    level1 = _children(parents, 0)
    # only a 1-token match exists (m = 1): level l takes breadth[l - 1] children
    assert len(level1) == breadth[0] == max_b
    assert [tokens[i] for i in level1] == [129, 128, 127, 126, 125]  # most recent first
    for i in level1:
        level2 = _children(parents, i)
        assert len(level2) == breadth[1]
        assert [tokens[j] for j in level2] == [205, 204, 203, 202][: len(level2)]
        for j in level2:
            assert len(_children(parents, j)) == 1  # one stored continuation
    # the node budget cuts the tree in BFS order
    tokens8, parents8 = cache.draft_lists([7], 8)
    assert len(tokens8) == 8 and tokens8[:6] == [7, 129, 128, 127, 126, 125]
    assert parents8[6:] == [1, 1]


def test_longer_matches_get_narrower_trees_and_shorter_ones_merge_in() -> None:
    cache = _cache(max_trie_depth=10, max_bfs_breadth=9, min_bfs_breadth=1)
    breadth = bfs_breadths(cache.cfg)
    assert breadth[:5] == [9, 8, 7, 6, 5]
    for c in range(100, 120):
        cache.insert([1, 2, 3, 4, 5, c])
    # the 5-token match alone (budget) takes breadth[4] = 5 most recent continuations
    assert cache.draft_lists([1, 2, 3, 4, 5], 6) == ([5, 119, 118, 117, 116, 115], [-1] + [0] * 5)
    # each shorter match (m = 4..1) is one step wider and merges into the same root
    tokens, parents = cache.draft_lists([1, 2, 3, 4, 5], 50)
    assert tokens == [5] + list(range(119, 110, -1)) and parents == [-1] + [0] * 9
    # a 1-token match alone fans out to max_bfs_breadth
    tokens, parents = cache.draft_lists([5], 50)
    assert len(_children(parents, 0)) == 9


def test_prob_prefers_the_more_frequent_continuation_bfs_the_most_recent() -> None:
    bfs, prob = _cache(match_type="BFS"), _cache(match_type="PROB")
    for cache in (bfs, prob):
        for _ in range(3):
            cache.insert([1, 2, 3])
        cache.insert([1, 2, 4])  # rarer but more recent
    assert bfs.draft_lists([1, 2], 2) == ([2, 4], [-1, 0])
    assert prob.draft_lists([1, 2], 2) == ([2, 3], [-1, 0])
    assert prob.draft_lists([1, 2], 3) == ([2, 3, 4], [-1, 0, 0])
    prob.check_integrity()


def test_prob_ranks_paths_by_the_product_of_conditional_frequencies() -> None:
    cache = _cache(match_type="PROB")
    for _ in range(6):
        cache.insert([9, 1, 5])  # P(1) = .6, P(5 | 1) = 1 -> path .6
    for _ in range(4):
        cache.insert([9, 2, 6])  # P(2) = .4
    assert cache.draft_lists([9], 3) == ([9, 1, 5], [-1, 0, 1])
    assert cache.draft_lists([9], 4) == ([9, 1, 5, 2], [-1, 0, 1, 0])
    # counts keep changing after the top-k lists exist: they stay exact
    for _ in range(5):
        cache.extend("r", [7, 9], [2, 6, 9])
    assert cache.draft_lists([9], 3) == ([9, 2, 6], [-1, 0, 1])
    cache.check_integrity()


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_unseen_suffix_or_short_match_gives_the_root_only_tree(match_type: str) -> None:
    empty = _cache(match_type=match_type)
    assert empty.draft_lists([5, 6, 7]) == ([7], [-1])
    cache = _cache(match_type=match_type, min_match_window=2)
    cache.insert([1, 2, 3, 4])
    assert cache.draft_lists([8, 9]) == ([9], [-1])
    assert cache.draft_lists([9, 3]) == ([3], [-1])  # (3) -> 4 is a 1-token match only
    assert cache.draft_lists([2, 3]) == ([3, 4], [-1, 0])
    assert cache.draft([2, 3], 1).num_nodes == 1
    tree = cache.draft([8, 4])  # 4 is a stored leaf: nothing follows it
    assert tree.tokens.tolist() == [4] and tree.parents.tolist() == [-1]


def test_draft_reads_only_the_last_depth_minus_one_tokens() -> None:
    rng = random.Random(1)
    depth = 8
    cache = _cache(max_trie_depth=depth)
    seq = [rng.randrange(5) for _ in range(400)]
    cache.insert(seq)
    tail = seq[-(depth - 1) :]
    other = [rng.randrange(5) for _ in range(300)]
    for prefix in ([], seq[:-(depth - 1)], other):
        assert cache.draft_lists(prefix + tail, 12) == cache.draft_lists(tail, 12)


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
@pytest.mark.parametrize("seed", range(3))
def test_extend_on_a_growing_context_equals_inserting_it_whole(match_type: str, seed: int) -> None:
    rng = random.Random(seed)
    depth = 6
    seq = [rng.randrange(8) for _ in range(40)]
    inc = _cache(max_trie_depth=depth, match_type=match_type)
    inc.insert(seq)
    for step in range(25):
        new = [rng.randrange(8) for _ in range(rng.randint(1, 8))]
        inc.extend("req", seq, new)
        seq = seq + new
        whole = _cache(max_trie_depth=depth, match_type=match_type)
        whole.insert(seq)
        # same n-grams, same counts, same sibling (recency) order
        assert _dump(inc) == _dump(whole)
        for budget in (4, 8, 20):
            want = whole.draft_lists(seq, budget)
            assert inc.draft_lists(seq, budget) == want
            assert inc.draft_lists(seq, budget, key="req") == want
        if step % 5 == 0:
            inc.check_integrity()


def test_interleaved_requests_count_the_same_ngrams_as_separate_inserts() -> None:
    rng = random.Random(3)
    depth = 5
    a, b = [rng.randrange(4) for _ in range(10)], [rng.randrange(4) for _ in range(7)]
    cache = _cache(max_trie_depth=depth)
    cache.insert(a)
    cache.insert(b)
    for _ in range(30):
        for key, seq in (("a", a), ("b", b)):
            new = [rng.randrange(4) for _ in range(rng.randint(1, 5))]
            cache.extend(key, seq, new)
            seq.extend(new)
    cache.extend("a", [9, 9, 9], [1, 2])  # a stale state for "a": looked up again
    ref = Counter(_brute_counts([a, b], depth))
    # the (9, 9, 9) tail was never inserted: its n-grams appear with count 1 (they occurred)
    ref.update(
        {g: n for g, n in _brute_counts([[9, 9, 9, 1, 2]], depth).items() if g[-1] in (1, 2)}
    )
    for g in [(9,), (9, 9), (9, 9, 9)]:
        ref[g] += 1
    assert dict(_dump(cache)) == dict(ref)
    cache.check_integrity()


def test_capacity_bound_holds_under_a_long_random_stream() -> None:
    rng = random.Random(4)
    cap, depth = 300, 6
    cache = _cache(capacity=cap, max_trie_depth=depth, max_tracked_requests=3)
    ctxs: dict[int, list[int]] = {k: [rng.randrange(50)] for k in range(5)}
    for step in range(600):
        key = rng.randrange(5)
        new = [rng.randrange(50) for _ in range(rng.randint(1, 8))]
        cache.extend(key, ctxs[key], new)
        ctxs[key] += new
        assert cache.num_nodes <= cap
        cache.draft(ctxs[key], 8, key=key)
        if step % 100 == 0:
            cache.check_integrity()
    assert cache.num_nodes >= cap - depth  # it filled up and stayed near full
    cache.check_integrity()


def test_eviction_removes_least_recently_used_leaves_first() -> None:
    depth = 4
    cache = _cache(capacity=depth * depth, max_trie_depth=depth)
    a, b, c = [1, 2, 3], [4, 5, 6], [7, 8]
    cache.insert(a)
    cache.insert(b)
    cache.insert(a)  # a is used again: b is now the least recently used path
    cache.insert(c)
    cache.insert([9])
    assert cache.num_nodes == 16
    before = {g for g, _ in _dump(cache)}
    evicted = []
    for t in range(20, 26):  # each insert adds one node, so evicts exactly one
        cache.insert([t])
        now = {g for g, _ in _dump(cache)}
        gone = before - now
        assert len(gone) == 1 and cache.num_nodes == 16
        evicted += gone
        before = now
        cache.check_integrity()
    # leaves first, oldest first: b's nodes only, deepest before the prefix they hang on
    assert evicted == [(6,), (5, 6), (5,), (4, 5, 6), (4, 5), (4,)]
    assert all(cache.count(g) == 2 for g in [(1,), (1, 2), (1, 2, 3), (2, 3), (3,)])
    assert cache.draft_lists([1, 2], 4) == ([2, 3], [-1, 0])


def test_recently_used_paths_survive_a_stream_that_overflows_capacity() -> None:
    rng = random.Random(5)
    cap, depth = 2000, 8  # drafts reach at most depth - 1 tokens past the root
    cache = _cache(capacity=cap, max_trie_depth=depth)
    passage = list(range(500, 520))
    first_noise = [rng.randrange(400) for _ in range(30)]
    noise = first_noise[:]
    cache.insert(noise)
    cache.insert(passage)
    for round_ in range(40):
        new = [rng.randrange(400) for _ in range(50)]
        cache.extend("noise", noise, new)
        noise += new
        if round_ % 2 == 0:
            cache.extend("copy", [0], passage)  # the passage is quoted again and again
        assert cache.num_nodes <= cap
    assert cache.draft_lists(passage[:5], 8) == (passage[4:12], list(range(-1, 7)))
    assert cache.count(passage[:depth]) > 1
    old = [g for g in (tuple(first_noise[i : i + 3]) for i in range(20))]
    assert sum(cache.count(g) for g in old) == 0  # early noise was evicted
    cache.check_integrity()


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_evicted_anchors_are_rebuilt_and_counting_continues(match_type: str) -> None:
    depth = 5
    cache = _cache(capacity=depth * depth, max_trie_depth=depth, match_type=match_type)
    ctx = [1, 2, 3, 4]
    cache.insert(ctx)
    cache.extend("r", ctx, [5])
    for t in range(100, 140):  # floods the trie: the request's anchors are evicted
        cache.insert([t, t + 1000])
    assert cache.count([4, 5]) == 0
    cache.extend("r", ctx + [5], [6])
    for gram in ([6], [5, 6], [4, 5, 6], [3, 4, 5, 6], [2, 3, 4, 5, 6]):
        assert cache.count(gram) == 1
    assert cache.draft_lists([3, 4, 5], 4, key="r")[0][:2] == [5, 6]
    cache.check_integrity()


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
@pytest.mark.parametrize("seed", range(4))
def test_integrity_holds_after_random_operations(match_type: str, seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.randint(2, 7)
    cache = _cache(
        capacity=depth * depth + rng.randrange(200),
        max_trie_depth=depth,
        match_type=match_type,
        max_bfs_breadth=rng.randint(1, 4),
        max_tracked_requests=4,
    )
    vocab = rng.randint(2, 12)
    ctxs: dict[int, list[int]] = {}
    for _ in range(300):
        op = rng.random()
        if op < 0.2:
            cache.insert([rng.randrange(vocab) for _ in range(rng.randint(0, 30))])
        elif op < 0.7:
            key = rng.randrange(6)
            ctx = ctxs.setdefault(key, [rng.randrange(vocab)])
            new = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
            cache.extend(key, ctx, new)
            ctx += new
        elif op < 0.75:
            cache.release(rng.randrange(6))
        else:
            key = rng.randrange(6)
            ctx = ctxs.get(key) or [rng.randrange(vocab)]
            budget = rng.randint(1, 12)
            tokens, parents = cache.draft_lists(ctx, budget, key=key if op < 0.9 else None)
            assert 1 <= len(tokens) <= budget and tokens[0] == ctx[-1]
            assert all(0 <= p < i for i, p in enumerate(parents) if i)
            # every drafted path continues some suffix of the context in the trie
            for path in _paths(tokens, parents):
                if path:
                    assert any(
                        cache.count(ctx[len(ctx) - m :] + list(path)) > 0
                        for m in range(1, min(depth - len(path), len(ctx)) + 1)
                    )
        assert cache.num_nodes <= cache.cfg.capacity
    cache.check_integrity()


def test_integrity_check_and_bad_input_report_through_python_errors() -> None:
    cache = _cache(capacity=64, max_trie_depth=4)
    cache.insert([1, 2, 3, 1, 2, 4])
    cache.check_integrity()  # a C++ logic_error would come out as an AssertionError
    assert cache.count([1, 2]) == 2 and cache.count([2, 3, 1, 2]) == 1 and cache.count([9]) == 0
    with pytest.raises(ValueError, match="context token"):
        cache.draft_lists([], 4)
    with pytest.raises(ValueError, match="counts the root"):
        cache.draft_lists([1], 0)


def test_memory_is_reserved_up_front_and_never_grows() -> None:
    """The whole trie's storage is allocated at construction (its RSS is its ceiling from the
    start): filling it past capacity, evicting all the while, reallocates nothing."""
    cache = _cache(capacity=5000, max_trie_depth=6)
    reserved = cache.reserved_bytes
    # 64 bytes of per-node arrays a node, a child table of >= 2 slots a node (12 bytes each)
    assert reserved >= 5000 * (64 + 24)
    rng = random.Random(5)
    for _ in range(60):
        cache.insert([rng.randrange(500) for _ in range(200)])
        assert cache.reserved_bytes == reserved
    assert cache.num_nodes == 5000  # full, so it evicted
    cache.check_integrity()


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_a_smaller_budgets_tree_is_a_prefix_of_a_larger_ones(match_type: str) -> None:
    """What lets the tree sizing cut the trie's tree instead of building it again."""
    rng = random.Random(8)
    cache = _cache(max_trie_depth=6, match_type=match_type, max_bfs_breadth=4)
    seqs = [[rng.randrange(6) for _ in range(80)] for _ in range(5)]
    for s in seqs:
        cache.insert(s)
    for s in seqs:
        for end in range(3, 80, 7):
            tokens, parents = cache.draft_lists(s[:end], 24)
            for b in range(1, 24):
                assert cache.draft_lists(s[:end], b) == (tokens[:b], parents[:b])


def test_trie_nodes_add_no_objects_for_the_garbage_collector() -> None:
    # millions of nodes must not make every full collection walk millions of objects
    rng = random.Random(6)
    cache = _cache(match_type="PROB")
    cache.insert([rng.randrange(50) for _ in range(100)])
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(200):
        cache.extend("r", [1, 2, 3], [rng.randrange(50) for _ in range(10)])
        cache.draft([rng.randrange(50)], 8)  # PROB keeps a small top-k list per drafted node
    gc.collect()
    assert cache.num_nodes > 10_000
    assert len(gc.get_objects()) - before < 1000


def _toy_tokenize(text: str) -> list[int]:
    return [sum(map(ord, w)) for w in text.split()]


def test_load_corpus_reads_jsonl_records_and_plain_text(tmp_path) -> None:
    jl = tmp_path / "corpus.jsonl"
    jl.write_text(
        "\n".join(
            [
                json.dumps({"tokens": [1, 2, 3, 4, 5]}),
                "",
                json.dumps({"text": "the quick brown fox jumps"}),
                json.dumps("over the lazy dog"),
            ]
        )
    )
    cache = _cache()
    assert cache.load_corpus(jl, tokenize=_toy_tokenize) == 5 + 5 + 4
    assert cache.draft_lists([2, 3], 4) == ([3, 4, 5], [-1, 0, 1])
    quick = _toy_tokenize("the quick brown fox jumps")
    assert cache.draft_lists(quick[:2], 3)[0] == quick[1:4]
    assert cache.count(_toy_tokenize("fox jumps over")) == 0  # records are separate documents

    txt = tmp_path / "corpus.txt"
    txt.write_text("alpha beta gamma delta\nepsilon\n\nzeta eta theta\n")
    cache = _cache()
    assert cache.load_corpus(str(txt), tokenize=_toy_tokenize) == 5 + 3
    words = _toy_tokenize("alpha beta gamma delta epsilon")
    assert cache.draft_lists(words[:1], 5)[0] == words
    assert cache.count(_toy_tokenize("epsilon zeta")) == 0


def test_load_corpus_rejects_text_without_tokenizer_and_bad_records(tmp_path) -> None:
    jl = tmp_path / "c.jsonl"
    jl.write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(ValueError, match="tokenizer"):
        _cache().load_corpus(jl)
    jl.write_text(json.dumps({"tokens": [1, 2]}) + "\n" + json.dumps({"other": 1}) + "\n")
    with pytest.raises(ValueError, match=":2"):
        _cache().load_corpus(jl)
    jl.write_text("{not json\n")
    with pytest.raises(ValueError, match="invalid JSON"):
        _cache().load_corpus(jl)
    with pytest.raises(ValueError, match="not found"):
        _cache().load_corpus(tmp_path / "missing.jsonl")


@pytest.mark.parametrize(
    "kw",
    [
        {"max_trie_depth": 1},
        {"capacity": 10},
        {"min_match_window": 0},
        {"min_match_window": 18},
        {"min_bfs_breadth": 3, "max_bfs_breadth": 2},
        {"match_type": "DFS"},
        {"num_draft_tokens": 0},
    ],
)
def test_config_rejects_invalid_values(kw: dict) -> None:
    with pytest.raises(ValueError):
        NgramConfig(**kw)


def test_tree_size_grows_with_the_match_length_within_the_budget() -> None:
    base, budget = 8, 16
    sizes = [tree_size_for_match(m, base, budget) for m in range(6)]
    assert sizes == [1, 4, 6, 12, 16, 16]
    assert all(a <= b for a, b in zip(sizes, sizes[1:]))
    # the budget always caps (concurrency grants only `base`; a retraction may grant less)
    assert [tree_size_for_match(m, base, 8) for m in range(1, 6)] == [4, 6, 8, 8, 8]
    assert [tree_size_for_match(m, base, 3) for m in range(1, 6)] == [3, 3, 3, 3, 3]
    assert tree_size_for_match(5, base, 1) == 1


def test_sized_trees_follow_the_longest_match_and_sure_drafts_only_on_long_ones() -> None:
    cache = NgramCache(NgramConfig(max_trie_depth=18, num_draft_tokens=8))
    assert cache.cfg.size_by_match  # the default
    passage = list(range(1000, 1040))
    cache.insert(passage)
    for c in range(100, 130):  # token 7 has many one-token continuations
        cache.insert([7, c, c + 100])
    # a one-token match: half the base size, however large the budget
    tokens, _ = cache.draft_lists([5, 7], 16)
    assert len(tokens) == 4
    # a long match (inside the passage): the whole budget, as a chain of the passage
    tokens, parents = cache.draft_lists(passage[:10], 16)
    assert tokens == passage[9:25] and parents == list(range(-1, 15))
    # confident only: nothing on a short match, the sized tree on a long one
    assert cache.draft_lists([5, 7], 16, confident_only=True) == ([7], [-1])
    assert cache.draft_lists(passage[:10], 16, confident_only=True)[0] == passage[9:25]
    assert cache.draft_lists(passage[:2], 16, confident_only=True) == ([passage[1]], [-1])  # m = 2
    # no match at all: the root alone, confident only or not
    assert cache.draft_lists([99999], 16) == ([99999], [-1])
    # sizing off: a one-token match fills the budget
    flat = _cache(max_trie_depth=8, num_draft_tokens=8)
    for c in range(100, 130):
        flat.insert([7, c, c + 100])
    assert len(flat.draft_lists([5, 7], 16)[0]) == 16
