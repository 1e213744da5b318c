"""The NGRAM drafter's memory: one token trie of n-grams shared by every request of a server.

Every n-gram (t_s .. t_e) of length <= max_trie_depth (D) that occurred is a path from the root;
a node's count is how many times its n-gram occurred. To draft after a context, take the nodes
of the context's suffixes (longest first) and read their subtrees: a node's children are the
tokens that followed that suffix, ordered by recency or ranked by count. A match of m tokens
can only continue D - m tokens deep, so drafts reach at most D - 1 tokens past the root.

Costs, all independent of the context length (this runs between forwards, on the CPU):
    insert(tokens)   O(len(tokens) * D)
    extend(...)      O(len(new) * D): per request we keep the nodes of its context's last D-1
                     suffixes ("anchors"); each new token adds one child under each anchor, and
                     those children are the next anchors. A missing request state costs one
                     O(D^2) lookup of the anchors.
    draft(...)       O(D^2) dict lookups to match suffixes (O(D) with `key` after `extend`),
                     plus O(num_draft_tokens * max_bfs_breadth) to build the tree.
No operation has an O(trie size) step hidden in it (no hash-table rebuild of the whole trie, no
per-node Python objects for the garbage collector to walk), so the tail latency stays flat.

Recency ("touch"): a node is touched when an occurrence ends at it (it moves to the end of its
parent's children and of the global LRU) and when one of its children is counted (LRU only).
Siblings have equal depth, so their order is the order of their last occurrences; it is the
same whether a sequence is fed at once (`insert`) or token by token (`extend`).

Eviction keeps num_nodes <= capacity by removing the least recently touched LEAF, so every
surviving node still has its whole path. The global LRU holds every leaf; a non-leaf popped from
its front leaves the queue ("parked") until it is touched again or its last child is evicted, at
which point it is older than everything queued and goes back to the front. Amortised O(1).

Memory: about 100 bytes per node (measured), so the default 1M nodes is ~100 MB; SGLang's C++
trie defaults to 10M nodes. Not thread-safe: the model runner calls it from one thread.

Two implementations of one trie: `NgramCache` below (Python, the reference) and
`NativeNgramCache` (the same operations in C++, `kernels/cpu/csrc/ngram_trie.cpp`);
`new_ngram_cache` gives the native one where the CPU extension loads.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import os
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from speculative.tree import DraftTree

logger = logging.getLogger(__name__)

MATCH_TYPES = ("BFS", "PROB")
_ROOT = 0
_MISSING = -1  # recorded version of an anchor whose n-gram is not in the trie (never matches)


def grow_best_first(
    root: int,
    start: object,
    expand: Callable[[object], tuple[int, list[tuple[int, int, object]]]],
    limit: int,
    min_prob: float,
) -> tuple[list[int], list[int], list[float], float]:
    """Suffix decoding's best-first tree below one matched suffix: (tokens, parents, probs,
    score), at most `limit` drafts under `root`, nodes in best-first order (parents first).

    `expand(handle)` gives a node's continuations as (total, [(token, count, child handle),
    ...]): total counts every occurrence that continued, so a child's probability is its
    parent's times count / total; children below `min_prob` are pruned, and count ties go to
    the child listed first. The score is the sum of the drafts' probabilities (the expected
    number accepted). Shared by the counted trie (`NgramCache.draft_scored`) and the
    positional index of one request's own context (`ngram_context.ContextIndex`)."""
    heappush, heappop = heapq.heappush, heapq.heappop
    tokens, parents, probs, score = [root], [-1], [1.0], 0.0
    heap: list[tuple[float, int, int, int, object]] = []  # (-p, seq, parent, token, handle)
    seq, idx, handle, prob = 0, 0, start, 1.0
    while True:
        total, kids = expand(handle)
        if total > 0:
            scale = prob / total
            for t, c, child in kids:
                p = c * scale
                if p >= min_prob:
                    heappush(heap, (-p, seq, idx, t, child))
                    seq += 1
        if not heap or len(tokens) > limit:
            break
        negp, _, parent, t, handle = heappop(heap)
        idx = len(tokens)
        tokens.append(t)
        parents.append(parent)
        prob = -negp
        probs.append(prob)
        score += prob
        if len(tokens) > limit:
            break
    return tokens, parents, probs, score


