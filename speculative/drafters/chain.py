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

from runtime.sampling.sampler import SamplingBatchInfo, process_logits
from runtime.sampling.seeded import gumbel_noise
from speculative.base import Drafter, SpecReq
from speculative.options import DraftTreeOptions, ResolveContext, flag
from speculative.tree import DraftTree
from speculative.verify import QMode


@dataclass(slots=True)
class Chain:
    """One request's chain while it grows."""

    req: SpecReq
    depth: int  # drafts to make
    tokens: list[int]  # root first
    probs: list[Tensor]  # q at each fed node (sampled requests)
    index: int  # the request's position in `propose`'s list


class ChainDrafter(Drafter):
    """A drafter whose drafts come from a model's logits, one chain node per step."""

    q_mode = QMode.IID
    # a draft step costs ~0.15-0.35 of a target decode step on the CPU engine (the draft's LM
    # head alone is the target's), so S drafts pay only when about half a draft per step lands
    # (docs/benchmarks.md, "Every method"); probes are rarer for the same reason
    min_accept_per_step = 0.5
    probe_every = 32
    # (num_steps) when --speculative-num-steps is unset, by engine
    default_num_steps: dict[str, int] = {"cpu": 3, "torch": 3}

    @classmethod
    def resolve_options(cls, opts: DraftTreeOptions, ctx: ResolveContext) -> DraftTreeOptions:
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

    # ---- the model step, per subclass ---------------------------------------------------
    def _step(self, chains: list[Chain], j: int) -> Tensor:
        """Feed node j of every chain (all have depth > j); return logits [B, V] at node j."""
        raise NotImplementedError

    def _begin(self, chains: list[Chain]) -> None:  # noqa: B027
        """Called once per `propose` before step 0 (with every chain, drafting or not)."""

    def _end(self, chains: list[Chain]) -> None:  # noqa: B027
        """Called once per `propose` after the last step."""

    # ---- growing ------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, reqs: list[SpecReq]) -> list[DraftTree]:
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

    def _pick(self, active: list[Chain], logits: Tensor) -> list[int]:
        logits = logits[:, : self.vocab_size].float()
        out = logits.argmax(dim=-1).tolist()
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
