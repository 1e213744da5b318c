"""Growing one request's EAGLE draft tree from head outputs: pure bookkeeping, no model inside.

The drafter (specserve/speculative/eagle.py) runs the head; a tree builder decides which nodes exist
and which get expanded next. Node 0 is the root (the last verified token); nodes are numbered in
creation order, so parents always precede children (topological order for `DraftTree`).

`TopKTree` (EAGLE-2 dynamic tree; temperature 0, and SGLang-style target-only sampling):
- the root's children are the top-k tokens of the head's output at the last committed row;
- each later step expands the current frontier (<= k nodes): every frontier node adds its top-k
  children as candidates, scored by cumulative draft log-probability (sum of log q along the
  path); the next frontier is the best k of the children just added;
- after `max_depth` levels the best `num_nodes - 1` candidates over all levels are kept. A
  child's score is its parent's plus a log-probability <= 0, and ties go to the older node, so
  the kept set is closed under parents: a connected tree. k = 1 gives a chain of max_depth.
Children are a deterministic function of q, so verification must take q as one-hot (ONE_HOT).

`SampledTree` (temperature > 0, verified with q WITHOUT_REPLACEMENT): the children of a node
are drawn from its q = the head's distribution processed like the target's (temperature, top-k,
top-p, min-p) without replacement, by Gumbel-top-m (keys q / Exp(1)), in draw order. What the
verifier needs (specserve/speculative/verify.py): sibling i was drawn from q with siblings < i
removed, given everything decided before it was drawn. So every decision made BEFORE a draw is free
— how many nodes each level gets (`level_widths`, fixed by the budget), which nodes of the last
level are expanded (best cumulative log q so far), how a level's width is split among them (by the
sorted q of each expanded node: score + log of its i-th largest probability) — but a drawn node is
never dropped or reordered by its value, so EAGLE-2's final re-ranking is not used.

Seeded requests (coupling): the Gumbel noise of Gumbel-top-m is then not drawn but the
request's own noise for the children's position, G(seed, position, token) — the very noise the
target's seeded draw at that node uses (specserve/runtime/sampling/seeded.py). The children are
still m draws without replacement from q (any fixed independent Gumbel noise gives that), and
whenever q is close to p the target's draw argmax(log p + G) tends to be the first child argmax(log
q + G). Verification of seeded requests only compares tokens, so this is lossless.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from specserve.speculative.tree import DraftTree


def level_widths(num_nodes: int, num_steps: int, topk: int) -> list[int]:
    """Nodes per level (root excluded) of a sampled tree of at most `num_nodes` drafts: one per
    level down to `num_steps` (a chain along the best path), the rest widening the top levels,
    at most `topk` per level."""
    widths = [1] * min(num_steps, num_nodes)
    rest = num_nodes - len(widths)
    for d in range(len(widths)):
        add = min(topk - 1, rest)
        widths[d] += add
        rest -= add
    return widths


def topk_children(logits: Tensor, topk: int, to_target: Tensor | None = None
                  ) -> tuple[Tensor, Tensor]:
    """Head logits [M, V_head] → (log q [M, k], target token ids [M, k]) of each row's top-k.

    `to_target` [V_head] maps a reduced draft vocabulary to target ids (EAGLE-3's d2t)."""
    logq = torch.log_softmax(logits.float(), dim=-1)  # [M, V_head]
    values, ids = logq.topk(min(topk, logq.shape[-1]), dim=-1)  # [M, k]
    return values, (ids if to_target is None else to_target[ids])


class _Nodes:
    def __init__(self, root_token: int) -> None:
        self.tokens = [root_token]
        self.parents = [-1]
        self.depths = [0]
        self.scores = [0.0]  # cumulative log q of the path, root 0

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.scores.append(score)
        return len(self.tokens) - 1

    def best(self, ids: list[int], n: int) -> list[int]:
        """The n best of `ids` by score, ties to the older node."""
        return sorted(ids, key=lambda i: (-self.scores[i], i))[:n]


class TopKTree(_Nodes):
    """EAGLE-2 dynamic tree (module docstring); deterministic, verified ONE_HOT."""

    def __init__(self, root_token: int, topk: int, max_depth: int) -> None:
        super().__init__(root_token)
        self.topk = topk
        self.max_depth = max_depth

    def expand(self, nodes: list[int], child_logq: Tensor | list, child_tokens: Tensor | list
               ) -> list[int]:
        """`nodes` (the frontier, [0] at first) got head rows whose top-k children are
        `child_logq` / `child_tokens` [len(nodes), k] (tensors or nested lists). Adds them all
        as candidates; returns the next frontier (empty once the tree is `max_depth` deep)."""
        lqs, tss = (x.tolist() if isinstance(x, Tensor) else x for x in (child_logq, child_tokens))
        assert len(lqs) == len(nodes) == len(tss), "one row per node"
        added = []
        for u, lq, toks in zip(nodes, lqs, tss):
            base = self.scores[u]
            for q, t in zip(lq, toks):
                added.append(self.add(t, u, base + min(q, 0.0)))
        if not added or self.depths[added[0]] >= self.max_depth:
            return []
        return self.best(added, self.topk)

    def finalize(self, num_nodes: int) -> DraftTree:
        """Keep the best `num_nodes - 1` candidates (root always), in creation order."""
        keep = sorted(self.best(list(range(1, self.num_nodes)), num_nodes - 1))
        index = {0: 0}
        tokens, parents = [self.tokens[0]], [-1]
        for i in keep:
            p = self.parents[i]
            assert p in index, f"node {i} kept without its parent {p}: scores not monotone"
            index[i] = len(tokens)
            tokens.append(self.tokens[i])
            parents.append(index[p])
        return DraftTree.from_parents(tokens, parents)


class SampledTree(_Nodes):
    """Children drawn from q without replacement, fixed level widths (module docstring)."""

    def __init__(self, root_token: int, widths: list[int], vocab_size: int,
                 to_target: Tensor | None = None) -> None:
        super().__init__(root_token)
        self.widths = widths
        self.vocab_size = vocab_size
        # q rows may cover a reduced draft vocabulary (EAGLE-3's d2t, a token map): drawing
        # there is the same draw as over the target vocabulary with q = 0 outside it, and
        # ~6x cheaper; `to_target` [V_q] maps a draft id to its target id
        self.to_target = to_target
        self.q_rows: dict[int, Tensor] = {}  # node → [V_q] the q its children were drawn from

    def expand(self, nodes: list[int], q: Tensor, generator: torch.Generator | None = None,
               gumbel: Tensor | None = None) -> list[int]:
        """`nodes` got head distributions `q` [len(nodes), V_q] (processed probabilities).
        Draws this level's children; returns the nodes to expand next (empty when complete).
        The draw's noise: `gumbel` [V_q] (float64, standard Gumbel per draft id: a seeded
        request's noise for this level's position, shared by the level's nodes), else fresh
        exponentials from `generator` (None: torch's global RNG)."""
        assert q.shape[0] == len(nodes), "one q row per node"
        level = self.depths[nodes[0]]
        width = self.widths[level]
        # split the level's width before drawing: proxy value of u's i-th child =
        # score(u) + log(i-th largest q_u); ranks within a node fall with i, so each node
        # gets a prefix count m_u (zero-probability slots never count)
        top = q.topk(min(width, q.shape[-1]), dim=-1).values.tolist()  # [f, width]
        slots = [(self.scores[u] + math.log(p), r, i)
                 for r, (u, row) in enumerate(zip(nodes, top)) for i, p in enumerate(row) if p > 0]
        slots.sort(key=lambda s: (-s[0], s[1], s[2]))
        counts = [0] * len(nodes)
        for _, r, _ in slots[:width]:
            counts[r] += 1
        rows = [r for r, m in enumerate(counts) if m > 0]
        added = []
        if rows:
            qs = q[rows]  # [f', V]
            # Gumbel-top-m: the m largest log q + G (G standard Gumbel; = log(q / E) with
            # E ~ Exp(1)), in order, are m sequential draws without replacement; q = 0 tokens
            # get key -inf / -1 and are never drawn
            if gumbel is not None:
                keys = torch.where(qs > 0, qs.double().log() + gumbel.to(qs.device),
                                   -torch.inf)
            else:
                e = torch.empty_like(qs).exponential_(generator=generator)
                keys = torch.where(qs > 0, qs / e, torch.full_like(qs, -1.0))
            # the m largest keys in order (a partial sort: a full one of V keys per row costs
            # milliseconds); m never exceeds a row's nonzero count, so no key -1 is taken
            order = keys.topk(max(counts), dim=-1).indices  # [f', m]
            for j, r in enumerate(rows):
                u = nodes[r]
                self.q_rows[u] = qs[j]
                picked = order[j, : counts[r]]
                logq = torch.log(qs[j, picked]).tolist()
                ids = picked if self.to_target is None else self.to_target[picked]
                for t, lq in zip(ids.tolist(), logq):
                    added.append(self.add(t, u, self.scores[u] + lq))
        if not added or level + 1 >= len(self.widths):
            return []
        return self.best(added, self.widths[level + 1])

    def finalize(self) -> DraftTree:
        """Every drawn node; `draft_probs` rows hold q for expanded nodes, zeros for leaves."""
        n = self.num_nodes
        probs = None
        if self.q_rows:
            ref = next(iter(self.q_rows.values()))
            probs = torch.zeros((n, self.vocab_size), dtype=ref.dtype, device=ref.device)
            for u, row in self.q_rows.items():
                if self.to_target is None:
                    probs[u] = row
                else:
                    probs[u, self.to_target] = row
        return DraftTree.from_parents(self.tokens, self.parents, draft_probs=probs)