@dataclass(frozen=True)
class NgramConfig:
    """Trie and drafting parameters (names follow SGLang's --speculative-ngram-* flags).

    capacity:             most trie nodes (root excluded); LRU leaves are evicted beyond.
                          ~100 bytes per node: the 1M default is ~100 MB (SGLang's C++ trie
                          defaults to 10M nodes; ours stays in the model-runner's heap).
    max_trie_depth:       D, the longest n-gram stored; suffixes of up to D-1 tokens are matched
                          (a D-token match has no stored continuation).
    min_match_window:     shortest suffix that counts as a match.
    max/min_bfs_breadth:  children taken per tree node, decaying with match length + depth.
    match_type:           "BFS" (most recent continuations) | "PROB" (most frequent).
    num_draft_tokens:     default tree size, root included.
    size_by_match:        size each tree by its longest match (`tree_size_for_match`) within
                          the budget, instead of filling the budget whenever anything matches.
    max_tracked_requests: per-request anchor states kept for `extend` (LRU beyond; a dropped
                          state only costs one O(D^2) rebuild).
    """

    capacity: int = 1_000_000
    max_trie_depth: int = 18
    min_match_window: int = 1
    max_bfs_breadth: int = 10
    min_bfs_breadth: int = 1
    match_type: str = "BFS"
    num_draft_tokens: int = 8
    size_by_match: bool = True
    max_tracked_requests: int = 4096

    def __post_init__(self) -> None:
        d = self.max_trie_depth
        if d < 2:
            raise ValueError(f"max_trie_depth must be >= 2, got {d}")
        # One extend step works on at most D(D+1)/2 nodes (anchors, their paths, new children);
        # a larger trie always has an unrelated leaf that is older, so eviction never removes
        # a node the step is working on.
        if self.capacity < d * d:
            raise ValueError(f"capacity must be >= max_trie_depth^2 = {d * d}, got {self.capacity}")
        if not 1 <= self.min_match_window < d:
            raise ValueError(
                f"min_match_window must be in [1, max_trie_depth), got {self.min_match_window}"
            )
        if not 1 <= self.min_bfs_breadth <= self.max_bfs_breadth:
            raise ValueError(
                "need 1 <= min_bfs_breadth <= max_bfs_breadth, got "
                f"{self.min_bfs_breadth}, {self.max_bfs_breadth}"
            )
        if self.match_type not in MATCH_TYPES:
            raise ValueError(f"match_type must be one of {MATCH_TYPES}, got {self.match_type!r}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens counts the root, >= 1, got {self.num_draft_tokens}")
        if self.max_tracked_requests < 1:
            raise ValueError(f"max_tracked_requests must be >= 1, got {self.max_tracked_requests}")


# A context suffix of at least this many tokens matched is a confident match: drafts from it
# are accepted most of the time (on the train split, 3-token matches got >= 1 draft accepted
# 81% of the time against 49% for 1-token matches: `python -m benchmark.replay_ngram ...
# --by-match`), so a backed-off request
# still drafts on one.
CONFIDENT_MATCH = 3


