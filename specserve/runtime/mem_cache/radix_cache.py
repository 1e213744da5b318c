"""Radix prefix cache: a radix tree over token ids whose values are KV slots (page size 1).

Each edge (a `TreeNode`) holds a run of token ids `key` and the KV slots `value` computed for
them; the path from the root to a node spells a token prefix, and the slots along it are the KV
of exactly that prefix. Only the scheduler (single-threaded) touches it.

Ownership of slots — every allocated slot has exactly one owner at any time:
- the cache owns the slots stored in its nodes and frees them only by `evict` / `reset`;
- a running request owns the slots it allocated that are not (yet) in the cache.

Protocol followed by the scheduler (`cache_finished` / `cache_unfinished` implement steps 4-5):
1. New request: `m = cache.match_prefix(prompt)`; `cache.lock(m.node)`. The request's first
   `prefix_len = len(m.slots)` slots are `m.slots`; they stay owned by the cache, and the lock
   keeps them from being evicted while the request runs.
2. Allocate slots for the other `extend_len` tokens, calling `cache.evict(n)` first if the
   allocator lacks `n` free slots. Those slots are owned by the request.
3. Run the model; decode steps allocate one more slot per token the same way.
4. Finished: `cache.cache_finished(token_ids, slots, m.node, prefix_len)` with only the tokens
   whose KV was computed (len(token_ids) == len(slots)). It calls `dup = insert(...)`: the cache
   already held `token_ids[:dup]` (dup >= prefix_len, the locked prefix cannot have gone), so
   `slots[prefix_len:dup]` duplicate KV another request inserted meanwhile and are freed, while
   `slots[dup:]` become cache-owned. Then it unlocks `m.node`.
5. Chunked prefill (a chunk done, more to come): `m = cache.cache_unfinished(...)` inserts the
   part computed so far the same way, re-matches it, moves the lock to the new deepest node and
   returns the slots the request must use from now on (the cache's slots for the whole computed
   part); the request replaces its slot list with `m.slots` and sets `prefix_len = len(m.slots)`.

With `disable=True` nothing is cached: matches are empty at the root, `insert` returns 0 and the
scheduler frees all of a request's slots itself (`cache_finished` does exactly that).

Invariants (`check_integrity`): evictable_size + protected_size == total_size == slots held; every
non-root node has len(value) == len(key) > 0 and is keyed in its parent by its first token; ref
counts are >= 0 and a parent's is >= each child's (a lock covers a node and all its ancestors);
no slot appears twice and slot 0 (padding) never appears.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from specserve.runtime.mem_cache.allocator import TokenSlotAllocator


@dataclass(eq=False, slots=True)
class TreeNode:
    key: tuple[int, ...]  # token ids on the edge from the parent
    value: torch.Tensor  # [len(key)] int64 KV slots of those tokens
    parent: TreeNode | None
    children: dict[int, TreeNode] = field(default_factory=dict)  # first token of key -> child
    lock_ref: int = 0  # number of locks on this node or any descendant
    last_access: int = 0  # tick of the cache's logical clock; larger = more recent


class PrefixMatch(NamedTuple):
    slots: torch.Tensor  # [prefix_len] int64 cached KV slots of the matched prefix
    node: TreeNode  # deepest matched node (ends exactly at prefix_len); lock it to keep the slots


def _empty_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


def _common_len(key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of `key` and `tokens[start:]`."""
    n = min(len(key), len(tokens) - start)
    if key[:n] == tokens[start : start + n]:  # fast path: the whole edge matches
        return n
    i = 0
    while key[i] == tokens[start + i]:
        i += 1
    return i


