"""A small Python n-gram trie: the reference that the C++ trie (`specserve.speculative.ngram_cache.
NgramCache`) is checked against (tests/unit/test_ngram_reference.py). Test code only: nothing
drafts from it.

It keeps what decides counts, recency orders and drafts, written as plainly as possible, and
nothing else: no capacity, eviction or LRU (tests/unit/test_ngram_cache.py checks those on the
C++ trie directly), no per-request anchor states (`extend` looks its anchors up, which the C++
trie's saved anchors must agree with), no cached top-k lists. Compare it with a C++ trie whose
capacity is never reached.

A node is its token, its count and a dict {token: child} in recency order, least recent first.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Iterator, Sequence

from specserve.speculative.ngram_cache import (
    CONFIDENT_MATCH,
    NgramConfig,
    bfs_breadths,
    tree_size_for_match,
)
from specserve.speculative.ngram_context import grow_best_first


class _Node:
    __slots__ = ("token", "count", "kids")

    def __init__(self, token: int, count: int) -> None:
        self.token, self.count = token, count
        self.kids: dict[int, _Node] = {}

    def total(self) -> int:
        return sum(c.count for c in self.kids.values())


class ReferenceTrie:
    """The n-gram trie's semantics (module docstring of specserve/speculative/ngram_cache.py),
    unbounded."""

    def __init__(self, cfg: NgramConfig) -> None:
        self.cfg, self.depth = cfg, cfg.max_trie_depth
        self.root = _Node(-1, 0)
        self.breadth = bfs_breadths(cfg)
        self.last_match_len = 0

    # ---------------------------------------------------------------- counting

    def insert(self, tokens: Sequence[int]) -> None:
        self.extend(None, [], tokens)

    def extend(self, key: Hashable, context_tail: Sequence[int], new_tokens: Sequence[int]) -> None:
        """Count the n-grams ending in `new_tokens`; `key` is unused (no saved anchors)."""
        tail = self._tail(context_tail)
        # anchors[k]: the node of tail[-k:] (None: missing, created on first use with count 1)
        anchors = [self.root] + [self._find(tail[len(tail) - k:]) for k in range(1, len(tail) + 1)]
        for t in new_tokens:
            after = [self.root]
            for k, node in enumerate(anchors):
                if node is None:
                    node = self._materialize(tail[len(tail) - k:])
                child = self._count(node, int(t))
                if k + 1 < self.depth:
                    after.append(child)
            anchors = after
            tail = (tail + [int(t)])[-(self.depth - 1):]

    def _count(self, node: _Node, t: int) -> _Node:
        child = node.kids.get(t)
        if child is None:
            child = node.kids[t] = _Node(t, 1)
        else:
            child.count += 1
            if node is not self.root:  # the most recent sibling goes last (the root's are
                del node.kids[t]  # never drafted from, so their order is left alone)
                node.kids[t] = child
        return child

    def _materialize(self, gram: list[int]) -> _Node:
        node = self.root
        for t in gram:
            child = node.kids.get(t)
            if child is None:
                child = node.kids[t] = _Node(t, 1)
            node = child
        return node

    def release(self, key: Hashable) -> None:
        pass

    def remove(self, tokens: Sequence[int]) -> None:
        toks = [int(t) for t in tokens]
        for s in range(len(toks)):
            node = self.root
            for t in toks[s:s + self.depth]:
                child = node.kids.get(t)
                if child is None:
                    break
                child.count -= 1
                if child.count <= 0:
                    del node.kids[t]
                    break
                node = child

    # ---------------------------------------------------------------- reading

    @property
    def num_nodes(self) -> int:
        return len(self.dump())

    def count(self, ngram: Sequence[int]) -> int:
        node = self._find([int(t) for t in ngram])
        return 0 if node is None else node.count

    def dump(self) -> list[tuple[tuple[int, ...], int]]:
        out, stack = [], [((), self.root)]
        while stack:
            path, node = stack.pop()
            for t, child in node.kids.items():
                gram = (*path, t)
                out.append((gram, child.count))
                stack.append((gram, child))
        return out

    def _tail(self, context: Sequence[int]) -> list[int]:
        return [int(t) for t in context][max(len(context) - self.depth + 1, 0):]

    def _find(self, gram: Sequence[int]) -> _Node | None:
        node = self.root
        for t in gram:
            node = node.kids.get(t)
            if node is None:
                return None
        return node

    def _matches(self, tail: list[int]) -> Iterator[tuple[_Node, int]]:
        for m in range(len(tail), self.cfg.min_match_window - 1, -1):
            node = self._find(tail[len(tail) - m:])
            if node is not None and node.kids:
                yield node, m

    def _top(self, node: _Node) -> list[_Node]:
        """The top max_bfs_breadth children by count, ties to the more recent."""
        kids = list(node.kids.values())
        order = sorted(range(len(kids)), key=lambda i: (kids[i].count, i), reverse=True)
        return [kids[i] for i in order[: self.cfg.max_bfs_breadth]]

    # ---------------------------------------------------------------- drafting

    def draft_lists(
        self, context_tail: Sequence[int], num_draft_tokens: int | None = None, *,
        key: Hashable | None = None, confident_only: bool = False,
    ) -> tuple[list[int], list[int]]:
        budget = self.cfg.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        tail = self._tail(context_tail)
        tokens, parents = [tail[-1]], [-1]
        self.last_match_len = 0
        matches = list(self._matches(tail)) if budget > 1 else []
        if not matches:
            return tokens, parents
        m = self.last_match_len = matches[0][1]
        if confident_only and m < CONFIDENT_MATCH:
            return tokens, parents
        if self.cfg.size_by_match:
            budget = tree_size_for_match(m, self.cfg.num_draft_tokens, budget)
        build = self._build_bfs if self.cfg.match_type == "BFS" else self._build_prob
        build(matches, tokens, parents, budget)
        return tokens, parents

    @staticmethod
    def _add(tree_kids: list[dict[int, int]], tokens: list[int], parents: list[int],
             parent: int, t: int) -> int:
        """The tree node for token `t` under `parent`, added if new."""
        pos = tree_kids[parent].get(t)
        if pos is None:
            pos = tree_kids[parent][t] = len(tokens)
            tokens.append(t)
            parents.append(parent)
            tree_kids.append({})
        return pos

    def _build_bfs(self, matches, tokens: list[int], parents: list[int], budget: int) -> None:
        """At tree level l below a match of length m: the breadth[m + l - 2] most recent
        children; every match, longest first, merges into the one tree."""
        tree_kids: list[dict[int, int]] = [{}]
        for anchor, m in matches:
            queue = deque([(0, anchor, m - 1)])
            while queue:
                idx, node, bi = queue.popleft()
                if not node.kids:
                    continue
                for child in list(reversed(node.kids.values()))[: self.breadth[bi]]:
                    pos = self._add(tree_kids, tokens, parents, idx, child.token)
                    if len(tokens) >= budget:
                        return
                    queue.append((pos, child, bi + 1))

    def _build_prob(self, matches, tokens: list[int], parents: list[int], budget: int) -> None:
        """Best P(path) first, P = product of count / sibling total over each node's top
        children; one heap across the matches, longest first."""
        tree_kids: list[dict[int, int]] = [{}]
        heap: list[tuple[float, int, int, _Node]] = []  # (-p, seq, tree parent, trie node)
        seq = 0
        for anchor, _ in matches:
            idx, node, prob = 0, anchor, 1.0
            while True:
                if node.kids:
                    scale = prob / node.total()
                    for child in self._top(node):
                        heapq.heappush(heap, (-(child.count * scale), seq, idx, child))
                        seq += 1
                if not heap:
                    break
                negp, _, parent, node = heapq.heappop(heap)
                idx = self._add(tree_kids, tokens, parents, parent, node.token)
                if len(tokens) >= budget:
                    return
                prob = -negp

    def draft_scored(
        self, context_tail: Sequence[int], max_nodes: int, *, spec_factor: float,
        spec_offset: float, min_prob: float, key: Hashable | None = None,
    ) -> tuple[list[int], list[int], list[float], float, int]:
        tail = self._tail(context_tail)
        best = ([tail[-1]], [-1], [1.0], 0.0, 0)
        self.last_match_len = 0
        if max_nodes <= 1:
            return best

        def expand(node: _Node) -> tuple[int, list[tuple[int, int, _Node]]]:
            total = node.total()
            if total <= 0:
                return 0, []
            return total, [(c.token, c.count, c) for c in self._top(node)]

        for node, m in self._matches(tail):
            self.last_match_len = self.last_match_len or m
            limit = min(max_nodes - 1, int(spec_factor * m + spec_offset + 1e-9))
            if limit <= best[3]:
                continue
            t, p, q, score = grow_best_first(tail[-1], node, expand, limit, min_prob)
            if score > best[3]:
                best = (t, p, q, score, m)
        return best
