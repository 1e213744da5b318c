"""The C++ n-gram trie (`NgramCache`) against the small Python reference
(tests/helpers/ngram_reference.py): the same random operations on both, and after every one the
same result, the same n-grams and counts in the same recency orders, and the C++ trie whole
(check_integrity). The capacity is never reached: eviction is tested in test_ngram_cache.py."""

from __future__ import annotations

import random

import pytest

from specserve.speculative.ngram_cache import NgramCache, NgramConfig
from tests.helpers.ngram_reference import ReferenceTrie


def _same(ref: ReferenceTrie, cc: NgramCache) -> None:
    assert cc.num_nodes < cc.cfg.capacity, "the trie evicted: the reference cannot follow"
    assert ref.dump() == cc.dump()
    assert ref.num_nodes == cc.num_nodes
    cc.check_integrity()


def _text(rng: random.Random, vocab: int, n: int, corpus: list[list[int]]) -> list[int]:
    """Random tokens mixed with copies from earlier sequences, so suffixes match and repeat."""
    out: list[int] = []
    while len(out) < n:
        if corpus and rng.random() < 0.6:
            src = rng.choice(corpus)
            i = rng.randrange(len(src))
            out += src[i:i + rng.randint(2, 30)]
        else:
            out += [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
    return out[:n]


CONFIGS = [
    # shallow and deep, both match types, sized and unsized trees
    dict(max_trie_depth=4, match_type="BFS", num_draft_tokens=6),
    dict(max_trie_depth=8, match_type="PROB", num_draft_tokens=8, max_bfs_breadth=4,
         min_bfs_breadth=2, max_tracked_requests=3),
    dict(max_trie_depth=12, match_type="BFS", num_draft_tokens=10, size_by_match=False,
         min_match_window=2),
    dict(max_trie_depth=24, match_type="PROB", max_bfs_breadth=10, num_draft_tokens=8),
]


def _draft_both(rng: random.Random, ref: ReferenceTrie, cc: NgramCache, ctx: list[int],
                key: object) -> None:
    budget = rng.choice([None, 1, 2, 4, 8, 16])
    backed = rng.random() < 0.2
    want = ref.draft_lists(ctx, budget, key=key, confident_only=backed)
    assert cc.draft_lists(ctx, budget, key=key, confident_only=backed) == want
    assert cc.last_match_len == ref.last_match_len
    kw = dict(spec_factor=rng.choice([0.5, 1.0, 2.0]), spec_offset=rng.choice([0.0, 1.0]),
              min_prob=rng.choice([0.05, 0.1, 0.3]), key=key)
    n = rng.choice([1, 3, 8, 24])
    assert cc.draft_scored(ctx, n, **kw) == ref.draft_scored(ctx, n, **kw)  # probs bit for bit
    assert cc.last_match_len == ref.last_match_len


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"d{c['max_trie_depth']}-{c['match_type']}")
@pytest.mark.parametrize("seed", range(3))
def test_random_operations_give_the_references_trie_and_drafts(cfg: dict, seed: int) -> None:
    rng = random.Random(seed)
    config = NgramConfig(capacity=200_000, **cfg)
    ref, cc = ReferenceTrie(config), NgramCache(config)
    vocab = rng.choice([5, 20, 300])
    depth = cfg["max_trie_depth"]
    corpus: list[list[int]] = []
    live: dict[object, list[int]] = {}  # request key -> its history so far
    keys = ["a", "b", 7, ("t", 1), "c"]
    for step in range(400):
        op = rng.random()
        if op < 0.1:
            seq = _text(rng, vocab, rng.randint(1, 60), corpus)
            corpus.append(seq)
            ref.insert(seq)
            cc.insert(seq)
        elif op < 0.55:
            key = rng.choice(keys)
            hist = live.setdefault(key, _text(rng, vocab, rng.randint(1, 20), corpus))
            new = _text(rng, vocab, rng.randint(0, 5), corpus + [hist])
            # mostly the request's own context; sometimes a different one (its state is stale)
            ctx = hist if rng.random() < 0.9 else _text(rng, vocab, 10, corpus)
            ref.extend(key, ctx[-depth:], new)
            cc.extend(key, ctx[-depth:], new)
            hist += new
        elif op < 0.8:
            key = rng.choice(keys + [None])
            ctx = live.get(key) or _text(rng, vocab, rng.randint(1, 30), corpus)
            _draft_both(rng, ref, cc, ctx, key)
        elif op < 0.9 and corpus:
            seq = corpus.pop(rng.randrange(len(corpus)))
            ref.remove(seq)
            cc.remove(seq)
        elif live:
            key = rng.choice(list(live))
            del live[key]
            ref.release(key)
            cc.release(key)
        if step % 25 == 0:
            _same(ref, cc)
            probe = _text(rng, vocab, rng.randint(1, 5), corpus)
            assert ref.count(probe) == cc.count(probe)
    _same(ref, cc)
