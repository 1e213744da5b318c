"""MLP_SPECULATOR speculation: IBM's MLPSpeculator (as vLLM serves it) on the target's last
hidden state, drafting chains or top-k trees.

After every target forward the drafter keeps, per request, the target's final (normed) hidden
state at the last committed row: the row whose LM-head output became the root (a request whose
kept state is older, after steps run without the drafter, does not draft). Stage 0 reads it
and the root token and scores the root's children; stage d reads the state stage d - 1 left at
a node's parent and the node's own token, and scores the node's children
(specserve/speculative/models/mlp_speculator.py). No attention, no KV: a level of the tree is one
batched stage over every frontier node of every request (`PackedStages`, matmuls in the CPU
engine's q8_0 by default).

Trees as EAGLE grows them (specserve/speculative/eagle_tree.py): temperature 0 → `TopKTree`
(top-k children of the best k nodes per level, the best `num_draft_tokens - 1` kept; top-k 1 is
vLLM's chain of top-1 drafts), verified greedily. Temperature > 0 → `SampledTree` (children drawn
from q, the stage's distribution processed like the target's, without replacement, verified
with q: `QMode.WITHOUT_REPLACEMENT`; seeded requests draw with their own noise), unless
`--speculative-eagle-target-only`, which keeps the top-k tree and verifies it with q ignored.
Over a reduced draft vocabulary q is zero outside it, which sampling verification handles
losslessly. The tree is at most n_predict levels deep.

Checkpoints: `--speculative-draft-model-path` in the layout vLLM and IBM publish; with the
default model and no path, the speculator trained for it in assets/ (model card in its README).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from torch import Tensor

from specserve.runtime.sampling.sampler import SamplingBatchInfo, process_logits
from specserve.runtime.sampling.seeded import gumbel_noise
from specserve.speculative.base import Drafter, RunnerReq, TargetRows, register_algorithm
from specserve.speculative.drafters import ASSETS
from specserve.speculative.drafters.eagle import draft_matmul_dtype
from specserve.speculative.eagle_tree import SampledTree, TopKTree, level_widths
from specserve.speculative.models.mlp_speculator import load_mlp_speculator, read_config
from specserve.speculative.models.mlp_speculator_cpu import PackedStages, StageRun
from specserve.speculative.options import (
    DraftTreeOptions,
    ResolveContext,
    SpecConfig,
    check_tree_shape,
    flag,
)
from specserve.speculative.tree import DraftTree
from specserve.speculative.verify import QMode

logger = logging.getLogger(__name__)

# the speculator trained for the default model (python -m specserve.speculative.train
# --algorithm MLP_SPECULATOR)
DEFAULT_MLP_SPECULATOR = ASSETS / "mlp-speculator-smollm2-135m-instruct"
# (num_steps, topk, num_draft_tokens) when unset, by device type, steps capped at n_predict.
# CPU: a chain of 3, vLLM's shape; verify rows, not the stages, are what a tree costs there
# (docs/speculative.md, "MLP_SPECULATOR").
MLP_TREE_DEFAULTS = {"cpu": (3, 1, 4), "cuda": (3, 4, 8)}


@register_algorithm("MLP_SPECULATOR")
class MlpSpeculatorDrafter(Drafter):
    options = DraftTreeOptions
    vllm_methods = ("mlp_speculator",)
    needs_final_hidden = True
    q_mode = QMode.WITHOUT_REPLACEMENT  # for the sampled trees; top-k trees carry no q

    @classmethod
    def resolve_options(cls, opts: DraftTreeOptions, ctx: ResolveContext) -> DraftTreeOptions:
        path = opts.draft_model_path
        if path is None:
            if not (ctx.default_model and (DEFAULT_MLP_SPECULATOR / "config.json").exists()):
                raise ValueError(f"MLP_SPECULATOR needs {flag('draft_model_path')}: an "
                                 "MLPSpeculator directory (config.json and model.safetensors); "
                                 "only the default model has a shipped one")
            path = str(DEFAULT_MLP_SPECULATOR)
        n_predict = read_config(Path(path)).n_predict
        steps, topk, n = MLP_TREE_DEFAULTS.get(ctx.device, MLP_TREE_DEFAULTS["cpu"])
        steps = min(steps, n_predict)
        if topk == 1:
            n = steps + 1
        steps, topk, n = check_tree_shape(opts.num_steps, opts.eagle_topk, opts.num_draft_tokens,
                                          (steps, topk, n))
        if steps > n_predict:
            raise ValueError(f"{flag('num_steps')} {steps} exceeds the {n_predict} stages "
                             f"(n_predict) of {path}")
        opts = dataclasses.replace(opts, draft_model_path=path, num_steps=steps, eagle_topk=topk,
                                   num_draft_tokens=n)
        return super().resolve_options(opts, ctx)

    @classmethod
    def chain_options(cls, k: int) -> dict:
        return {"num_steps": k, "eagle_topk": 1, "num_draft_tokens": k + 1}

    def __init__(self, cfg: SpecConfig, runner) -> None:
        super().__init__(cfg, runner)
        mc = runner.model_config
        self.device = torch.device(runner.device)
        model = load_mlp_speculator(cfg.draft_model_path, mc.hidden_size, mc.vocab_size)
        if cfg.num_steps > model.cfg.n_predict:
            raise ValueError(f"{flag('num_steps')} {cfg.num_steps} exceeds the "
                             f"{model.cfg.n_predict} stages of {cfg.draft_model_path}")
        self.fmt = draft_matmul_dtype(cfg.draft_matmul_dtype, self.device)
        threads = getattr(runner, "kernel_threads", None) or torch.get_num_threads()
        self.stages = PackedStages(model.to(self.device), self.fmt, threads)
        self.vocab_size = mc.vocab_size
        # [Vd] target ids of the draft ids, None when the stages score the whole vocabulary
        self.reduced = self.stages.draft_ids if model.cfg.draft_vocab_size else None
        # rid -> (final hidden [H] of its last committed row, that row's position)
        self.hidden: dict[str, tuple[Tensor, int]] = {}

    def describe(self) -> str:
        c, cfg = self.stages.cfg, self.cfg
        vocab = f"{c.draft_vocab_size} draft tokens" if c.draft_vocab_size else "full vocabulary"
        return (f"{c.n_predict} stages ({'tied, ' if c.tie_weights else ''}inner {c.inner_dim}, "
                f"{vocab}) multiplying in {str(self.fmt).removeprefix('torch.')}; tree of "
                f"{cfg.num_steps} steps, top-k {cfg.eagle_topk}, {cfg.num_draft_tokens} nodes")

    def draft_extend(self, rows: list[TargetRows], out) -> None:
        fh = out.final_hidden
        last = torch.cat([r.hidden_rows[-1:] for r in rows]).to(fh.device)
        h = fh.index_select(0, last)  # [R, H]: a copy, the forward's buffers can go
        for j, r in enumerate(rows):
            self.hidden[r.rid] = (h[j], r.prefix_len + len(r.next_tokens) - 1)

    def _fresh(self, r: RunnerReq) -> bool:
        """The kept hidden state is the one below the root (not from before steps that ran
        without the drafter)."""
        kept = self.hidden.get(r.rid)
        return kept is not None and kept[1] == len(r.tokens) - 2

    def _sampled(self, r: RunnerReq) -> bool:
        return r.params is not None and not r.params.is_greedy and not self.cfg.eagle_target_only

    @torch.inference_mode()
    def propose(self, reqs: list[RunnerReq]) -> list[DraftTree]:
        trees: list[DraftTree | None] = [None] * len(reqs)
        work: list[tuple[int, RunnerReq, TopKTree | SampledTree]] = []
        k = self.cfg.eagle_topk
        for i, r in enumerate(reqs):
            if r.budget <= 1 or not self._fresh(r):
                trees[i] = DraftTree.root(r.tokens[-1])
                continue
            depth = min(self.cfg.num_steps, r.budget - 1)
            if self._sampled(r):
                builder = SampledTree(r.tokens[-1], level_widths(r.budget - 1, depth, k),
                                      self.vocab_size, self.reduced)
            else:
                builder = TopKTree(r.tokens[-1], k, depth)
            work.append((i, r, builder))
        if work:
            self._grow(work)
        for i, r, b in work:
            trees[i] = b.finalize(r.budget) if isinstance(b, TopKTree) else b.finalize()
        return trees

    def _grow(self, work: list) -> None:
        st, k = self.stages, self.cfg.eagle_topk
        state = st.first_state(torch.stack([self.hidden[r.rid][0] for _, r, _ in work]))
        rows = [st.emb_index[r.tokens[-1]] for _, r, _ in work]
        frontier = [[0] for _ in work]
        if k == 1 and all(isinstance(t, TopKTree) for _, _, t in work):
            # greedy chains: every stage in one run, each fed the previous stage's top-1
            depth = max(t.max_depth for _, _, t in work)
            run = self._stage_run(work, [(b, 0) for b in range(len(work))], 0, depth, state,
                                  rows, 1)
            for logq, toks in zip(run.logq, run.tokens):
                for b, (_, _, t) in enumerate(work):
                    if frontier[b]:
                        frontier[b] = t.expand(frontier[b], logq[b: b + 1], toks[b: b + 1])
            return
        # trees: one run of one stage per level over every request's frontier
        row_of: list[dict[int, int]] = [{-1: b} for b in range(len(work))]  # node -> state row
        level = 0
        while any(frontier):
            flat = [(b, u) for b, f in enumerate(frontier) for u in f]
            src = [row_of[b][work[b][2].parents[u]] for b, u in flat]
            if src != list(range(state.shape[0])):
                state = state.index_select(0, torch.tensor(src, device=state.device))
            if level:
                rows = [st.emb_index[work[b][2].tokens[u]] for b, u in flat]
            run = self._stage_run(work, flat, level, 1, state, rows, k)
            state = run.state
            row_of = [{} for _ in work]
            for j, (b, u) in enumerate(flat):
                row_of[b][u] = j
            frontier = self._expand(work, frontier, run, level)
            level += 1

    def _stage_run(self, work: list, flat: list[tuple[int, int]], first: int, count: int,
                   state: Tensor, rows: list[int], k: int) -> StageRun:
        """Stages [first, first + count) over the rows `flat` ((request, tree node) each; a
        run of several stages follows each row's top-1). Tests steer drafts by overriding
        this."""
        return self.stages.run(first, count, state, rows, k)

    def _expand(self, work: list, frontier: list[list[int]], run, level: int
                ) -> list[list[int]]:
        """Feed one level's stage run (rows: the frontier in request order) to the builders;
        returns the next frontier."""
        out: list[list[int]] = [[] for _ in work]
        sampled, off = [], 0
        for b, (_, _, t) in enumerate(work):
            n = len(frontier[b])
            if n and isinstance(t, TopKTree):
                out[b] = t.expand(frontier[b], run.logq[0][off: off + n],
                                  run.tokens[0][off: off + n])
            elif n:
                sampled.append((b, off, n))
            off += n
        if not sampled:
            return out
        sel = [j for _, o, n in sampled for j in range(o, o + n)]
        params = [work[b][1].params for b, _, n in sampled for _ in range(n)]
        logits = run.logits[sel].float()
        q = process_logits(logits, SamplingBatchInfo.from_params(params, logits.shape[-1],
                                                                 logits.device))  # [M, Vd]
        off = 0
        for b, _, n in sampled:
            r = work[b][1]
            noise = None if r.params.seed is None else gumbel_noise(
                r.params.seed, len(r.tokens) + level, self.stages.draft_ids)
            out[b] = work[b][2].expand(frontier[b], q[off: off + n], gumbel=noise)
            off += n
        return out

    def release(self, rid: str) -> None:
        self.hidden.pop(rid, None)

    def reset(self) -> None:
        self.hidden.clear()
