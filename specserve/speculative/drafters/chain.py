"""Drafting a chain from a language model's own next-token distribution (a separate draft model,
the target's early layers): the shared half of STANDALONE and EARLY_EXIT.

A chain of S drafts is grown autoregressively: step j feeds chain node j (node 0 = the root)
and reads the model's logits for node j + 1. How a step runs is the subclass's (`_step`); how
the next token is picked is here, per request:

- greedy requests take the draft argmax (verification compares with the target argmax);
- sampled requests draw x ~ q, where q is the draft logits processed with the request's own
  temperature / top-k / top-p / min-p (as the target's p is), keep q in `draft_probs` and are
  verified by Leviathan rejection sampling with that q (`QMode.IID`; a chain is a tree whose
  nodes have one child, so IID and WITHOUT_REPLACEMENT coincide): lossless;
- seeded requests take argmax(log q + G) with G the target's own Gumbel noise of that (seed,
  position): verification (`verify_seeded`) is exact whatever the drafts, and the shared noise
  makes the draft agree with the target's draw whenever q is close to p.

Node j of the chain sits at position prefix_len + j and is written to the request's fresh slot j,
where the verify pass writes the target's KV of the same node (commit by move is a no-op for a
chain: the accepted nodes are a prefix of it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from specserve.runtime.sampling.argmax import argmax_rows
from specserve.runtime.sampling.sampler import SamplingBatchInfo, process_logits
from specserve.runtime.sampling.seeded import gumbel_noise
from specserve.speculative.base import Drafter, RunnerReq
from specserve.speculative.eagle_tree import SampledTree, TopKTree, level_widths, topk_children
from specserve.speculative.options import DraftTreeOptions, ResolveContext, check_tree_shape, flag
from specserve.speculative.tree import DraftTree
from specserve.speculative.verify import QMode


@dataclass(slots=True)
class Chain:
    """One request's chain while it grows."""

    req: RunnerReq
    depth: int  # drafts to make
    tokens: list[int]  # root first
    probs: list[Tensor]  # q at each fed node (sampled requests)
    index: int  # the request's position in `propose`'s list


@dataclass(slots=True)
class TreeRow:
    """One frontier node fed in a tree level: its token at `position`, attending to `kv` (the
    committed prefix, the root's fresh slot, its ancestors' scratch slots, its own last)."""

    req: RunnerReq
    token: int
    position: int
    kv: Tensor


