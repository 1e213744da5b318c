"""The request's own context first: NGRAM drafts for short context matches.

The shared trie (`ngram_cache`) ranks a node's continuations by when they last occurred in *any*
request. On a long context match that is the right evidence: few places continue a long suffix,
and they agree. On a short match the suffix occurs all over the trie, and its most recent
continuations mix the request's own text with other requests'. Where the request is rewriting
or quoting its prompt, its own occurrences are the ones that continue the answer.

So for a short match (m <= OWN_CONTEXT_MAX_MATCH) the tree is built from the request's own
prompt and output first: the distinct tokens that followed the suffix there, most recent first,
as siblings, then each one's own continuation as a chain, as deep as the node budget allows.
Whatever budget is left is filled from the trie's tree (merged: a path both propose is one
path). Same node count as the trie alone, so the verify cost does not change.

Replayed on two train-split samples (`benchmark.replay_ngram ... --configs NGRAM
NGRAM:ngram_disable_own_context=true`), modelled speedup against the trie
alone: rewrite 2.840x vs 2.802x and 2.881x vs 2.865x, ShareGPT 1.498x vs 1.491x and 1.565x vs
1.564x. Small, but it never lost; own-first up to m = 2 lost on the second sample (2.856x),
so it reaches up to m = 3.

Cost per request: one int per context token (the previous occurrence of the same token) and one
dict entry per distinct token. Per step: indexing the new tokens, O(1) each, and a scan of at
most OWN_CONTEXT_SCAN earlier occurrences of the root token, so it does not grow with the
context length.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Sequence

# Matches of at most this many tokens draft from the request's own context first.
OWN_CONTEXT_MAX_MATCH = 3
# Most earlier occurrences of the root token looked at per step (most recent first).
OWN_CONTEXT_SCAN = 64
# SUFFIX's own-context trees: occurrences of the root token compared per step (most recent
# first). Larger than NGRAM's scan: every occurrence adds to the counts, not just the first
# few distinct continuations.
SUFFIX_SCAN = 256


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
    number accepted). `ContextIndex.draft_scored` grows its trees with it; the n-gram trie's
    `draft_scored` runs the same steps in C++ (specserve/kernels/cpu/csrc/ngram_trie.cpp)."""
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