def tree_size_for_match(m: int, base: int, budget: int) -> int:
    """Tree nodes (root included) for a draft whose longest context match is `m` tokens.

    On the CPU a verify node costs ~1 ms, ~5% of a decode step (past a few rows the matmuls
    are compute-bound), so nodes go where they are likely to be accepted: half the base size
    for a 1-token match, three quarters for 2, halfway from base to the budget for 3, the
    whole budget (deep drafts included) for longer matches."""
    if m <= 0 or budget <= 1:
        return 1
    if m == 1:
        n = max(2, base // 2)
    elif m == 2:
        n = max(2, 3 * base // 4)
    elif m == CONFIDENT_MATCH:
        n = (base + max(base, budget)) // 2
    else:
        n = budget
    return min(n, budget)


@dataclass(slots=True)
class _ReqState:
    tail: list[int]  # the context's last <= D-1 tokens
    anchors: list[int]  # anchors[k] = node id of tail[-k:]; anchors[0] = the root
    versions: list[int]  # node version when recorded; _MISSING: tail[-k:] was not in the trie


class _CacheCommon:
    """What both implementations share: corpus loading (through their `insert`) and `draft`
    on top of their `draft_lists`."""

    cfg: NgramConfig

    def draft(
        self,
        context_tail: Sequence[int],
        num_draft_tokens: int | None = None,
        *,
        key: Hashable | None = None,
        backed_off: bool = False,
    ) -> DraftTree:
        """A draft tree of at most `num_draft_tokens` nodes rooted at context_tail[-1].

        Reads only the last D-1 tokens. Suffixes are matched longest first (down to
        min_match_window) and their continuations merged into one tree until it is full; no
        match gives the root-only tree. With `size_by_match` the tree is sized by the longest
        match (`tree_size_for_match`), and `backed_off` drafts only on a confident match. With
        the `key` of the request's last `extend` over the same context, the suffix nodes are
        reused instead of looked up.
        """
        tokens, parents = self.draft_lists(context_tail, num_draft_tokens, key=key,
                                           backed_off=backed_off)
        return DraftTree.from_parents(tokens, parents)

    def load_corpus(
        self, path: str | Path, tokenize: Callable[[str], Sequence[int]] | None = None
    ) -> int:
        """Preload documents; returns the number of tokens inserted.

        `.jsonl`: one record per line, {"tokens": [...]}, {"text": "..."} or a bare JSON string.
        Any other file: plain text, one document per blank-line-separated paragraph. Text needs
        `tokenize` (text -> token ids). Each document is inserted on its own (no n-gram spans
        two documents).
        """
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"n-gram corpus not found: {path}")

        def encode(text: str, where: str) -> Sequence[int]:
            if tokenize is None:
                raise ValueError(f"{where}: text needs a tokenizer (pass tokenize=...)")
            return tokenize(text)

        total = 0
        with path.open(encoding="utf-8") as f:
            if path.suffix == ".jsonl":
                for line_no, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    where = f"{path}:{line_no}"
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{where}: invalid JSON: {e.msg}") from e
                    if isinstance(rec, str):
                        ids = encode(rec, where)
                    elif isinstance(rec, dict) and "tokens" in rec:
                        ids = rec["tokens"]
                    elif isinstance(rec, dict) and "text" in rec:
                        ids = encode(rec["text"], where)
                    else:
                        want = '{"tokens": [...]}, {"text": ...} or a JSON string'
                        raise ValueError(f"{where}: expected {want}")
                    self.insert(ids)
                    total += len(ids)
            else:
                for para in f.read().split("\n\n"):
                    if para.strip():
                        ids = encode(para, str(path))
                        self.insert(ids)
                        total += len(ids)
        return total


def _breadths(cfg: NgramConfig) -> list[int]:
    """Breadth for (match length m, tree level l), indexed by m + l - 2 in [0, D-2]: the
    linear decay SGLang uses, spanning exactly max_bfs_breadth (m = l = 1) down to
    min_bfs_breadth (m + l = D, the deepest continuation the trie holds)."""
    depth = cfg.max_trie_depth
    span = max(depth - 2, 1)
    lo, delta = cfg.min_bfs_breadth, cfg.max_bfs_breadth - cfg.min_bfs_breadth
    return [lo + delta * max(span - i, 0) // span for i in range(depth)]


class NgramCache(_CacheCommon):
    """A capacity-bounded n-gram trie with LRU leaf eviction, and tree drafting from it.

    The reference implementation, in Python; `NativeNgramCache` is the same trie in C++ (what
    `new_ngram_cache` gives when the CPU extension loads).

    Nodes are integer ids into parallel lists (id 0 = root; evicted ids are reused, and a
    version bump tells stale references apart):
        _tok[n]    last token of the n-gram          _par[n]   parent id (-1: root / free)
        _cnt[n]    occurrences counted               _tot[n]   sum of the children's _cnt
        _kids[n]   None (leaf) | a child id (one child) | {token: child id} (>= 2 children,
                   insertion order = recency, the last touched last; not kept for the root,
                   whose children are never drafted from)
        _prev[n], _next[n]  the global LRU, a doubly linked list through the ids with the root
                   as its sentinel (_next[0] = least recently touched, _prev[0] = most);
                   _prev[n] = -1 iff n is not queued (parked or free). Every leaf is queued.
        _tops[n]   PROB's top-k children by (count, recency), exact once computed (an
                   array, which the garbage collector does not track)
    Ids, ints and dicts of ints keep the garbage collector out: a trie of millions of nodes
    adds no tracked objects per node, so no collection pauses the model runner for long.
    """

    def __init__(self, cfg: NgramConfig) -> None:
        self.cfg = cfg
        self._depth = cfg.max_trie_depth
        self._tok: list[int] = [-1]
        self._par: list[int] = [-1]
        self._cnt: list[int] = [0]
        self._tot: list[int] = [0]
        self._kids: list[int | dict[int, int] | None] = [None]
        self._ver: list[int] = [0]
        self._prev: list[int] = [0]
        self._next: list[int] = [0]
        self._free: list[int] = []
        self._tops: dict[int, array[int]] = {}
        self._num_nodes = 0
        self._states: OrderedDict[Hashable, _ReqState] = OrderedDict()
        self.last_match_len = 0  # m of the last draft (0: no match), for replay statistics
        self._breadth = _breadths(cfg)

    @property
    def num_nodes(self) -> int:
        """Trie nodes excluding the root; always <= cfg.capacity."""
        return self._num_nodes

    def count(self, ngram: Sequence[int]) -> int:
        """How many times `ngram` was counted (0 if it is not in the trie)."""
        node = self._walk([int(t) for t in ngram], 0)
        return 0 if node < 0 else self._cnt[node]

    # ---------------------------------------------------------------- insertion

    def insert(self, tokens: Sequence[int]) -> None:
        """Count every n-gram (length <= D) of `tokens`, e.g. a prompt. O(len * D)."""
        self._feed([_ROOT], [0], [], [int(t) for t in tokens])

    def extend(self, key: Hashable, context_tail: Sequence[int], new_tokens: Sequence[int]) -> None:
        """Count the n-grams that END in `new_tokens`, which follow `context_tail`.

        Only the last D-1 tokens of `context_tail` are read. Feeding a sequence in pieces this
        way yields exactly the counts and recency orders of one `insert` of the whole sequence
        (as long as nothing was evicted meanwhile). The request's anchors are kept under `key`
        so the next call costs O(len(new_tokens) * D); call `release(key)` when it finishes.
        """
        tail = self._tail(context_tail)
        st = self._states.get(key)
        if st is not None and st.tail == tail:
            anchors, versions = st.anchors, st.versions
        else:
            anchors, versions = self._lookup_anchors(tail)
        anchors, versions = self._feed(anchors, versions, tail, [int(t) for t in new_tokens])
        if st is None:
            self._states[key] = _ReqState(tail, anchors, versions)
            if len(self._states) > self.cfg.max_tracked_requests:
                self._states.popitem(last=False)
        else:
            st.tail, st.anchors, st.versions = tail, anchors, versions
            self._states.move_to_end(key)

    def release(self, key: Hashable) -> None:
        """Forget a finished request's anchors (its n-grams stay in the trie)."""
        self._states.pop(key, None)

    def remove(self, tokens: Sequence[int]) -> None:
        """Uncount every n-gram (length <= D) of `tokens`, as one `insert` of them counted it: a
        node whose count reaches 0 leaves the trie with its subtree; n-grams evicted meanwhile
        are skipped. O(len * D). (How a bounded cache forgets one old request's output.)"""
        toks = [int(t) for t in tokens]
        cnt, tot, tops, depth = self._cnt, self._tot, self._tops, self._depth
        for s in range(len(toks)):
            node = _ROOT
            for i in range(s, min(s + depth, len(toks))):
                child = self._child(node, toks[i])
                if child < 0:
                    break
                tot[node] -= 1
                cnt[child] -= 1
                tops.pop(node, None)  # counts fell: recomputed when next drafted from
                if cnt[child] <= 0:
                    self._drop_subtree(child)
                    break
                node = child

    def _tail(self, context: Sequence[int]) -> list[int]:
        n = len(context)
        return [int(context[i]) for i in range(max(n - self._depth + 1, 0), n)]

    def _lookup_anchors(self, tail: list[int]) -> tuple[list[int], list[int]]:
        """Anchors of `tail` by lookup only (no counting, no touching). O(D^2)."""
        anchors, versions = [_ROOT], [0]
        for k in range(1, len(tail) + 1):
            node = self._walk(tail, len(tail) - k)
            anchors.append(max(node, _ROOT))
            versions.append(self._ver[node] if node >= 0 else _MISSING)
        return anchors, versions

    def _walk(self, tail: list[int], start: int) -> int:
        """Node id of tail[start:], -1 if it is not in the trie."""
        kids, tok = self._kids, self._tok
        node = _ROOT
        for i in range(start, len(tail)):
            ch = kids[node]
            if ch is None:
                return -1
            t = tail[i]
            if type(ch) is dict:
                node = ch.get(t, -1)
                if node < 0:
                    return -1
            elif tok[ch] == t:
                node = ch
            else:
                return -1
        return node

    def _feed(
        self, anchors: list[int], versions: list[int], tail: list[int], tokens: list[int]
    ) -> tuple[list[int], list[int]]:
        """Count the n-grams ending at each of `tokens`; `tail` (updated in place) precedes them.

        Invariant in and out: len(anchors) == len(tail) + 1 <= D and anchors[k] ~ tail[-k:]
        wherever versions[k] still equals the node's version.
        """
        depth, tops = self._depth, self._tops
        tok, cnt, tot, kids, ver = self._tok, self._cnt, self._tot, self._kids, self._ver
        prv, nxt = self._prev, self._next
        for t in tokens:
            new, new_versions = [_ROOT], [0]
            for k in range(len(anchors)):
                a = anchors[k]
                if ver[a] != versions[k]:
                    a = self._materialize(tail, k)  # missing, or evicted since recorded
                elif a and nxt[a] != _ROOT:
                    # Touch the extension point (inlined _touch): the path stays recent and
                    # `a` cannot be the eviction victim while we add its child.
                    p = prv[a]
                    if p >= 0:
                        q = nxt[a]
                        nxt[p] = q
                        prv[q] = p
                    p = prv[_ROOT]
                    nxt[p] = a
                    prv[a] = p
                    nxt[a] = _ROOT
                    prv[_ROOT] = a
                ch = kids[a]
                if ch is None:
                    n = -1
                elif type(ch) is dict:
                    n = ch.get(t, -1)
                else:
                    n = ch if tok[ch] == t else -1
                if n < 0:
                    n = self._add_child(a, t)
                else:
                    cnt[n] += 1
                    if a and type(ch) is dict:  # (the root's children are never drafted from)
                        del ch[t]  # re-insert: the most recent sibling goes last
                        ch[t] = n
                    p = prv[n]  # inlined _touch(n)
                    if p >= 0:
                        q = nxt[n]
                        nxt[p] = q
                        prv[q] = p
                    p = prv[_ROOT]
                    nxt[p] = n
                    prv[n] = p
                    nxt[n] = _ROOT
                    prv[_ROOT] = n
                tot[a] += 1
                if tops:
                    top = tops.get(a)
                    if top is not None:
                        self._update_top(top, n)
                if k + 1 < depth:
                    new.append(n)
                    new_versions.append(ver[n])
            anchors, versions = new, new_versions
            tail.append(t)
            if len(tail) >= depth:
                del tail[0]
        return anchors, versions

    def _materialize(self, tail: list[int], k: int) -> int:
        """The node of tail[-k:], creating missing path nodes with count 1 (they occurred)."""
        node = _ROOT
        for i in range(len(tail) - k, len(tail)):
            nxt = self._child(node, tail[i])
            if nxt < 0:
                nxt = self._add_child(node, tail[i])
                self._tot[node] += 1
                top = self._tops.get(node)
                if top is not None:
                    self._update_top(top, nxt)
            else:
                self._touch(nxt)
            node = nxt
        return node

    def _child(self, node: int, t: int) -> int:
        ch = self._kids[node]
        if ch is None:
            return -1
        if type(ch) is dict:
            return ch.get(t, -1)
        return ch if self._tok[ch] == t else -1

    def _children(self, node: int) -> list[int]:
        """Child ids, least recent first."""
        ch = self._kids[node]
        if ch is None:
            return []
        return list(ch.values()) if type(ch) is dict else [ch]

    def _add_child(self, parent: int, t: int) -> int:
        """A new leaf (count 1) as `parent`'s most recent child; evicts first when full.
        The caller updates the parent's _tot and top list."""
        if self._num_nodes >= self.cfg.capacity:
            self._evict_one()
        if self._free:
            n = self._free.pop()
            self._tok[n], self._par[n], self._cnt[n], self._tot[n] = t, parent, 1, 0
        else:
            n = len(self._tok)
            self._tok.append(t)
            self._par.append(parent)
            self._cnt.append(1)
            self._tot.append(0)
            self._kids.append(None)
            self._ver.append(0)
            self._prev.append(-1)
            self._next.append(-1)
        ch = self._kids[parent]  # read after the eviction, which may have changed it
        if ch is None:
            self._kids[parent] = n
        elif type(ch) is dict:
            ch[t] = n
        else:
            self._kids[parent] = {self._tok[ch]: ch, t: n}
        self._touch(n)
        self._num_nodes += 1
        return n

    def _touch(self, n: int) -> None:
        """Move (or add) `n` to the most recent end of the LRU."""
        prv, nxt = self._prev, self._next
        p = prv[n]
        if p >= 0:
            q = nxt[n]
            nxt[p] = q
            prv[q] = p
        p = prv[_ROOT]
        nxt[p] = n
        prv[n] = p
        nxt[n] = _ROOT
        prv[_ROOT] = n

    def _update_top(self, top: array[int], node: int) -> None:
        """`node` was just counted and is its parent's most recent child: its (count, recency)
        key rose, no other sibling's changed, so the exact top-k changes by at most one swap."""
        cnt = self._cnt
        c = cnt[node]
        if node in top:
            i = top.index(node)
        elif len(top) < self.cfg.max_bfs_breadth:  # a short list holds every child
            top.append(node)
            i = len(top) - 1
        elif c >= cnt[top[-1]]:  # ties go to the more recent: node
            top[-1] = node
            i = len(top) - 1
        else:
            return
        while i > 0 and cnt[top[i - 1]] <= c:
            top[i - 1], top[i] = top[i], top[i - 1]
            i -= 1

    def _evict_one(self) -> None:
        """Remove the least recently touched leaf (see the module docstring)."""
        kids, tops, prv, nxt = self._kids, self._tops, self._prev, self._next
        while True:
            n = nxt[_ROOT]
            assert n != _ROOT, "the LRU is empty but the trie is full"
            q = nxt[n]
            nxt[_ROOT] = q
            prv[q] = _ROOT
            prv[n] = nxt[n] = -1  # both -1: a parked node is never taken for the last one
            if kids[n] is None:
                break
            # a parked non-leaf: out of the queue until touched or childless
        p = self._par[n]
        ch = kids[p]
        if type(ch) is dict:
            del ch[self._tok[n]]
            if len(ch) == 1:
                kids[p] = next(iter(ch.values()))
        else:
            assert ch == n, "the LRU victim must be its parent's child"
            kids[p] = None
        self._tot[p] -= self._cnt[n]
        top = tops.get(p)
        if top is not None and n in top:
            if len(top) < self.cfg.max_bfs_breadth:
                top.remove(n)  # still holds every remaining child
            else:
                del tops[p]
        tops.pop(n, None)
        self._ver[n] += 1
        self._par[n] = -1
        self._free.append(n)
        self._num_nodes -= 1
        if kids[p] is None and p != _ROOT and prv[p] < 0:
            # parked at the front earlier, not touched since: older than everything queued
            q = nxt[_ROOT]
            nxt[_ROOT] = p
            prv[p] = _ROOT
            nxt[p] = q
            prv[q] = p

    def _drop_subtree(self, n: int) -> None:
        """Remove node `n` and everything below it (any LRU position, parked or queued)."""
        kids, tops, prv, nxt = self._kids, self._tops, self._prev, self._next
        p = self._par[n]
        ch = kids[p]
        if type(ch) is dict:
            del ch[self._tok[n]]
            if len(ch) == 1:
                kids[p] = next(iter(ch.values()))
        else:
            kids[p] = None
        self._tot[p] -= max(self._cnt[n], 0)
        tops.pop(p, None)
        stack = [n]
        while stack:
            m = stack.pop()
            stack.extend(self._children(m))
            if prv[m] >= 0:  # queued: unlink
                a, b = prv[m], nxt[m]
                nxt[a] = b
                prv[b] = a
            prv[m] = nxt[m] = -1
            kids[m] = None
            tops.pop(m, None)
            self._ver[m] += 1
            self._par[m] = -1
            self._cnt[m] = self._tot[m] = 0
            self._free.append(m)
            self._num_nodes -= 1
        if kids[p] is None and p != _ROOT and prv[p] < 0:
            q = nxt[_ROOT]  # a parked node that became a leaf: oldest of all, as in eviction
            nxt[_ROOT] = p
            prv[p] = _ROOT
            nxt[p] = q
            prv[q] = p

    # ---------------------------------------------------------------- drafting

    def draft_scored(
        self,
        context_tail: Sequence[int],
        max_nodes: int,
        *,
        spec_factor: float,
        spec_offset: float,
        min_prob: float,
        key: Hashable | None = None,
    ) -> tuple[list[int], list[int], list[float], float, int]:
        """Suffix decoding's tree: (tokens, parents, probs, score, match length); nodes in
        best-first order (probs non-increasing after the root's 1.0, parents first).

        For every matched suffix of the context (length m, longest first) a best-first tree
        grows below its node: a continuation's probability is the product of count / parent's
        child total along its path, nodes below `min_prob` are pruned, and the tree holds at
        most min(max_nodes - 1, spec_factor * m + spec_offset) drafts. Its score is the sum
        of its nodes' probabilities (the expected number of accepted drafts); the best-scoring
        tree wins. A match whose size limit cannot beat the best score so far is skipped, so
        short matches cost nothing once a long one scored. Children are read from each node's
        top `max_bfs_breadth` by count (all of them that can pass min_prob >= 1/breadth)."""
        tail = self._tail(context_tail)
        assert tail, "drafting needs at least one context token (the root)"
        best: tuple[list[int], list[int], list[float], float, int] = (
            [tail[-1]], [-1], [1.0], 0.0, 0)
        self.last_match_len = 0
        if max_nodes <= 1:
            return best
        cnt, tot, tok, kids = self._cnt, self._tot, self._tok, self._kids
        top_children = self._top_children

        def expand(tn: int) -> tuple[int, list[tuple[int, int, int]]]:
            if kids[tn] is None or tot[tn] <= 0:
                return 0, []
            return tot[tn], [(tok[c], cnt[c], c) for c in top_children(tn)]

        for node, m in self._matches(tail, key):
            if not self.last_match_len:
                self.last_match_len = m
            limit = min(max_nodes - 1, int(spec_factor * m + spec_offset + 1e-9))
            if limit <= best[3]:
                continue
            tokens, parents, probs, score = grow_best_first(tail[-1], node, expand, limit,
                                                            min_prob)
            if score > best[3]:
                best = (tokens, parents, probs, score, m)
        return best


    def draft_lists(
        self,
        context_tail: Sequence[int],
        num_draft_tokens: int | None = None,
        *,
        key: Hashable | None = None,
        backed_off: bool = False,
    ) -> tuple[list[int], list[int]]:
        """`draft` as plain (tokens, parents) lists, parents[i] < i, parents[0] = -1."""
        budget = self.cfg.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        assert budget >= 1, f"num_draft_tokens counts the root, >= 1, got {budget}"
        tail = self._tail(context_tail)
        assert tail, "drafting needs at least one context token (the root)"
        tokens, parents = [tail[-1]], [-1]
        self.last_match_len = 0
        if budget <= 1:
            return tokens, parents
        matches = self._matches(tail, key)
        first = next(matches, None)
        if first is None:
            return tokens, parents
        self.last_match_len = m = first[1]
        if backed_off and m < CONFIDENT_MATCH:
            return tokens, parents
        if self.cfg.size_by_match:
            budget = tree_size_for_match(m, self.cfg.num_draft_tokens, budget)
        build = self._build_bfs if self.cfg.match_type == "BFS" else self._build_prob
        build(itertools.chain((first,), matches), tokens, parents, budget)
        return tokens, parents

    def _matches(self, tail: list[int], key: Hashable | None) -> Iterator[tuple[int, int]]:
        """(node of tail[-m:], m) for m from longest down to min_match_window, nodes with
        children only. Lazy: the builders stop pulling once the tree is full."""
        st = self._states.get(key) if key is not None else None
        known = st is not None and st.tail == tail
        n, kids, ver = len(tail), self._kids, self._ver
        for m in range(n, self.cfg.min_match_window - 1, -1):
            if known and ver[st.anchors[m]] == st.versions[m]:
                node = st.anchors[m]
            else:
                node = self._walk(tail, n - m)
            if node >= 0 and kids[node] is not None:
                yield node, m

    def _build_bfs(
        self, matches: Iterator[tuple[int, int]], tokens: list[int], parents: list[int],
        budget: int,
    ) -> None:
        """Recency BFS: at tree level l below a match of length m, take the
        breadth[m + l - 2] most recent children; later matches merge into the same tree."""
        kids, tok, breadth = self._kids, self._tok, self._breadth
        tree_kids: list[dict[int, int]] = [{}]  # tree node -> {token: tree node}
        for anchor, m in matches:
            queue = deque([(0, anchor, m - 1)])  # tree node, trie node, breadth index
            while queue:
                idx, tn, bi = queue.popleft()
                ch = kids[tn]
                if ch is None:
                    continue
                b = breadth[bi]
                for child in reversed(ch.values()) if type(ch) is dict else (ch,):
                    if b == 0:
                        break
                    b -= 1
                    t = tok[child]
                    pos = tree_kids[idx].get(t)
                    if pos is None:
                        pos = len(tokens)
                        tokens.append(t)
                        parents.append(idx)
                        tree_kids.append({})
                        tree_kids[idx][t] = pos
                        if pos + 1 >= budget:
                            return
                    queue.append((pos, child, bi + 1))

    def _build_prob(
        self, matches: Iterator[tuple[int, int]], tokens: list[int], parents: list[int],
        budget: int,
    ) -> None:
        """Frequency: a max-heap on P(path) = product of count / parent's child total over the
        top max_bfs_breadth children of each expanded node; best paths join the tree first."""
        cnt, tot, tok, kids = self._cnt, self._tot, self._tok, self._kids
        tree_kids: list[dict[int, int]] = [{}]
        heap: list[tuple[float, int, int, int]] = []  # (-prob, seq, tree parent, trie node)
        seq = 0
        for anchor, _ in matches:
            idx, tn, prob = 0, anchor, 1.0
            while True:
                if kids[tn] is not None:
                    scale = prob / tot[tn]
                    for child in self._top_children(tn):
                        heapq.heappush(heap, (-cnt[child] * scale, seq, idx, child))
                        seq += 1
                if not heap:
                    break
                negp, _, parent, tn = heapq.heappop(heap)
                t = tok[tn]
                idx = tree_kids[parent].get(t)
                if idx is None:
                    idx = len(tokens)
                    tokens.append(t)
                    parents.append(parent)
                    tree_kids.append({})
                    tree_kids[parent][t] = idx
                    if idx + 1 >= budget:
                        return
                prob = -negp

    def _top_children(self, node: int) -> array[int]:
        top = self._tops.get(node)
        if top is None:
            order, cnt = self._children(node), self._cnt
            # list order is recency: the index breaks count ties toward the most recent
            best = heapq.nlargest(
                self.cfg.max_bfs_breadth, range(len(order)), key=lambda i: (cnt[order[i]], i)
            )
            top = self._tops[node] = array("q", [order[i] for i in best])
        return top

    # ---------------------------------------------------------------- checks

    def dump(self) -> list[tuple[tuple[int, ...], int]]:
        """Every stored n-gram with its count, depth first, children in recency order (for
        tests: both implementations give the same list for the same operations)."""
        out, stack = [], [((), _ROOT)]
        while stack:
            path, node = stack.pop()
            for child in self._children(node):
                gram = (*path, self._tok[child])
                out.append((gram, self._cnt[child]))
                stack.append((gram, child))
        return out

    def check_integrity(self) -> None:
        """Assert every structural invariant (O(num_nodes); for tests and debugging)."""
        cnt, prv, nxt = self._cnt, self._prev, self._next
        lru: list[int] = []  # walk the list front to back, checking the back links
        node = nxt[_ROOT]
        while node != _ROOT:
            assert prv[nxt[node]] == node, "LRU links broken"
            lru.append(node)
            assert len(lru) <= self._num_nodes, "LRU cycle or dead nodes"
            node = nxt[node]
        queued = set(lru)
        assert len(queued) == len(lru), "a node is queued twice"
        reachable: set[int] = set()
        stack = [(_ROOT, 0)]
        while stack:
            node, depth = stack.pop()
            ch = self._kids[node]
            kids = self._children(node)
            if node != _ROOT:
                reachable.add(node)
                assert 1 <= depth <= self._depth, f"node at depth {depth} > {self._depth}"
                assert cnt[node] >= 1, "a stored n-gram occurred at least once"
                assert (prv[node] >= 0) == (node in queued), "_prev disagrees with the LRU"
                assert ch is not None or node in queued, "a leaf must be in the LRU"
            assert type(ch) is not dict or len(ch) >= 2, "one child is stored inline"
            if type(ch) is dict:
                assert all(self._tok[c] == t for t, c in ch.items()), "child key != its token"
            assert self._tot[node] == sum(cnt[c] for c in kids), "child total drift"
            for c in kids:
                assert self._par[c] == node, "child's parent link broken"
                stack.append((c, depth + 1))
            top = self._tops.get(node)
            if top is not None:
                want = sorted(range(len(kids)), key=lambda i: (cnt[kids[i]], i), reverse=True)
                want = [kids[i] for i in want[: self.cfg.max_bfs_breadth]]
                assert top.tolist() == want, "stale top-k"
        n = self._num_nodes
        assert len(reachable) == n, f"num_nodes {n} but {len(reachable)} reachable"
        assert n <= self.cfg.capacity, f"{n} nodes exceed capacity {self.cfg.capacity}"
        assert reachable.isdisjoint(self._free) and len(set(self._free)) == len(self._free)
        assert len(self._free) + n + 1 == len(self._tok), "an id is neither live nor free"
        assert queued <= reachable, "dead node in the LRU"
        assert all(node in reachable for node in self._tops), "top-k of a dead node"
        assert len(self._states) <= self.cfg.max_tracked_requests, "too many request states"
        for st in self._states.values():
            assert len(st.anchors) == len(st.versions) == len(st.tail) + 1 <= self._depth
            assert st.anchors[0] == _ROOT, "anchors[0] must be the root"


class NativeNgramCache(_CacheCommon):
    """`NgramCache` in C++ (`kernels/cpu/csrc/ngram_trie.cpp`): the same trie operation for
    operation (counts, recency orders, LRU eviction, every draft identical;
    tests/unit/test_ngram_native.py replays random operations on both), at native cost. At
    c = 64 SUFFIX's global tree counted and drafted for ~2 ms of every step in Python
    (docs/benchmarks.md, "Step time outside the forward"). Request keys that are not strings
    are keyed by their repr.

    Its node arrays and child table are allocated and written for `cfg.capacity` nodes when it
    is built (`reserved_bytes`, ~90 bytes a node): its memory is its ceiling from the start
    instead of creeping up as the trie fills (docs/benchmarks.md, "Admission, soak and fuzz")."""

    def __init__(self, cfg: NgramConfig) -> None:
        from kernels import cpu

        self.cfg = cfg
        self._t = cpu.load().NgramTrie(
            cfg.capacity, cfg.max_trie_depth, cfg.min_match_window, cfg.max_bfs_breadth,
            _breadths(cfg), cfg.match_type == "PROB", cfg.num_draft_tokens, cfg.size_by_match,
            cfg.max_tracked_requests)

    @staticmethod
    def _key(key: Hashable | None) -> str | None:
        return key if key is None or type(key) is str else "\0" + repr(key)

    @property
    def num_nodes(self) -> int:
        """Trie nodes excluding the root; always <= cfg.capacity."""
        return self._t.num_nodes

    @property
    def reserved_bytes(self) -> int:
        """Bytes allocated for the nodes and the child table (all of it at construction)."""
        return self._t.reserved_bytes

    @property
    def last_match_len(self) -> int:
        """m of the last draft (0: no match)."""
        return self._t.last_match_len

    def count(self, ngram: Sequence[int]) -> int:
        return self._t.count(ngram)

    def insert(self, tokens: Sequence[int]) -> None:
        self._t.insert(tokens)

    def extend(self, key: Hashable, context_tail: Sequence[int], new_tokens: Sequence[int]) -> None:
        self._t.extend(self._key(key), context_tail, new_tokens)

    def release(self, key: Hashable) -> None:
        self._t.release(self._key(key))

    def remove(self, tokens: Sequence[int]) -> None:
        self._t.remove(tokens)

    def draft_scored(
        self, context_tail: Sequence[int], max_nodes: int, *, spec_factor: float,
        spec_offset: float, min_prob: float, key: Hashable | None = None,
    ) -> tuple[list[int], list[int], list[float], float, int]:
        return self._t.draft_scored(context_tail, max_nodes, spec_factor, spec_offset, min_prob,
                                    self._key(key))

    def draft_lists(
        self, context_tail: Sequence[int], num_draft_tokens: int | None = None, *,
        key: Hashable | None = None, backed_off: bool = False,
    ) -> tuple[list[int], list[int]]:
        return self._t.draft_lists(context_tail, num_draft_tokens, self._key(key), backed_off)

    def dump(self) -> list[tuple[tuple[int, ...], int]]:
        return [(tuple(gram), c) for gram, c in self._t.dump()]

    def check_integrity(self) -> None:
        try:
            self._t.check_integrity()
        except RuntimeError as e:  # (a C++ logic_error)
            raise AssertionError(str(e)) from None


def native_available() -> bool:
    """Whether `new_ngram_cache` gives the C++ trie here."""
    if os.environ.get("SPECSERVE_NGRAM_NATIVE", "1") == "0":
        return False
    from kernels import cpu

    return cpu.available()[0]


def new_ngram_cache(cfg: NgramConfig) -> NgramCache | NativeNgramCache:
    """The C++ trie when the CPU extension loads (it is built at set-up), else the Python one;
    SPECSERVE_NGRAM_NATIVE=0 forces Python. Both give the same drafts."""
    if not native_available():
        return NgramCache(cfg)
    cache = NativeNgramCache(cfg)
    logger.info("n-gram trie (C++): up to %s nodes, %.0f MB reserved", f"{cfg.capacity:,}",
                cache.reserved_bytes / 2**20)
    return cache
