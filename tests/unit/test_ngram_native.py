"""The C++ n-gram trie (`NativeNgramCache`) against the Python reference (`NgramCache`): the same
random operations on both, and after every one the same result, the same n-grams and counts in
the same recency orders, and both tries whole (check_integrity)."""

from __future__ import annotations

import random

import pytest

from speculative.ngram_cache import (
    NativeNgramCache,
    NgramCache,
    NgramConfig,
    native_available,
    new_ngram_cache,
)

pytestmark = pytest.mark.skipif(not native_available(), reason="the CPU extension is not built")


def _pair(**kw) -> tuple[NgramCache, NativeNgramCache]:
    cfg = NgramConfig(**kw)
    return NgramCache(cfg), NativeNgramCache(cfg)


def _same(py: NgramCache, cc: NativeNgramCache) -> None:
    assert py.num_nodes == cc.num_nodes
    assert py.dump() == cc.dump()
    py.check_integrity()
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
    # small tries that evict all the time, shallow and deep, both match types
    dict(capacity=64, max_trie_depth=4, match_type="BFS", num_draft_tokens=6),
    dict(capacity=300, max_trie_depth=8, match_type="PROB", num_draft_tokens=8,
         max_bfs_breadth=4, min_bfs_breadth=2, max_tracked_requests=3),
    dict(capacity=2000, max_trie_depth=12, match_type="BFS", num_draft_tokens=10,
         size_by_match=False, min_match_window=2),
    dict(capacity=100_000, max_trie_depth=24, match_type="PROB", max_bfs_breadth=10,
         num_draft_tokens=8),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"cap{c['capacity']}-d{c['max_trie_depth']}")
@pytest.mark.parametrize("seed", range(3))
def test_random_operations_give_the_same_trie_and_drafts(cfg: dict, seed: int) -> None:
    rng = random.Random(seed)
    py, cc = _pair(**cfg)
    vocab = rng.choice([5, 20, 300])
    corpus: list[list[int]] = []
    live: dict[object, list[int]] = {}  # request key -> its history so far
    keys = ["a", "b", 7, ("t", 1), "c"]
    for step in range(400):
        op = rng.random()
        if op < 0.1:
            seq = _text(rng, vocab, rng.randint(1, 60), corpus)
            corpus.append(seq)
            py.insert(seq)
            cc.insert(seq)
        elif op < 0.55:
            key = rng.choice(keys)
            hist = live.setdefault(key, _text(rng, vocab, rng.randint(1, 20), corpus))
            new = _text(rng, vocab, rng.randint(1, 5), corpus + [hist])
            depth = cfg["max_trie_depth"]
            # mostly the request's own context; sometimes a different one (its state is stale)
            ctx = hist if rng.random() < 0.9 else _text(rng, vocab, 10, corpus)
            py.extend(key, ctx[-depth:], new)
            cc.extend(key, ctx[-depth:], new)
            hist += new
        elif op < 0.8:
            key = rng.choice(keys + [None])
            ctx = live.get(key) or _text(rng, vocab, rng.randint(1, 30), corpus)
            budget = rng.choice([None, 1, 2, 4, 8, 16])
            backed = rng.random() < 0.2
            want = py.draft_lists(ctx, budget, key=key, backed_off=backed)
            got = cc.draft_lists(ctx, budget, key=key, backed_off=backed)
            assert got == want, f"step {step}"
            assert cc.last_match_len == py.last_match_len
            kw = dict(spec_factor=rng.choice([0.5, 1.0, 2.0]), spec_offset=rng.choice([0.0, 1.0]),
                      min_prob=rng.choice([0.05, 0.1, 0.3]), key=key)
            n = rng.choice([1, 3, 8, 24])
            want = py.draft_scored(ctx, n, **kw)
            got = cc.draft_scored(ctx, n, **kw)
            assert got == want, f"step {step}"  # probabilities bit for bit
            assert cc.last_match_len == py.last_match_len
        elif op < 0.9 and corpus:
            seq = corpus.pop(rng.randrange(len(corpus)))
            py.remove(seq)
            cc.remove(seq)
        elif live:
            key = rng.choice(list(live))
            del live[key]
            py.release(key)
            cc.release(key)
        if step % 25 == 0:
            _same(py, cc)
            probe = _text(rng, vocab, rng.randint(1, 5), corpus)
            assert py.count(probe) == cc.count(probe)
    _same(py, cc)


def test_the_factory_gives_the_native_trie_unless_told_not_to(monkeypatch) -> None:
    cfg = NgramConfig()
    assert isinstance(new_ngram_cache(cfg), NativeNgramCache)
    monkeypatch.setenv("SPECSERVE_NGRAM_NATIVE", "0")
    assert type(new_ngram_cache(cfg)) is NgramCache


def test_native_integrity_check_reports_through_assertion_error() -> None:
    cc = NativeNgramCache(NgramConfig(capacity=64, max_trie_depth=4))
    cc.insert([1, 2, 3, 1, 2, 4])
    cc.check_integrity()
    assert cc.count([1, 2]) == 2 and cc.count([2, 3, 1, 2]) == 1 and cc.count([9]) == 0
    with pytest.raises(ValueError, match="context token"):
        cc.draft_lists([], 4)


def test_memory_is_reserved_up_front_and_never_grows():
    """The whole trie's storage is allocated at construction (its RSS is its ceiling from the
    start): filling it past capacity, evicting all the while, reallocates nothing."""
    cfg = NgramConfig(capacity=5000, max_trie_depth=6, match_type="BFS")
    cc = NativeNgramCache(cfg)
    reserved = cc.reserved_bytes
    # 64 bytes of per-node arrays a node, a child table of >= 2 slots a node (12 bytes each)
    assert reserved >= cfg.capacity * (64 + 24)
    rng = random.Random(5)
    corpus: list[list[int]] = []
    for _ in range(60):
        toks = _text(rng, 500, 200, corpus)
        corpus.append(toks)
        cc.insert(toks)
        assert cc.reserved_bytes == reserved
    assert cc.num_nodes == cfg.capacity  # full, so it evicted
    cc.check_integrity()
