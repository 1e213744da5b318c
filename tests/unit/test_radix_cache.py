from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from specserve.runtime.mem_cache.allocator import TokenSlotAllocator
from specserve.runtime.mem_cache.radix_cache import RadixCache, TreeNode


def _insert_fresh(cache: RadixCache, alloc: TokenSlotAllocator, tokens: list[int]) -> torch.Tensor:
    """Cache `tokens` computed on fresh slots (no match): the caller frees the duplicates."""
    slots = alloc.alloc(len(tokens))
    dup = cache.insert(tokens, slots)
    alloc.free(slots[:dup])
    return slots


def _admit(cache: RadixCache, alloc: TokenSlotAllocator, prompt: list[int], extend_len: int):
    """Scheduler admission, exactly as documented: match, lock, evict if short, allocate.

    Returns (slots, node, prefix_len) or None (and no lock held) when memory is too tight.
    """
    m = cache.match_prefix(prompt)
    cache.lock(m.node)
    if alloc.num_free < extend_len:
        cache.evict(extend_len - alloc.num_free)
    if alloc.num_free < extend_len:
        cache.unlock(m.node)
        return None
    slots = torch.cat([m.slots, alloc.alloc(extend_len)])
    return slots, m.node, m.slots.numel()


def test_match_splits_inside_node_and_returns_prefix_slots():
    alloc = TokenSlotAllocator(100)
    cache = RadixCache(alloc)
    s = _insert_fresh(cache, alloc, [1, 2, 3, 4, 5])
    m = cache.match_prefix([1, 2, 3, 9])
    assert m.slots.tolist() == s[:3].tolist()
    assert m.node.key == (1, 2, 3) and m.node.value.tolist() == s[:3].tolist()
    assert [c.key for c in m.node.children.values()] == [(4, 5)]
    full = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert full.slots.tolist() == s.tolist() and full.node.key == (4, 5)
    none = cache.match_prefix([7, 1])
    assert none.slots.numel() == 0 and none.node is cache.root
    assert cache.total_size == cache.evictable_size == 5
    cache.check_integrity()


def test_insert_returns_length_of_prefix_already_cached():
    alloc = TokenSlotAllocator(100)
    cache = RadixCache(alloc)
    a = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4], a) == 0
    b = alloc.alloc(6)
    assert cache.insert([1, 2, 3, 4, 5, 6], b) == 4
    alloc.free(b[:4])  # duplicates of cached KV: the caller's to free
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).slots.tolist() == a.tolist() + b[4:].tolist()
    c = alloc.alloc(3)
    assert cache.insert([1, 2, 7], c) == 2  # ends inside node (1, 2, 3, 4): split
    alloc.free(c[:2])
    d = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4], d) == 4
    alloc.free(d)
    assert cache.total_size == 7 and alloc.num_used == 7
    cache.check_integrity()
    alloc.check_integrity()


def test_evict_is_lru_and_never_touches_locked_nodes():
    alloc = TokenSlotAllocator(100)
    cache = RadixCache(alloc)
    for t in (1, 2, 3):
        _insert_fresh(cache, alloc, [t] * 3)
    cache.match_prefix([1, 1, 1])  # touch A: LRU order is now B, C, A
    b = cache.match_prefix([2, 2, 2])  # touches B ...
    cache.lock(b.node)  # ... but locked B must be skipped
    cache.match_prefix([1, 1])  # A touched last (split 1,1 | 1)
    assert cache.evict(1) == 3
    assert cache.match_prefix([3, 3, 3]).slots.numel() == 0, "C was least recently used"
    assert cache.match_prefix([1, 1, 1]).slots.numel() == 3
    assert cache.evict(100) == 3  # A's two nodes (the parent becomes a leaf); B stays
    assert cache.match_prefix([2, 2, 2]).slots.numel() == 3
    assert cache.protected_size == 3 and cache.evictable_size == 0 and alloc.num_used == 3
    cache.unlock(b.node)
    assert cache.evictable_size == 3 and cache.evict(1) == 3 and alloc.num_used == 0
    cache.check_integrity()


def test_locked_leaf_protects_its_ancestors_but_not_siblings():
    alloc = TokenSlotAllocator(100)
    cache = RadixCache(alloc)
    _insert_fresh(cache, alloc, [5, 5, 6, 6])
    _insert_fresh(cache, alloc, [5, 5, 7, 7])
    m = cache.match_prefix([5, 5, 6, 6])
    cache.lock(m.node)
    assert cache.protected_size == 4 and cache.evictable_size == 2
    assert cache.evict(100) == 2
    assert cache.match_prefix([5, 5, 7, 7]).slots.numel() == 2
    cache.unlock(m.node)
    assert cache.evict(100) == 4 and cache.total_size == 0 and alloc.num_used == 0
    cache.check_integrity()