class RadixCache:
    def __init__(self, allocator: TokenSlotAllocator, disable: bool = False) -> None:
        self.allocator = allocator
        self.disable = disable
        self._reset_tree()

    def _reset_tree(self) -> None:
        # Forgets every node WITHOUT freeing slots; `reset` frees them first.
        self.root = TreeNode(key=(), value=_empty_slots(), parent=None)
        self._evictable_size = 0
        self._protected_size = 0
        self._clock = 0

    @property
    def evictable_size(self) -> int:
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        return self._protected_size

    @property
    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    # ---- lookup / insertion ----------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of `token_ids`: its slots and the node ending exactly there.

        A match ending inside a node splits it, so the returned node covers the prefix only.
        Touches (LRU) every node on the path. Disabled: empty match at the root.
        """
        if self.disable:
            return PrefixMatch(_empty_slots(), self.root)
        tokens = self._as_tokens(token_ids)
        tick = self._tick()
        node, pos, values = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_len(child.key, tokens, pos)
            partial = n < len(child.key)
            if partial:
                child = self._split(child, n)
            child.last_access = tick
            values.append(child.value)
            node, pos = child, pos + n
            if partial:
                break
        slots = torch.cat(values) if values else _empty_slots()
        return PrefixMatch(slots, node)

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Cache a fully computed sequence; return how many leading tokens were ALREADY cached.

        Ownership: `slots[:returned]` duplicate KV the cache already holds and stay with the
        CALLER, who must free those it owns (not those that are the cache's own slots from a
        match); `slots[returned:]` now belong to the cache. Disabled: returns 0, cache owns none.
        """
        assert len(token_ids) == slots.numel(), "one slot per token"
        if self.disable:
            return 0
        tokens = self._as_tokens(token_ids)
        tick = self._tick()
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                new = TreeNode(tokens[pos:], slots[pos:].to(torch.int64).clone(), node)
                new.last_access = tick
                node.children[tokens[pos]] = new
                self._evictable_size += len(new.key)
                return pos
            n = _common_len(child.key, tokens, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            node, pos = child, pos + n
        return pos

    # ---- locking ---------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and all its ancestors from eviction (reference counted)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock of a node that is not locked"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
            node = node.parent

    # ---- the request protocol (module docstring, steps 4-5) --------------------------------

    def cache_finished(
        self,
        token_ids: Sequence[int],
        slots: torch.Tensor,
        locked_node: TreeNode,
        num_cached_at_start: int,
    ) -> None:
        """A request finished: hand its computed KV to the cache, free duplicates, unlock.

        `slots[:num_cached_at_start]` are the cache's slots from the request's match (or last
        `cache_unfinished`); the rest are the request's. Afterwards the request owns no slot.
        """
        if self.disable:
            self.allocator.free(slots)
            return
        dup = self.insert(token_ids, slots)
        assert dup >= num_cached_at_start, "the locked prefix vanished from the cache"
        self.allocator.free(slots[num_cached_at_start:dup])
        self.unlock(locked_node)

    def cache_unfinished(
        self,
        token_ids: Sequence[int],
        slots: torch.Tensor,
        locked_node: TreeNode,
        num_cached_at_start: int,
    ) -> PrefixMatch:
        """A chunk of a request is computed: cache it, keep the request running on the cache's KV.

        Returns the slots the request must use for `token_ids` from now on (all cache-owned)
        and the new node, which is locked in place of `locked_node`. Disabled: returns the
        request's own `slots` and the root; nothing changes hands.
        """
        if self.disable:
            return PrefixMatch(slots, self.root)
        dup = self.insert(token_ids, slots)
        assert dup >= num_cached_at_start, "the locked prefix vanished from the cache"
        self.allocator.free(slots[num_cached_at_start:dup])
        m = self.match_prefix(token_ids)
        assert m.slots.numel() == len(token_ids), "just inserted tokens must match in full"
        self.lock(m.node)  # lock the new path before unlocking the old one it extends
        self.unlock(locked_node)
        return m

    # ---- eviction --------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots (if that many are evictable), LRU leaves first.

        Returns the number of slots given back to the allocator (may exceed `num_tokens`: whole
        nodes are evicted). Locked nodes and their ancestors are never touched.
        """
        if self.disable or num_tokens <= 0:
            return 0
        # (last_access, tie-break, node): the tie-break keeps the heap from comparing nodes
        heap = [(n.last_access, i, n) for i, n in enumerate(self._evictable_leaves())]
        heapq.heapify(heap)
        seq = len(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self.allocator.free(node.value)
            freed += len(node.key)
            self._evictable_size -= len(node.key)
            del parent.children[node.key[0]]
            node.parent = None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, seq, parent))
                seq += 1
        return freed

    def reset(self) -> None:
        """Flush: give every cached slot back to the allocator. Nothing may be locked."""
        assert self._protected_size == 0, "reset while requests hold locks on cached prefixes"
        for node in self._nodes():
            self.allocator.free(node.value)
        self._reset_tree()

    # ---- checks and helpers ----------------------------------------------------------------

    def check_integrity(self) -> None:
        evictable = protected = 0
        values = [self.root.value]
        assert self.root.key == () and self.root.value.numel() == 0, "root holds no tokens"
        for node in self._nodes():
            assert len(node.key) > 0, "empty non-root node"
            assert node.value.numel() == len(node.key), "slots and key lengths differ"
            assert node.parent is not None and node.parent.children.get(node.key[0]) is node, (
                "node not keyed in its parent by its first token"
            )
            assert node.lock_ref >= 0, "negative ref count"
            if node.parent is not self.root:
                assert node.parent.lock_ref >= node.lock_ref, "lock not propagated to ancestors"
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
            values.append(node.value)
        assert evictable == self._evictable_size, "evictable_size out of sync"
        assert protected == self._protected_size, "protected_size out of sync"
        slots = torch.cat(values)
        assert slots.unique().numel() == slots.numel(), "a slot is cached twice"
        assert bool((slots >= 1).all()), "padding slot 0 in the cache"
        assert self.total_size <= self.allocator.num_used, "cache holds more than is allocated"

    def _nodes(self) -> list[TreeNode]:
        """Every non-root node (iterative DFS: deep trees must not hit the recursion limit)."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def _evictable_leaves(self) -> list[TreeNode]:
        return [n for n in self._nodes() if not n.children and n.lock_ref == 0]

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child` after `n` tokens; return the new upper node. `child` keeps its identity
        (as the lower part) so locks held on it stay valid; the upper part inherits its refs."""
        assert 0 < n < len(child.key)
        parent = child.parent
        upper = TreeNode(child.key[:n], child.value[:n], parent, children={child.key[n]: child})
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        parent.children[upper.key[0]] = upper
        return upper

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    @staticmethod
    def _as_tokens(token_ids: Sequence[int]) -> tuple[int, ...]:
        assert not isinstance(token_ids, torch.Tensor), "pass token ids as a sequence of ints"
        return tuple(token_ids)