class ChainDrafter(Drafter):
    """A drafter whose drafts come from a model's logits, one chain node per step."""

    # a chain is a tree whose nodes have one child: IID and WITHOUT_REPLACEMENT coincide there,
    # and sampled top-k trees draw siblings without replacement
    q_mode = QMode.WITHOUT_REPLACEMENT
    supports_trees = False  # top-k trees need scratch KV slots for unverified tree nodes
    # (num_steps) when --speculative-num-steps is unset, by engine
    default_num_steps: dict[str, int] = {"cpu": 3, "torch": 3}

    @classmethod
    def resolve_options(cls, opts: DraftTreeOptions, ctx: ResolveContext) -> DraftTreeOptions:
        if opts.eagle_topk not in (None, 1) and cls.supports_trees:  # a top-k tree
            steps = opts.num_steps or cls.default_num_steps.get(ctx.engine, 3)
            auto = (steps, opts.eagle_topk, 1 + steps + opts.eagle_topk - 1)
            steps, topk, n = check_tree_shape(opts.num_steps, opts.eagle_topk,
                                              opts.num_draft_tokens, auto)
            opts = dataclasses.replace(opts, num_steps=steps, eagle_topk=topk,
                                       num_draft_tokens=n)
            return super().resolve_options(opts, ctx)
        if opts.eagle_topk not in (None, 1):
            raise ValueError(f"{cls.algorithm_name()} drafts chains: {flag('eagle_topk')} must "
                             "be 1 (or unset)")
        if opts.eagle_target_only:
            raise ValueError(f"{flag('eagle_target_only')} applies to top-k trees; "
                             f"{cls.algorithm_name()} drafts chains")
        steps = opts.num_steps
        if steps is None:
            steps = (opts.num_draft_tokens - 1 if opts.num_draft_tokens
                     else cls.default_num_steps.get(ctx.engine, 3))
        if steps < 1:
            raise ValueError(f"{flag('num_steps')} must be >= 1")
        if opts.num_draft_tokens is not None and opts.num_draft_tokens != steps + 1:
            raise ValueError(f"a chain of {steps} drafts has {steps + 1} nodes: "
                             f"{flag('num_draft_tokens')} must be {steps + 1} or unset")
        opts = dataclasses.replace(opts, num_steps=steps, eagle_topk=1,
                                   num_draft_tokens=steps + 1)
        return super().resolve_options(opts, ctx)

    @classmethod
    def chain_options(cls, k: int) -> dict:
        return {"num_steps": k, "num_draft_tokens": k + 1}

    def describe(self) -> str:
        return f"chains of {self.cfg.num_steps} drafts"

    @property
    def grows_trees(self) -> bool:
        return (self.cfg.eagle_topk or 1) > 1

    # ---- the model step, per subclass ---------------------------------------------------
    def _step(self, chains: list[Chain], j: int) -> Tensor:
        """Feed node j of every chain (all have depth > j); return logits [B, V] at node j."""
        raise NotImplementedError

    def _begin(self, chains: list[Chain]) -> None:  # noqa: B027
        """Called once per `propose` before step 0 (with every chain, drafting or not)."""

    def _end(self, chains: list[Chain]) -> None:  # noqa: B027
        """Called once per `propose` after the last step."""

    def _tree_step(self, rows: list[TreeRow]) -> Tensor:
        """Feed tree nodes (levels >= 1; `supports_trees` drafters): logits [len(rows), V]."""
        raise NotImplementedError

    def _tree_scratch(self) -> int:
        """Scratch KV slots available to one `_tree_step` group (0: no trees)."""
        return 0

    def _tree_scratch_base(self) -> int:
        """The first scratch slot."""
        raise NotImplementedError

    # ---- growing ------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs: list[RunnerReq]) -> list[DraftTree]:
        if self.grows_trees:
            return self._propose_trees(reqs)
        chains = []
        for i, r in enumerate(reqs):
            assert r.fresh_slots is not None and r.fresh_slots.numel() >= r.budget, (
                f"{r.rid}: a chain drafter writes node j to fresh slot j")
            chains.append(Chain(r, min(self.cfg.num_steps, max(r.budget, 1) - 1),
                                [r.tokens[-1]], [], i))
        self._begin(chains)
        j = 0
        while True:
            active = [c for c in chains if c.depth > j]
            if not active:
                break
            logits = self._step(active, j)  # [B, V]
            nxt = self._pick(active, logits)
            for c, t in zip(active, nxt):
                c.tokens.append(t)
            j += 1
        self._end(chains)
        trees = []
        for c in chains:
            probs = None
            if c.probs:
                last = torch.zeros_like(c.probs[0])  # the last draft has no children
                probs = torch.stack([*c.probs, last])
            trees.append(DraftTree.chain(c.tokens[0], c.tokens[1:], probs))
        return trees

    # ---- top-k trees --------------------------------------------------------------------------
    def _propose_trees(self, reqs: list[RunnerReq]) -> list[DraftTree]:
        k, steps = self.cfg.eagle_topk, self.cfg.num_steps
        chains, builders = [], []
        for i, r in enumerate(reqs):
            assert r.fresh_slots is not None and r.fresh_slots.numel() >= 1
            depth = min(steps, max(r.budget, 1) - 1)
            # step 0 (the root, caught up like a chain's) runs for every request that drafts
            chains.append(Chain(r, 1 if depth > 0 else 0, [r.tokens[-1]], [], i))
            if depth <= 0:
                builders.append(None)
            elif self._tree_sampled(r):
                builders.append(SampledTree(r.tokens[-1], level_widths(r.budget - 1, depth, k),
                                            self.vocab_size))
            else:
                builders.append(TopKTree(r.tokens[-1], k, depth))
        self._begin(chains)
        live = [c for c in chains if c.depth > 0]
        frontier: dict[int, list[int]] = {}
        if live:
            logits = self._step(live, 0)
            for c, row in zip(live, logits):
                frontier[c.index] = self._tree_expand(builders[c.index], c.req, [0], row[None])
        self._end(chains)
        # levels >= 1, in groups of requests whose nodes fit the scratch slots
        group: list[int] = []
        need = 0
        per_req = 1 + k * steps  # at most k frontier nodes per level
        for i in sorted(frontier):
            if group and need + per_req > self._tree_scratch():
                self._grow_group(reqs, builders, frontier, group)
                group, need = [], 0
            group.append(i)
            need += per_req
        if group:
            self._grow_group(reqs, builders, frontier, group)
        trees = []
        for r, b in zip(reqs, builders):
            if b is None:
                trees.append(DraftTree.root(r.tokens[-1]))
            else:
                trees.append(b.finalize(r.budget) if isinstance(b, TopKTree) else b.finalize())
        return trees

    def _grow_group(self, reqs, builders, frontier, group: list[int]) -> None:
        slot_of: dict[tuple[int, int], int] = {}
        next_slot = self._tree_scratch_base()
        while True:
            rows, keys = [], []
            for i in group:
                r, b = reqs[i], builders[i]
                for u in frontier.get(i, []):
                    slot_of[(i, u)] = next_slot
                    next_slot += 1
                    path = []
                    a = u
                    while a > 0:
                        path.append(slot_of[(i, a)])
                        a = b.parents[a]
                    kv = torch.cat([r.prefix_slots, r.fresh_slots[:1],
                                    torch.tensor(path[::-1], dtype=r.prefix_slots.dtype)])
                    rows.append(TreeRow(r, b.tokens[u], len(r.tokens) - 1 + b.depths[u], kv))
                    keys.append((i, u))
            if not rows:
                return
            logits = self._tree_step(rows)
            at = 0
            for i in group:
                nodes = frontier.get(i, [])
                if nodes:
                    frontier[i] = self._tree_expand(builders[i], reqs[i], nodes,
                                                    logits[at: at + len(nodes)])
                    at += len(nodes)

    def _tree_sampled(self, r: RunnerReq) -> bool:
        """Sampled trees (verified with q) unless target-only: top-k trees verified one-hot."""
        return (r.params is not None and not r.params.is_greedy
                and not self.cfg.eagle_target_only)

    def _tree_expand(self, builder, req: RunnerReq, nodes: list[int], logits: Tensor) -> list[int]:
        logits = logits[:, : self.vocab_size].float()
        if isinstance(builder, TopKTree):
            logq, toks = topk_children(logits, self.cfg.eagle_topk)
            return builder.expand(nodes, logq.cpu(), toks.cpu())
        info = SamplingBatchInfo.from_params([req.params] * len(nodes), logits.shape[-1],
                                             logits.device)
        q = process_logits(logits, info)
        g = None
        if req.params.seed is not None:  # the target's own noise of this level's position
            ids = torch.arange(q.shape[-1], device=q.device)
            g = gumbel_noise(req.params.seed, len(req.tokens) + builder.depths[nodes[0]], ids)
        return builder.expand(nodes, q, gumbel=g)

    def _pick(self, active: list[Chain], logits: Tensor) -> list[int]:
        logits = logits[:, : self.vocab_size].float()
        out = argmax_rows(logits).tolist()
        sampled = [b for b, c in enumerate(active)
                   if c.req.params is not None and not c.req.params.is_greedy]
        if not sampled:
            return out
        params = [active[b].req.params for b in sampled]
        info = SamplingBatchInfo.from_params(params, logits.shape[-1], logits.device)
        q = process_logits(logits[sampled], info)  # [M, V] the draft's processed distribution
        ids = torch.arange(q.shape[-1], device=q.device)
        for m, b in enumerate(sampled):
            c = active[b]
            seed = c.req.params.seed
            if seed is None:
                tok = int(torch.multinomial(q[m], 1))
            else:  # the target's own noise at this position (depth len(tokens) - 1 node)
                g = gumbel_noise(seed, len(c.req.tokens) + len(c.tokens) - 1, ids)
                tok = int(torch.argmax(q[m].double().log() + g))
            c.probs.append(q[m])
            out[b] = tok
        return out

    @property
    def vocab_size(self) -> int:
        return self.runner.model_config.vocab_size