def test_evict_frees_exactly_what_it_reports_to_the_allocator():
    rng = random.Random(3)
    alloc = TokenSlotAllocator(400)
    cache = RadixCache(alloc)
    for _ in range(40):
        _insert_fresh(cache, alloc, [rng.randrange(3) for _ in range(rng.randint(1, 8))])
    for k in (1, 2, 5, 13, 1000):
        before_free, before_evictable = alloc.num_free, cache.evictable_size
        freed = cache.evict(k)
        assert alloc.num_free - before_free == freed
        assert before_evictable - cache.evictable_size == freed
        assert freed >= k if before_evictable >= k else freed == before_evictable
        cache.check_integrity()
    assert cache.total_size == 0 and alloc.num_free == alloc.capacity


def test_lock_stays_valid_when_a_later_match_splits_the_locked_node():
    alloc = TokenSlotAllocator(100)
    cache = RadixCache(alloc)
    _insert_fresh(cache, alloc, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.lock(m.node)
    cache.match_prefix([1, 2, 9])  # splits the locked node; m.node keeps its identity
    assert m.node.key == (3, 4, 5, 6) and cache.protected_size == 6
    cache.check_integrity()
    cache.unlock(m.node)
    assert cache.protected_size == 0 and cache.evictable_size == 6
    with pytest.raises(AssertionError):
        cache.unlock(m.node)


def test_scheduler_protocol_frees_duplicates_and_keeps_cache_slots():
    alloc = TokenSlotAllocator(12)
    cache = RadixCache(alloc)
    prompt = [10, 11, 12, 13]
    # A and B run the same prompt concurrently: neither finds it cached
    a_slots, a_node, a_prefix = _admit(cache, alloc, prompt, 4)
    b_slots, b_node, b_prefix = _admit(cache, alloc, prompt, 4)
    assert a_prefix == b_prefix == 0 and a_node is cache.root
    a_slots = torch.cat([a_slots, alloc.alloc(2)])  # two decode steps
    cache.cache_finished(prompt + [20, 21], a_slots, a_node, a_prefix)
    assert cache.total_size == 6 and alloc.num_used == 6 + 4
    b_slots = torch.cat([b_slots, alloc.alloc(1)])
    cache.cache_finished(prompt + [30], b_slots, b_node, b_prefix)
    assert alloc.num_used == cache.total_size == 7, "B's duplicate prompt slots were freed"
    # C reuses A's output; memory is short (12 - 7 = 5 free, 6 needed) so it must evict B's leaf
    c_prompt = prompt + [20, 21] + [40] * 6
    c_slots, c_node, c_prefix = _admit(cache, alloc, c_prompt, 6)
    assert c_prefix == 6 and c_slots[:6].tolist() == a_slots.tolist()
    assert cache.match_prefix(prompt + [30]).slots.numel() == 4, "B's leaf was evicted"
    cache.cache_finished(c_prompt, c_slots, c_node, c_prefix)
    assert alloc.num_used == cache.total_size == 12 and cache.protected_size == 0
    cache.check_integrity()
    alloc.check_integrity()
    cache.reset()
    assert alloc.num_free == alloc.capacity


def test_cache_unfinished_moves_lock_and_hands_back_cache_slots():
    alloc = TokenSlotAllocator(64)
    cache = RadixCache(alloc)
    prompt = list(range(1, 9))
    x_slots, x_node, x_prefix = _admit(cache, alloc, prompt, 4)  # chunk 1: prompt[:4]
    y = _insert_fresh(cache, alloc, prompt[:3] + [99])  # another request finished meanwhile
    m = cache.cache_unfinished(prompt[:4], x_slots, x_node, x_prefix)
    assert m.slots.tolist() == y[:3].tolist() + x_slots[3:].tolist()
    assert cache.protected_size == 4 and m.node.lock_ref == 1
    assert alloc.num_used == cache.total_size == 5, "X's 3 duplicate slots were freed"
    slots = torch.cat([m.slots, alloc.alloc(4)])  # chunk 2
    cache.cache_finished(prompt, slots, m.node, m.slots.numel())
    assert cache.protected_size == 0 and alloc.num_used == cache.total_size == 9
    cache.check_integrity()


def test_disabled_cache_holds_nothing_and_caller_frees_everything():
    alloc = TokenSlotAllocator(32)
    cache = RadixCache(alloc, disable=True)
    slots, node, prefix_len = _admit(cache, alloc, [1, 2, 3], 3)
    assert node is cache.root and prefix_len == 0
    assert cache.insert([1, 2, 3], slots) == 0 and cache.total_size == 0
    assert cache.match_prefix([1, 2, 3]).slots.numel() == 0
    m = cache.cache_unfinished([1, 2, 3], slots, node, prefix_len)
    assert m.slots is slots and m.node is cache.root
    assert cache.evict(10) == 0
    cache.cache_finished([1, 2, 3], slots, node, prefix_len)
    assert alloc.num_free == alloc.capacity
    cache.check_integrity()


def test_reset_refuses_while_locked_and_frees_everything_after():
    alloc = TokenSlotAllocator(32)
    cache = RadixCache(alloc)
    _insert_fresh(cache, alloc, [1, 2, 3])
    _insert_fresh(cache, alloc, [1, 4])
    m = cache.match_prefix([1, 2])
    cache.lock(m.node)
    with pytest.raises(AssertionError):
        cache.reset()
    cache.unlock(m.node)
    cache.reset()
    assert alloc.num_free == alloc.capacity and cache.total_size == 0
    assert cache.match_prefix([1, 2, 3]).slots.numel() == 0


@dataclass
class _Req:
    prompt: list[int]
    tokens: list[int]  # tokens whose KV is computed; len(tokens) == len(slots)
    slots: torch.Tensor
    node: TreeNode
    prefix_len: int  # slots[:prefix_len] are the cache's


@pytest.mark.parametrize("seed", [0, 1])
def test_random_requests_keep_integrity_and_return_every_slot(seed: int):
    rng = random.Random(seed)
    alloc = TokenSlotAllocator(120)
    cache = RadixCache(alloc)
    bases = [[rng.randrange(4) for _ in range(20)] for _ in range(3)]
    kv: dict[int, tuple[int, ...]] = {}  # oracle: slot -> the token prefix its KV encodes
    running: list[_Req] = []
    hits = evicted = 0

    def grow(req: _Req, new_tokens: list[int]) -> bool:
        n = len(new_tokens)
        if alloc.num_free < n:
            cache.evict(n - alloc.num_free)
        if alloc.num_free < n:
            return False
        new = alloc.alloc(n)
        for s in new.tolist():
            req.tokens.append(new_tokens.pop(0))
            kv[s] = tuple(req.tokens)
        req.slots = torch.cat([req.slots, new])
        return True

    for _ in range(300):
        op = rng.random()
        if op < 0.3 and len(running) < 6:
            base = rng.choice(bases)
            suffix = [rng.randrange(4) for _ in range(rng.randint(1, 6))]
            prompt = base[: rng.randint(0, 20)] + suffix
            m = cache.match_prefix(prompt)
            hits += m.slots.numel() > 0
            cache.lock(m.node)
            req = _Req(prompt, prompt[: m.slots.numel()], m.slots, m.node, m.slots.numel())
            chunk = rng.randint(1, 8)
            if grow(req, prompt[req.prefix_len :][:chunk]):
                running.append(req)
            else:
                cache.unlock(m.node)
        elif op < 0.7 and running:
            req = rng.choice(running)
            done = len(req.tokens)
            if done < len(req.prompt):  # next prefill chunk: cache what is computed first
                m = cache.cache_unfinished(req.tokens, req.slots, req.node, req.prefix_len)
                req.slots, req.node, req.prefix_len = m.slots, m.node, m.slots.numel()
                grow(req, req.prompt[done:][: rng.randint(1, 8)])
            else:
                grow(req, [rng.randrange(4)])  # decode one token
        elif op < 0.9 and running:
            req = running.pop(rng.randrange(len(running)))
            cache.cache_finished(req.tokens, req.slots, req.node, req.prefix_len)
        elif op < 0.97:
            k, before = rng.randint(1, 30), alloc.num_free
            freed = cache.evict(k)
            assert alloc.num_free - before == freed
            evicted += freed
        elif not running:
            cache.reset()
            assert alloc.num_free == alloc.capacity
        cache.check_integrity()
        alloc.check_integrity()
        owned_by_reqs = sum(r.slots.numel() - r.prefix_len for r in running)
        assert alloc.num_used == cache.total_size + owned_by_reqs, "a slot leaked or is shared"
        for r in running:  # every slot a request uses still holds that request's KV
            assert all(kv[s] == tuple(r.tokens[: i + 1]) for i, s in enumerate(r.slots.tolist()))
        assert cache.protected_size <= sum(r.prefix_len for r in running)
    assert hits > 10 and evicted > 0, "the workload must exercise reuse and eviction"
    for req in running:
        cache.cache_finished(req.tokens, req.slots, req.node, req.prefix_len)
    assert cache.protected_size == 0
    cache.reset()
    cache.check_integrity()
    assert alloc.num_free == alloc.capacity
