"""LOOKAHEAD speculation: Lookahead decoding (Fu et al. 2024, arXiv 2402.02057), no draft model,
no data store.

Each request keeps a 2-D window of Jacobi guesses: N - 1 levels (past Jacobi iterations, oldest
first) of W tokens, and a pool of n-grams harvested from it. Every step runs ONE target forward
over the root, the lookahead branch and the verification branch:

- lookahead branch: level 0 is a guessed continuation of the root (column i at depth i + 1,
  its column 0 being the root itself); the token of level l >= 1 in column i sits at depth
  i + l + 1 and sees level 0's columns 0..i and its own column's levels 1..l-1: the attention
  mask of the paper (and of llama.cpp's `lookahead` example). As a tree: level 0 is a chain
  from the root and each column grows a vertical chain from its level-0 node, so it runs on the
  same tree-masked verify path as every other drafter (`ancestor_mask`).
- verification branch: up to G n-grams from the pool whose first token is the root, each a
  chain of N - 1 drafts below the root (merged where they share a prefix).

After the forward, the target's argmax at each column's last level is the new level (the
Jacobi step); every column yields the n-gram (its tokens from level 0 up, then the new one) into
the pool, keyed by its first token, at most G per key (most recent kept). Verification is the
worker's: any root path of the tree is a candidate, so greedy output is exact and sampled output
follows the target distribution (the tree is deterministic: q one-hot, the paper's lossless
sampling scheme, `verify_stochastic`).

With `--speculative-lookahead-pool-from-context` (on) the request's pool also holds the n-grams
of its prompt and output so far (the reference implementation's POOL_FROM_PROMPT). The pool is
per request; a bounded global pool (`--speculative-lookahead-global-pool`
n-grams, least recently used first tokens evicted) also takes every request's n-grams and fills
the verification branch when the request's own pool has fewer than G.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field

from specserve.speculative.base import Drafter, RunnerReq, register_algorithm
from specserve.speculative.options import ResolveContext, SpecOptions, flag, option
from specserve.speculative.tree import DraftTree

# Requests whose window and pool are kept at once (LRU beyond; a dropped one restarts).
MAX_LIVE = 4096


@dataclass(frozen=True)
class LookaheadOptions(SpecOptions):
    lookahead_window: int = option(3, "LOOKAHEAD: W, the Jacobi window's width (columns)")
    lookahead_ngram: int = option(3, "LOOKAHEAD: N, the n-gram size (the window keeps N - 1 "
                                  "levels; verified n-grams draft N - 1 tokens)")
    lookahead_guess_set: int = option(3, "LOOKAHEAD: G, most n-grams verified per step (and "
                                      "kept per first token in a pool)")
    lookahead_pool_from_context: bool = option(
        True, "LOOKAHEAD: also pool the n-grams of the request's prompt and output so far (the "
        "reference implementation's POOL_FROM_PROMPT), not only the Jacobi window's")
    lookahead_global_pool: int = option(
        100_000, "LOOKAHEAD: n-grams kept in the pool shared by all requests (0: per-request "
        "pools only)")


def lookahead_tree_size(w: int, n: int, g: int) -> int:
    """Nodes of a full step's tree, root included: (W - 1) level-0 nodes, W * (N - 2) above,
    G * (N - 1) verification drafts."""
    return 1 + (w - 1) + w * (n - 2) + g * (n - 1)


@dataclass
class _Request:
    levels: list[list[int]]  # [N - 1][W] guesses, oldest level first
    pool: dict[int, list[tuple[int, ...]]] = field(default_factory=dict)  # first -> (N-1)-grams
    # the last tree's layout: node of (level, column), None if not drafted
    layout: list[list[int | None]] | None = None


@register_algorithm("LOOKAHEAD")
class LookaheadDrafter(Drafter):
    options = LookaheadOptions
    vllm_methods = ("lookahead",)
    wants_node_argmax = True
    # a request without draft slots keeps its window as it is (no columns drafted, no Jacobi
    # step), so a step in which no request has slots is plain decoding

    @classmethod
    def resolve_options(cls, opts: LookaheadOptions, ctx: ResolveContext) -> LookaheadOptions:
        w, n, g = opts.lookahead_window, opts.lookahead_ngram, opts.lookahead_guess_set
        if w < 1 or n < 2 or g < 0:
            raise ValueError(f"need {flag('lookahead_window')} >= 1, {flag('lookahead_ngram')} "
                             f">= 2 and {flag('lookahead_guess_set')} >= 0")
        if opts.lookahead_global_pool < 0:
            raise ValueError(f"{flag('lookahead_global_pool')} must be >= 0")
        if opts.num_draft_tokens is None:
            import dataclasses

            opts = dataclasses.replace(opts, num_draft_tokens=lookahead_tree_size(w, n, g))
        return super().resolve_options(opts, ctx)

    def __init__(self, cfg, runner) -> None:
        super().__init__(cfg, runner)
        self.W, self.N, self.G = cfg.lookahead_window, cfg.lookahead_ngram, cfg.lookahead_guess_set
        self.reqs: OrderedDict[str, _Request] = OrderedDict()
        self.global_pool: OrderedDict[int, list[tuple[int, ...]]] = OrderedDict()
        self.global_count = 0
        self.global_cap = cfg.lookahead_global_pool
        self.from_context = cfg.lookahead_pool_from_context

    def describe(self) -> str:
        return (f"W={self.W} N={self.N} G={self.G}: up to {self.cfg.num_draft_tokens} nodes per "
                f"step; global pool {self.global_cap} n-grams")

    # ---- state --------------------------------------------------------------------------
    def observe(self, rid: str, tokens: list[int], num_new: int) -> None:
        st = self.reqs.get(rid)
        if st is not None:
            self.reqs.move_to_end(rid)
            if self.from_context:  # the n-grams ending in the new tokens
                n = self.N
                for end in range(max(n, len(tokens) - num_new + 1), len(tokens) + 1):
                    self._add(st, tokens[end - n : end], share=False)
            return
        # the window starts from prompt tokens (a deterministic pick per prompt)
        rng = random.Random(hash(tuple(tokens[-64:])) & 0xFFFFFFFF)
        levels = [[tokens[rng.randrange(len(tokens))] for _ in range(self.W)]
                  for _ in range(self.N - 1)]
        st = self.reqs[rid] = _Request(levels)
        if len(self.reqs) > MAX_LIVE:
            self.reqs.popitem(last=False)
        if self.from_context:  # the prompt's n-grams, later ones most recent
            for end in range(self.N, len(tokens) + 1):
                self._add(st, tokens[end - self.N : end], share=False)

    def live_requests(self) -> int:
        return len(self.reqs)

    def release(self, rid: str) -> None:
        self.reqs.pop(rid, None)

    def reset(self) -> None:
        self.reqs.clear()
        self.global_pool.clear()
        self.global_count = 0

    def pool_size(self) -> int:
        return self.global_count

    # ---- drafting -----------------------------------------------------------------------
    def candidates(self, st: _Request, first: int) -> list[tuple[int, ...]]:
        """Up to G n-grams (N - 1 tokens after `first`), the request's own first, most recent
        first, then the global pool's."""
        out = list(reversed(st.pool.get(first, ())))
        if len(out) < self.G and self.global_cap:
            seen = set(out)
            for g in reversed(self.global_pool.get(first, ())):
                if len(out) >= self.G:
                    break
                if g not in seen:
                    out.append(g)
                    seen.add(g)
        return out[: self.G]

    def build(self, st: _Request, root: int, budget: int) -> tuple[list[int], list[int]]:
        """The step's tree within `budget` nodes: verification n-grams first (merged into a
        trie), then the lookahead branch column by column (a column needs its level-0 node
        and its N - 2 levels above). Records which node holds each (level, column)."""
        tokens, parents = [root], [-1]
        W, N = self.W, self.N
        per_col = N - 1  # nodes a column adds (column 0's level-0 node is the root)
        room_for_look = per_col - 1 if W >= 1 else 0  # keep at least column 0
        kids: list[dict[int, int]] = [{}]
        for gram in self.candidates(st, root):
            node = 0
            for t in gram:
                nxt = kids[node].get(t)
                if nxt is None:
                    if len(tokens) >= budget - room_for_look:
                        break
                    nxt = len(tokens)
                    tokens.append(t)
                    parents.append(node)
                    kids.append({})
                    kids[node][t] = nxt
                node = nxt
        layout: list[list[int | None]] = [[None] * W for _ in range(N - 1)]
        level0_prev = 0
        for i in range(W):
            need = per_col if i > 0 else per_col - 1
            if len(tokens) + need > budget:
                break
            if i == 0:
                node0 = 0
            else:
                node0 = len(tokens)
                tokens.append(st.levels[0][i])
                parents.append(level0_prev)
            layout[0][i] = node0
            level0_prev = node0
            below = node0
            for lv in range(1, N - 1):
                below_new = len(tokens)
                tokens.append(st.levels[lv][i])
                parents.append(below)
                layout[lv][i] = below_new
                below = below_new
        st.layout = layout
        return tokens, parents

    def propose(self, reqs: list[RunnerReq]) -> list[DraftTree]:
        trees = []
        for r in reqs:
            st = self.reqs.get(r.rid)
            if st is None:
                self.observe(r.rid, r.tokens, len(r.tokens))
                st = self.reqs[r.rid]
            if r.budget <= 1:
                st.layout = None
                trees.append(DraftTree.root(r.tokens[-1]))
                continue
            trees.append(DraftTree.from_parents(*self.build(st, r.tokens[-1], r.budget)))
        return trees

    def after_verify(self, rids: list[str], trees: list[DraftTree],
                     node_argmax: list[list[int]], accepted: list[list[int]]) -> None:
        """The Jacobi step: each drafted column's new token is the target's argmax at its last
        level; its n-gram joins the pools; the window drops its oldest level."""
        N, W = self.N, self.W
        for rid, tree, am in zip(rids, trees, node_argmax):
            st = self.reqs.get(rid)
            if st is None or st.layout is None:
                continue
            toks = tree.tokens.tolist()
            new = list(st.levels[0])  # undrafted columns restart from their oldest guess
            for i in range(W):
                last = st.layout[N - 2][i]
                if last is None:
                    continue
                new[i] = am[last]
                gram = [toks[st.layout[lv][i]] for lv in range(N - 1)] + [am[last]]
                self._add(st, gram)
            st.levels = st.levels[1:] + [new]
            st.layout = None

    def _add(self, st: _Request, gram: list[int], share: bool = True) -> None:
        """Pool an n-gram for the request (and, with `share`, globally: the Jacobi window's
        guesses; a request's own text stays its own)."""
        first, rest = gram[0], tuple(gram[1:])
        mine = st.pool.setdefault(first, [])
        if rest in mine:
            mine.remove(rest)
        mine.append(rest)  # most recent last
        if len(mine) > max(self.G, 1):
            del mine[0]
        if not share or not self.global_cap:
            return
        glob = self.global_pool.get(first)
        if glob is None:
            glob = self.global_pool[first] = []
        else:
            self.global_pool.move_to_end(first)
        if rest in glob:
            glob.remove(rest)
            self.global_count -= 1
        glob.append(rest)
        self.global_count += 1
        if len(glob) > self.G:
            del glob[0]
            self.global_count -= 1
        while self.global_count > self.global_cap:
            _, gone = self.global_pool.popitem(last=False)
            self.global_count -= len(gone)