class ContextIndex:
    """Where each token of one request's history occurred, as previous-occurrence links."""

    __slots__ = ("prev", "last")

    def __init__(self) -> None:
        self.prev = array("i")  # prev[i]: previous position of tokens[i], -1 if none
        self.last: dict[int, int] = {}  # token -> its most recent indexed position

    def __len__(self) -> int:
        return len(self.prev)

    def catch_up(self, tokens: Sequence[int]) -> None:
        """Index tokens[len(self):]. The history only grows; a shorter one is re-indexed."""
        if len(tokens) < len(self.prev):
            self.prev = array("i")
            self.last.clear()
        prev, last = self.prev, self.last
        for i in range(len(prev), len(tokens)):
            t = tokens[i]
            prev.append(last.get(t, -1))
            last[t] = i

    def continuations(self, tokens: Sequence[int], m: int, want: int,
                      scan: int = OWN_CONTEXT_SCAN) -> list[int]:
        """Start positions s (most recent first) of up to `want` distinct next tokens tokens[s]
        after earlier occurrences of the last `m` tokens. Needs `catch_up(tokens)` first."""
        n = len(tokens)
        assert len(self.prev) == n, "index out of date: call catch_up first"
        starts: list[int] = []
        if n < 2 or m < 1 or want < 1:
            return starts
        seen: set[int] = set()
        suffix = tokens[n - m : n]
        j = self.prev[n - 1]  # earlier occurrences of the root token
        while j >= 0 and scan > 0 and len(starts) < want:
            scan -= 1
            if j >= m - 1 and tokens[j - m + 1 : j + 1] == suffix:
                t = tokens[j + 1]
                if t not in seen:
                    seen.add(t)
                    starts.append(j + 1)
            j = self.prev[j]
        return starts

    def draft_scored(
        self,
        tokens: Sequence[int],
        max_nodes: int,
        *,
        spec_factor: float,
        spec_offset: float,
        min_prob: float,
        max_depth: int,
        scan: int = SUFFIX_SCAN,
    ) -> tuple[list[int], list[int], list[float], float, int]:
        """Suffix decoding's tree from this request's own history, as
        `NgramCache.draft_scored` draws it from a trie of depth `max_depth` holding the same
        tokens: (tokens, parents, probs, score, match length), the best-scoring tree over the
        matched suffix lengths m <= max_depth - 1, each at most min(max_nodes - 1,
        spec_factor * m + spec_offset) drafts, reaching max_depth - m tokens past the root.

        No trie: the up to `scan` most recent earlier occurrences of the root token are
        compared backwards with the context (the match length of each), and a suffix of
        length m continues wherever an occurrence matched >= m tokens; a tree node's
        continuations are the next tokens at its occurrences. So a 10k-token prompt costs one
        int per token to index, not the trie's ~D nodes per token, and a step costs
        O(scan * match length + tree), flat in the context length. With `scan` covering
        every occurrence the trees equal the trie's (test); past it, older occurrences are
        not counted."""
        n = len(tokens)
        assert len(self.prev) == n, "index out of date: call catch_up first"
        best: tuple[list[int], list[int], list[float], float, int] = (
            [tokens[-1]] if n else [], [-1], [1.0], 0.0, 0)
        if n < 2 or max_nodes <= 1:
            return best
        cap = max_depth - 1
        prev, last = self.prev, n - 1
        found: list[tuple[int, int]] = []  # (match length, start of the continuation)
        j = prev[last]
        while j >= 0 and scan > 0:
            scan -= 1
            m = 1
            while m < cap and m <= j and tokens[j - m] == tokens[last - m]:
                m += 1
            found.append((m, j + 1))
            j = prev[j]
        if not found:
            return best

        capped = False  # whether the last tree grown had a node the depth bound stopped

        def expand(node: tuple[list[int], int]) -> tuple[int, list[tuple[int, int, object]]]:
            nonlocal capped
            starts, d = node  # occurrences' continuation starts, d tokens already drafted
            if d >= depth_left:
                capped = capped or any(s + d < n for s in starts)
                return 0, []
            groups: dict[int, list[int]] = {}
            for s in starts:
                if s + d < n:
                    groups.setdefault(tokens[s + d], []).append(s)
            if not groups:
                return 0, []
            total = sum(len(g) for g in groups.values())
            return total, [(t, len(g), (g, d + 1)) for t, g in groups.items()]

        found.sort(key=lambda f: -f[0])  # longest first
        starts: list[int] = []
        i, grown = 0, -1
        for m in range(found[0][0], 0, -1):  # as the trie: every suffix length that occurs
            while i < len(found) and found[i][0] >= m:
                starts.append(found[i][1])
                i += 1
            limit = min(max_nodes - 1, int(spec_factor * m + spec_offset + 1e-9))
            if limit <= best[3]:
                continue
            if len(starts) == grown and not capped:
                # the same occurrences as the tree just grown, a limit no larger, and no
                # node that the depth bound stopped: its tree would be a prefix of that one
                continue
            depth_left = max_depth - m  # the trie's n-grams end at depth max_depth
            ordered = sorted(starts, reverse=True)  # most recent first: count ties to recency
            capped, grown = False, len(starts)
            t, p, q, score = grow_best_first(tokens[-1], (ordered, 0), expand, limit, min_prob)
            if score > best[3]:
                best = (t, p, q, score, m)
        return best


def own_context_tree(
    tokens: Sequence[int],
    starts: list[int],
    budget: int,
    fill_tokens: Sequence[int] = (),
    fill_parents: Sequence[int] = (),
) -> tuple[list[int], list[int]]:
    """A tree of at most `budget` nodes rooted at tokens[-1]: tokens[s] for each start s as
    siblings, then each start's continuation tokens[s+1], tokens[s+2], ... as a chain under it
    (in order, while the budget lasts), then the nodes of another tree (`fill_*`, parents
    before children, same root) merged in: as (tokens, parents) lists, parents[i] < i."""
    out_t, out_p = [tokens[-1]], [-1]
    kids: list[dict[int, int]] = [{}]

    def add(parent: int, t: int) -> int:
        node = kids[parent].get(t, -1)
        if node < 0 and len(out_t) < budget:
            node = len(out_t)
            out_t.append(t)
            out_p.append(parent)
            kids.append({})
            kids[parent][t] = node
        return node

    n = len(tokens)
    for s in starts:
        add(0, tokens[s])
    for s in starts:
        node, k = kids[0].get(tokens[s], -1), s + 1
        while node >= 0 and k < n and len(out_t) < budget:
            node = add(node, tokens[k])
            k += 1
    mapped = {0: 0}
    for i in range(1, len(fill_tokens)):
        parent = mapped.get(fill_parents[i])
        if parent is None:
            continue
        node = add(parent, fill_tokens[i])
        if node < 0:
            continue
        mapped[i] = node
    return out_t, out_p
