"""MEDUSA speculation: Medusa-1 heads on the target's last hidden state, a static sparse tree.

After every target forward the drafter keeps, per request, the target's final (normed) hidden
state at the last committed row: the row whose LM-head output became the root. Head k on it
scores the token k + 1 places below the root (head 0: the root's children). The tree is the
paper's static sparse tree, `--speculative-medusa-choices`: a list of paths of top-k ranks, e.g.
[[0], [1], [0, 0]] = the root's children ranked 0 and 1 by head 0, and under rank 0 the token
ranked 0 by head 1. Children come from each head's top-k independent of the path (Medusa's
cartesian candidates), so the tree is a deterministic function of the heads' scores and is
verified with q one-hot: greedy output is exact and sampled output follows the target's
distribution (the multi-draft rejection scheme, `verify_stochastic`), seeded requests by their
own draws. The paper's typical acceptance is lossy and not offered.

Heads load from the public Medusa-1 layout or our tied variant
(`specserve/speculative/models/medusa.py`) given by `--speculative-draft-model-path`; with the
default model and no path, the heads trained for it in assets/ (model card in its README).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from specserve.speculative.base import Drafter, RunnerReq, TargetRows, register_algorithm
from specserve.speculative.drafters import ASSETS
from specserve.speculative.models.medusa import load_medusa
from specserve.speculative.options import DraftTreeOptions, ResolveContext, SpecConfig, flag, option
from specserve.speculative.tree import DraftTree

logger = logging.getLogger(__name__)

# Chosen on the train split for the shipped heads by `python -m
# specserve.speculative.train.medusa_tree` (the paper's greedy tree on measured top-r accuracies,
# sized by the CPU verify-cost curve): three children of the root. Their accuracy beyond depth 1
# (head 1: 0.10, head 2: 0.07 top-1) does not pay for verify rows on this CPU engine. Heads trained
# for a bigger model (or a GPU) want a bigger tree: run the same tool on their run directory.
DEFAULT_CHOICES = [[0], [1], [2]]


def parse_choices(text: str | list | None) -> list[tuple[int, ...]]:
    """Medusa choices (JSON or a list of lists of ranks) in tree order: by depth, then as given;
    every path's prefixes must be there too."""
    raw = DEFAULT_CHOICES if text is None else (json.loads(text) if isinstance(text, str)
                                                else text)
    if not isinstance(raw, list) or not raw or not all(
            isinstance(p, list) and p and all(isinstance(r, int) and r >= 0 for r in p)
            for p in raw):
        raise ValueError(f"{flag('medusa_choices')} must be a JSON list of non-empty lists of "
                         "ranks >= 0, e.g. [[0], [1], [0, 0]]")
    paths = list(dict.fromkeys(tuple(p) for p in raw))
    have = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in have:
            raise ValueError(f"{flag('medusa_choices')}: {list(p)} needs its prefix "
                             f"{list(p[:-1])} too")
    return sorted(paths, key=len)  # stable: same-depth paths keep their given order


# the tied heads trained for the default model (python -m specserve.speculative.train --algorithm
# MEDUSA)
DEFAULT_MEDUSA_HEADS = ASSETS / "medusa-smollm2-135m-instruct"


@dataclass(frozen=True)
class MedusaOptions(DraftTreeOptions):
    medusa_choices: str | None = option(
        None, "MEDUSA: the static sparse tree as a JSON list of paths of top-k ranks, one rank "
        f"per head (default {json.dumps(DEFAULT_CHOICES)}); tree nodes = paths + 1")


@register_algorithm("MEDUSA")
class MedusaDrafter(Drafter):
    options = MedusaOptions
    vllm_methods = ("medusa",)
    needs_final_hidden = True

    @classmethod
    def resolve_options(cls, opts: MedusaOptions, ctx: ResolveContext) -> MedusaOptions:
        if opts.draft_model_path is None:
            if not (ctx.default_model and (DEFAULT_MEDUSA_HEADS / "config.json").exists()):
                raise ValueError(f"MEDUSA needs {flag('draft_model_path')}: a directory of "
                                 "Medusa heads (medusa_lm_head.safetensors or .pt with "
                                 "config.json); only the default model has shipped heads")
            opts = dataclasses.replace(opts, draft_model_path=str(DEFAULT_MEDUSA_HEADS))
        choices = parse_choices(opts.medusa_choices)
        if opts.num_draft_tokens is None:
            opts = dataclasses.replace(opts, num_draft_tokens=len(choices) + 1)
        return super().resolve_options(opts, ctx)

    # a probe reads only the last committed row's hidden state, which the full steps before
    # it (the controller's WARM_STEPS) keep current

    def __init__(self, cfg: SpecConfig, runner) -> None:
        super().__init__(cfg, runner)
        mc = runner.model_config
        self.heads = load_medusa(cfg.draft_model_path, mc.hidden_size, mc.vocab_size)
        self.choices = parse_choices(cfg.medusa_choices)
        depth = max(len(p) for p in self.choices)
        if depth > self.heads.num_heads:
            raise ValueError(f"{flag('medusa_choices')} reach depth {depth}, the checkpoint has "
                             f"{self.heads.num_heads} heads")
        # top-k needed per head: the largest rank any path asks of it
        self.ranks = [1 + max(p[d] for p in self.choices if len(p) > d) for d in range(depth)]
        self.hidden: dict[str, Tensor] = {}  # rid -> final hidden of its last committed row

    def describe(self) -> str:
        h = self.heads
        return (f"{h.num_heads} Medusa heads x {h.num_layers} ResBlock(s)"
                f"{' (tied LM head)' if h.tied else ''}, tree of {len(self.choices)} drafts")

    def draft_extend(self, rows: list[TargetRows], out) -> None:
        for r in rows:
            self.hidden[r.rid] = out.final_hidden[r.hidden_rows[-1]].detach().clone()

    def _lm_head(self, x: Tensor) -> Tensor:
        return self.runner.model.compute_logits(x)

    def propose(self, reqs: list[RunnerReq]) -> list[DraftTree]:
        trees: list[DraftTree | None] = [None] * len(reqs)
        live = [i for i, r in enumerate(reqs) if r.budget > 1 and r.rid in self.hidden]
        for i, r in enumerate(reqs):
            if i not in live:
                trees[i] = DraftTree.root(r.tokens[-1])
        if not live:
            return trees
        logits = self._head_logits([reqs[i] for i in live])  # [depth, B, V]
        tops = [torch.topk(logits[d], k, dim=-1).indices.tolist()
                for d, k in enumerate(self.ranks)]  # per depth: [B][k]
        for b, i in enumerate(live):
            r = reqs[i]
            tokens, parents, index = [r.tokens[-1]], [-1], {(): 0}
            for path in self.choices[: r.budget - 1]:
                index[path] = len(tokens)
                tokens.append(tops[len(path) - 1][b][path[-1]])
                parents.append(index[path[:-1]])
            trees[i] = DraftTree.from_parents(tokens, parents)
        return trees

    def _head_logits(self, reqs: list[RunnerReq]) -> Tensor:
        """[depth, B, V]: the heads' scores at each request's last committed row, only the
        heads the tree reaches (each costs an LM-head matmul). Tests steer drafts by overriding
        this."""
        h = torch.stack([self.hidden[r.rid] for r in reqs])
        return self.heads.logits(h, self._lm_head, len(self.ranks))

    def live_requests(self) -> int:
        return len(self.hidden)

    def release(self, rid: str) -> None:
        self.hidden.pop(rid, None)

    def reset(self) -> None:
        self.hidden.clear()
