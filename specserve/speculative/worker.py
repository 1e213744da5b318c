"""One speculative decode step inside the model runner: draft → tree-masked verify → commit.

KV slots come from the scheduler: each request arrives with its prefix slots plus `budget`
fresh slots. Tree node i is written to fresh slot i; after verification the accepted path's KV
is moved to the first fresh slots in path order (commit by move), so the request's KV stays a
plain ordered slot list. The request gains `len(path)` tokens of KV (root + accepted drafts) and
`len(path)` output tokens (accepted drafts + the bonus token); the scheduler frees the other
fresh slots.

Verification sees, at every node, exactly what plain decoding would see after that node's path:
penalties (repetition / frequency / presence) are applied per node with the request's history
plus the node's ancestors (`specserve/runtime/sampling/penalties.py: RowHistory`), then greedy rows
take the argmax, sampled rows the processed distribution. Seeded requests are verified by their
(seed, position) Gumbel-max draws (`verify_seeded`), so their output is plain seeded sampling's;
unseeded ones by speculative sampling (`verify_stochastic`) with coins from torch's global RNG.

A drafter that reads target hidden states gets them from the verify forward itself: after the
commit, `drafter.draft_extend` receives the root + accepted nodes' rows (in path order, now
living in the first fresh slots) with the tokens that follow them (accepted drafts + bonus).
"""

from __future__ import annotations

import logging
import os
import time
from typing import NamedTuple

import torch

from specserve.runtime.constrained.runner_grammars import apply_masks, mask_output
from specserve.runtime.constrained.tree_masks import constrain_tree
from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.messages import SpecStep
from specserve.runtime.model_runner.req import RunnerReq
from specserve.runtime.models.llama import ModelOutput
from specserve.runtime.sampling.argmax import argmax_rows
from specserve.runtime.sampling.logprobs import logit_top, logprob_rows, split_rows
from specserve.runtime.sampling.penalties import RowHistory, apply_penalties
from specserve.runtime.sampling.sampler import SamplingBatchInfo, expand, process_logits
from specserve.runtime.sampling.seeded import seed_to_int64, seeded_sample
from specserve.runtime.speculation import TargetRows
from specserve.runtime.verify_cost import (
    VerifyCost,
    load_verify_cost,
    measure_verify_cost,
    stored_verify_cost,
)
from specserve.speculative.base import Drafter
from specserve.speculative.options import SpecConfig
from specserve.speculative.tree import DraftTree
from specserve.speculative.tree_ops import make_tree_ops
from specserve.speculative.verify import (
    QMode,
    VerifyResult,
    greedy_walk,
    verify_seeded,
    verify_stochastic,
)

logger = logging.getLogger(__name__)


class NodeMasks(NamedTuple):
    """A constrained request's tree masks: one per kept node, and which nodes' paths completed
    the grammar (their rows need none: the request ends there)."""

    masks: torch.Tensor  # [nodes, ceil(V / 32)] bit masks
    ended: list[bool]  # [nodes]
    backend: object  # the grammar backend (its mask layout)


def _constrain(reqs: list[RunnerReq], trees: list[DraftTree], keep_numbering: bool
               ) -> tuple[list[DraftTree], list[NodeMasks | None]]:
    """Each constrained request's tree with the tokens its grammar forces added and the drafts
    it forbids dropped (specserve/runtime/constrained/tree_masks.py), and the masks of its nodes
    (None for a request without a grammar). Forced tokens (the tokenizer's own split of the one
    continuation the grammar allows) take the slots beyond the drafter's budget and are verified as
    any draft. The drafter's nodes keep their numbering where it reads it (`keep_numbering`,
    Lookahead's node argmax): no forced tokens, nothing dropped, and a forbidden subtree's rows stay
    unmasked (no path through a forbidden token is accepted). A constrained tree is verified as a
    deterministic drafter's (one-hot q is lossless for any tree; the grammar changed which of the
    drafter's sampled children remain)."""
    out_trees, masks = [], []
    for r, tree in zip(reqs, trees):
        if r.grammar is None:
            out_trees.append(tree)
            masks.append(None)
            continue
        tokens, parents = tree.token_list, tree.parents.tolist()
        if not keep_numbering:
            tokens, parents = add_chain(tokens, parents, r.grammar.forced_tokens(),
                                        r.fresh_slots.numel())
        kept, node_masks, ended = constrain_tree(r.grammar, tokens, parents)
        if keep_numbering:
            rows = torch.zeros(len(tokens), node_masks.shape[1], dtype=node_masks.dtype)
            rows[kept] = node_masks
            end = [True] * len(tokens)  # (a forbidden subtree's rows: left as they are)
            for k, u in enumerate(kept):
                end[u] = ended[k]
            out_trees.append(DraftTree.from_parents(tokens, parents))
            masks.append(NodeMasks(rows, end, r.grammar.backend))
            continue
        index = {u: k for k, u in enumerate(kept)}
        out_trees.append(DraftTree.from_parents([tokens[u] for u in kept],
                                                [-1] + [index[parents[u]] for u in kept[1:]]))
        masks.append(NodeMasks(node_masks, ended, r.grammar.backend))
    return out_trees, masks


def add_chain(tokens: list[int], parents: list[int], chain: list[int], cap: int
              ) -> tuple[list[int], list[int]]:
    """A tree (`tokens`, `parents`, topological order) with `chain` added below its root: the
    tree's own nodes keep their numbers (a drafter may have written draft KV at their slots),
    the chain shares the path where the tree holds it and takes new nodes after, at most `cap`
    nodes in all."""
    out_t, out_p = list(tokens), list(parents)
    child = {(p, t): u for u, (t, p) in enumerate(zip(tokens, parents)) if u}
    node = 0
    for t in chain:
        v = child.get((node, t))
        if v is None:
            if len(out_t) >= cap:
                break
            v = child[(node, t)] = len(out_t)
            out_t.append(t)
            out_p.append(node)
        node = v
    return out_t, out_p


def _mask_rows(out: ModelOutput, trees: list[DraftTree],
               masks: list[NodeMasks | None]) -> ModelOutput:
    """`out` (the step's rows, trees in request order) with every constrained node's row
    masked by the grammar state its own path reaches."""
    rows, chunks, off, backend = [], [], 0, None
    for tree, m in zip(trees, masks):
        if m is not None:
            keep = [k for k, e in enumerate(m.ended) if not e]
            rows += [off + k for k in keep]
            chunks.append(m.masks[keep])
            backend = m.backend
        off += tree.num_nodes
    if not rows:
        return out
    return apply_masks(out, rows, torch.cat(chunks), backend)


def trace_step(tree: DraftTree, res: VerifyResult, draft_s: float) -> SpecStep:
    """A traced request's verify step: its tree as verified, the outcome, and the drafter's
    probability of each node's token at its parent, where the drafter has a distribution."""
    probs = None
    if tree.draft_probs is not None:
        q = tree.draft_probs[tree.parents[1:], tree.tokens[1:]]  # [N - 1]
        probs = [1.0, *q.float().tolist()]
    return SpecStep(tree.token_list, tree.parents.tolist(), list(res.accepted_nodes),
                    res.bonus_token, probs, draft_s)


def _interpreted(runner) -> bool:
    """Whether the runner's attention kernel runs under Triton's CPU interpreter."""
    name = type(getattr(runner, "attn_backend", None)).__name__.lower()
    return "triton" in name and os.environ.get("TRITON_INTERPRET") == "1"


class SpeculativeWorker:
    """Drafts what the controller gave each request (its fresh KV slots, `RunnerReq.budget`),
    verifies every tree in one target forward and commits the accepted paths. It holds no
    estimate of its own: the scheduler's controller (specserve/speculative/controller.py) decides
    who drafts and learns from the `drafted` / `accepted` counts each step reports."""

    def __init__(self, cfg: SpecConfig, drafter: Drafter, runner,
                 verify_cost: VerifyCost | None = None) -> None:
        self.cfg = cfg
        self.drafter = drafter
        self.runner = runner
        if verify_cost is None:
            verify_cost = stored_verify_cost(getattr(runner, "engine", "torch"))
        # T(n)/T(1) (specserve/runtime/verify_cost.py): the curve measured on this machine at
        # start-up (`create`), else the engine's stored one; sent to the scheduler's controller and
        # shared with a drafter that cuts its own trees by cost
        self.verify_cost = verify_cost
        drafter.verify_cost = verify_cost
        # None: walk each tree in Python; else the registry's batched tree ops (tree_ops.py)
        self.tree_ops = make_tree_ops(cfg.tree_ops, getattr(runner, "device", "cpu"))

    @classmethod
    def create(cls, cfg: SpecConfig, runner, before_measure=None) -> SpeculativeWorker:
        """The worker of a server (or benchmark): its drafter, and the verify-cost curve
        measured on this machine now unless `--speculative-verify-cost` is `table` or a curve
        file (a curve measured once and handed to several servers). Call it before
        any request holds KV slots (the measurement writes scratch KV). `before_measure` is
        called just before the timing (the runner process waits there for its neighbours'
        start-up work to finish)."""
        from specserve.speculative.registry import create_drafter

        drafter = create_drafter(cfg, runner)
        measure = cfg.verify_cost == "measure"
        if measure and _interpreted(runner):
            # timing kernels that Triton's interpreter runs on the CPU says nothing about the
            # GPU they are written for (and takes minutes): use the stored table
            logger.info("verify cost: the stored table (the attention kernel runs under "
                        "TRITON_INTERPRET)")
            measure = False
        if measure and before_measure is not None:
            before_measure()
        cost = measure_verify_cost(runner) if measure else None
        if cfg.verify_cost not in ("measure", "table"):
            cost = load_verify_cost(cfg.verify_cost)
        return cls(cfg, drafter, runner, cost)

    # ---- what the runner asks of it (specserve/runtime/speculation.py: SpecWorker)
    # --------------------
    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.drafter.capture_layers if self.drafter.reads_target_hidden else ()

    @property
    def needs_final_hidden(self) -> bool:
        return self.drafter.needs_final_hidden

    @property
    def wants_committed_rows(self) -> bool:
        return self.drafter.wants_committed_rows

    def describe(self) -> str:
        return self.drafter.describe()

    def set_verify_cost(self, cost: VerifyCost) -> None:
        """The curve the scheduler's controller learned from the steps (it moved)."""
        self.verify_cost = self.drafter.verify_cost = cost

    def observe(self, rid: str, history: list[int], num_new: int) -> None:
        self.drafter.observe(rid, history, num_new)

    def draft_extend(self, rows: list[TargetRows], out: ModelOutput) -> None:
        self.drafter.draft_extend(rows, out)

    def release(self, rid: str) -> None:
        self.drafter.release(rid)

    def live_requests(self) -> int:
        return self.drafter.live_requests()

    def reset(self) -> None:
        """Forget everything learned (called on flush_cache, when no request runs)."""
        self.drafter.reset()

    # ---- one step -------------------------------------------------------------------------
    def step(self, reqs: list[RunnerReq], idle: bool = False,
             traffic_off: bool = False) -> tuple[list[list[int]], list[dict]]:
        """One decode step for `reqs` (each with this step's slots: its prefix, then `budget`
        fresh ones). `idle`: the controller expects no draft now or in the next few steps, so
        a step in which nobody may draft skips the drafter (no capture of target hidden
        states, no draft extend: `Drafter.skipped`); a drafter that reads no committed rows
        skips it whenever nobody may draft. `traffic_off`: drafting does not pay on the
        current traffic (a drafter may defer work that only serves drafting)."""
        self.drafter.traffic_off = traffic_off
        draftless = all(r.budget <= 1 and (r.grammar is None or r.fresh_slots.numel() <= 1)
                        for r in reqs)
        if draftless and (idle or not self.drafter.wants_committed_rows):
            return self._plain_step(reqs)
        t0 = time.perf_counter()
        trees = self.drafter.propose(reqs)
        grammar = None
        if any(r.grammar is not None for r in reqs):
            trees, grammar = _constrain(reqs, trees, self.drafter.wants_node_argmax)
        draft_s = time.perf_counter() - t0
        slots, tokens = [], []
        for r, tree in zip(reqs, trees):
            n = tree.num_nodes
            cap = r.fresh_slots.numel() if r.grammar is not None else max(r.budget, 1)
            assert 1 <= n <= cap, f"{r.rid}: a tree of {n} nodes, budget {r.budget}"
            tokens.append(tree.token_list)
            assert tokens[-1][0] == r.tokens[-1], "tree root must be the last token"
            slots.append(r.slots[: r.prefix_len + n])
        capture = self.capture_layers
        if all(len(t) == 1 for t in tokens):
            # nobody drafted: a plain decode step (no mask to build or apply)
            batch = ForwardBatch.build(ForwardMode.DECODE, tokens, slots,
                                       [r.prefix_len for r in reqs], capture_layers=capture)
        else:
            batch = ForwardBatch.build(
                ForwardMode.TARGET_VERIFY, tokens, slots, [r.prefix_len for r in reqs],
                positions=torch.tensor([r.prefix_len + d for r, t in zip(reqs, trees)
                                        for d in t.depth_list]),
                custom_masks=[t.ancestor_mask for t in trees], logits="all",
                capture_layers=capture,
            )
        batch.logit_top = logit_top(r.logprobs for r in reqs)
        if grammar is None:
            out = self.drafter.target_forward(batch, trees, self.drafter.needs_final_hidden)
        else:  # (the trees are no longer the drafter's: no draft-pass work to resume from)
            out = self.runner.forward(batch, self.drafter.needs_final_hidden)
            out = _mask_rows(out, trees, grammar)
        results = self._verify(reqs, trees, out.logits, out.argmax)  # logits [sum n, V]
        if self.drafter.wants_node_argmax and any(t.num_nodes > 1 for t in trees):
            am = out.row_argmax().tolist()
            per_req, off = [], 0
            for t in trees:
                per_req.append(am[off : off + t.num_nodes])
                off += t.num_nodes
            self.drafter.after_verify([r.rid for r in reqs], trees, per_req,
                                      [list(res.accepted_nodes) for res in results])
        reads_hidden = self.drafter.wants_committed_rows
        # the step's drafting time, shared out over its requests (the scheduler sums it)
        draft_share = draft_s / len(reqs)
        out_tokens, infos, rows = [], [], []
        off = 0
        for r, tree, res in zip(reqs, trees, results):
            self._commit(r, res)
            out_tokens.append(res.output_tokens)
            infos.append({"drafted": tree.num_nodes - 1, "accepted": len(res.accepted_tokens),
                          "draft_s": draft_share})
            if r.spec_trace and tree.num_nodes > 1:
                infos[-1]["trace"] = trace_step(tree, res, draft_s)
            if reads_hidden:  # root + accepted path: rows off + node, KV now in path order
                kept = r.slots[: r.prefix_len + len(res.accepted_nodes)]
                rows.append(TargetRows(r.rid, r.prefix_len, kept,
                                       off + torch.tensor(res.accepted_nodes), res.output_tokens,
                                       [r.tokens[-1], *res.accepted_tokens],
                                       list(res.accepted_nodes)))
            off += tree.num_nodes
        if reads_hidden:
            self.drafter.draft_extend(rows, out)
        starts = [0]
        for t in trees:
            starts.append(starts[-1] + t.num_nodes)
        self._logprobs(reqs, [res.accepted_nodes for res in results], out_tokens, out, starts,
                       infos)
        return out_tokens, infos

    def _plain_step(self, reqs: list[RunnerReq]) -> tuple[list[list[int]], list[dict]]:
        """One plain decode step for every request: the target's own forward and sampling,
        exactly what the speculative path gives a one-node tree. A batch of greedy requests
        without penalties takes the target's argmax as the non-speculative runner does."""
        batch = ForwardBatch.build(ForwardMode.DECODE, [[r.tokens[-1]] for r in reqs],
                                   [r.slots[: r.prefix_len + 1] for r in reqs],
                                   [r.prefix_len for r in reqs])
        batch.logit_top = logit_top(r.logprobs for r in reqs)
        out = self.runner.forward(batch, False)
        if any(r.grammar is not None for r in reqs):
            out = mask_output(out, [b for b, r in enumerate(reqs) if r.grammar is not None],
                              [r.grammar for r in reqs if r.grammar is not None])
        if self.tree_ops is None and all(r.params.takes_argmax for r in reqs):
            tokens = [[t] for t in out.row_argmax().tolist()]
        else:
            trees = [DraftTree.root(r.tokens[-1]) for r in reqs]
            tokens = [res.output_tokens for res in self._verify(reqs, trees, out.logits,
                                                                out.argmax)]
        self.drafter.skipped([r.rid for r in reqs])
        infos = [{"drafted": 0, "accepted": 0, "draft_s": 0.0} for _ in reqs]
        self._logprobs(reqs, [[0]] * len(reqs), tokens, out, list(range(len(reqs))), infos)
        return tokens, infos

    @staticmethod
    def _logprobs(reqs: list[RunnerReq], nodes: list[list[int]], tokens: list[list[int]],
                  out: ModelOutput, starts: list[int], infos: list[dict]) -> None:
        """infos[b]["logprobs"] for each request that asked: output token i came from the
        target's logits at accepted node nodes[b][i] (row starts[b] + node), the very row a
        plain decode step would have computed for it."""
        want = [(b, r.logprobs) for b, r in enumerate(reqs) if r.logprobs is not None]
        if not want:
            return
        rows = [starts[b] + u for b, _ in want for u in nodes[b][: len(tokens[b])]]
        payload = logprob_rows(out.logits, [t for b, _ in want for t in tokens[b]],
                               max(opts.top for _, opts in want), rows=rows,
                               stats=out.logit_stats)
        parts = split_rows(payload, [len(tokens[b]) for b, _ in want],
                           [opts.top for _, opts in want])
        for (b, _), part in zip(want, parts):
            infos[b]["logprobs"] = part

    def _verify(self, reqs: list[RunnerReq], trees: list[DraftTree], logits: torch.Tensor,
                raw_argmax: torch.Tensor | None = None) -> list[VerifyResult]:
        """logits [sum n, vocab]: the target at every node, trees in entry order; raw_argmax
        [sum n]: their argmax, where the engine found it (used unless penalties apply)."""
        sizes = [t.num_nodes for t in trees]
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        raw = logits
        logits = self._penalise(reqs, trees, logits, starts)
        params = [r.params for r in reqs]
        results: list[VerifyResult | None] = [None] * len(reqs)
        greedy = [b for b, p in enumerate(params) if p.is_greedy]
        if greedy:
            argmax = (raw_argmax if raw_argmax is not None and logits is raw
                      else argmax_rows(logits))  # [sum n]
            if self.tree_ops is not None:
                rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in greedy])
                res = self.tree_ops.walk_tokens([trees[b] for b in greedy],
                                                argmax[rows.to(argmax.device)])
                for b, r in zip(greedy, res):
                    results[b] = r
            else:
                am = argmax.cpu().tolist()
                for b in greedy:
                    if sizes[b] == 1:  # no draft: the target's own token
                        results[b] = VerifyResult([0], [], am[starts[b]])
                    else:  # (verify_greedy on the list: no tensor slice per request)
                        results[b] = greedy_walk(trees[b], am[starts[b] : starts[b + 1]])
        sampled = [b for b, p in enumerate(params) if not p.is_greedy]
        if not sampled:
            return results
        rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in sampled])
        info = SamplingBatchInfo.from_params([params[b] for b in sampled], logits.shape[-1],
                                             logits.device)
        probs = process_logits(logits[rows.to(logits.device)],
                               expand(info, [sizes[b] for b in sampled]))  # [rows, vocab] p
        local = {b: i for i, b in enumerate(sampled)}
        local_starts = torch.tensor([0] + [sizes[b] for b in sampled]).cumsum(0).tolist()
        draws = self._seeded_draws(reqs, trees, sampled, probs, local_starts)
        if self.tree_ops is not None:
            self._verify_sampled_ops(trees, sampled, local_starts, probs, draws, results)
            return results
        for b in sampled:
            lo, hi = local_starts[local[b]], local_starts[local[b] + 1]
            if b in draws:
                results[b] = verify_seeded(trees[b], draws[b])
                continue
            tree = trees[b]
            uniforms = torch.rand(hi - lo, dtype=torch.float64, device=probs.device)
            q_mode = QMode.ONE_HOT if tree.draft_probs is None else self.drafter.q_mode
            results[b] = verify_stochastic(
                tree, probs[lo:hi], uniforms, q_mode=q_mode,
                threshold_single=self.cfg.accept_threshold_single,
                threshold_acc=self.cfg.accept_threshold_acc,
            )
        return results

    def _verify_sampled_ops(self, trees: list[DraftTree], sampled: list[int],
                            local_starts: list[int], probs: torch.Tensor,
                            draws: dict[int, torch.Tensor], results: list) -> None:
        """The sampled requests through the batched tree ops: seeded ones in one walk over
        their draws, unseeded ones in one sampling op per q mode. The coins are drawn per
        request in batch order, as the per-tree walk draws them, so both forms give the same
        tokens for the same RNG state."""
        seeded = [b for b in sampled if b in draws]
        if seeded:
            res = self.tree_ops.walk_tokens([trees[b] for b in seeded],
                                            torch.cat([draws[b] for b in seeded]))
            for b, r in zip(seeded, res):
                results[b] = r
        groups: dict[QMode, list[tuple[int, int, torch.Tensor]]] = {}
        for j, b in enumerate(sampled):
            if b in draws:
                continue
            lo, hi = local_starts[j], local_starts[j + 1]
            uniforms = torch.rand(hi - lo, dtype=torch.float64, device=probs.device)
            q_mode = QMode.ONE_HOT if trees[b].draft_probs is None else self.drafter.q_mode
            groups.setdefault(QMode(q_mode), []).append((b, j, uniforms))
        for q_mode, members in groups.items():
            rows = torch.cat([torch.arange(local_starts[j], local_starts[j + 1])
                              for _, j, _ in members])
            res = self.tree_ops.sample(
                [trees[b] for b, _, _ in members], probs[rows.to(probs.device)],
                [u for _, _, u in members], q_mode,
                self.cfg.accept_threshold_single, self.cfg.accept_threshold_acc)
            for (b, _, _), r in zip(members, res):
                results[b] = r

    @staticmethod
    def _seeded_draws(reqs: list[RunnerReq], trees: list[DraftTree], sampled: list[int],
                      probs: torch.Tensor, local_starts: list[int]) -> dict[int, torch.Tensor]:
        """The target's Gumbel-max token at every node of each seeded request: node u at depth d
        draws the token at absolute position len(tokens) + d (the root sits at len(tokens) - 1).
        """
        seeded = [(j, b) for j, b in enumerate(sampled) if reqs[b].params.seed is not None]
        if not seeded:
            return {}
        rows, seeds, positions = [], [], []
        for j, b in seeded:
            n = trees[b].num_nodes
            rows.append(torch.arange(local_starts[j], local_starts[j] + n))
            seeds += [seed_to_int64(reqs[b].params.seed)] * n
            positions.append(len(reqs[b].tokens) + trees[b].depth)
        dev = probs.device
        tok = seeded_sample(probs[torch.cat(rows).to(dev)], torch.tensor(seeds),
                            torch.cat(positions)).cpu()  # [seeded rows]
        out, off = {}, 0
        for _, b in seeded:
            n = trees[b].num_nodes
            out[b] = tok[off : off + n]
            off += n
        return out

    @staticmethod
    def _penalise(reqs: list[RunnerReq], trees: list[DraftTree], logits: torch.Tensor,
                  starts: list[int]) -> torch.Tensor:
        """Penalised logits [sum n, vocab] for requests with penalties (others untouched): node
        u's history is the request's prompt + output (the root is its last output token) plus
        u's ancestors-or-self below the root, as plain decoding would have it after that path.
        """
        pen = [b for b, r in enumerate(reqs) if r.params.has_penalties]
        if not pen:
            return logits
        info = SamplingBatchInfo.from_params([reqs[b].params for b in pen], logits.shape[-1],
                                             logits.device)
        prompts, outputs = [reqs[b].prompt_ids for b in pen], [reqs[b].output_ids for b in pen]
        every_row = len(pen) == len(reqs)
        if all(trees[b].num_nodes == 1 for b in pen):  # one row per request: plain decoding's
            if every_row:
                return apply_penalties(logits, info, prompts, outputs)
            sel = torch.tensor(pen, device=logits.device)
            out = logits.clone()
            out[sel] = apply_penalties(logits[sel], info, prompts, outputs)
            return out
        rows, request, extra_rows, extra_tokens = [], [], [], []
        r = 0
        for j, b in enumerate(pen):
            t = trees[b]
            n = t.num_nodes
            rows.append(torch.arange(starts[b], starts[b] + n))
            request.append(torch.full((n,), j, dtype=torch.int64))
            node, token = t.path_tokens()  # the root is already the last output token
            extra_rows.append(r + node)
            extra_tokens.append(token)
            r += n
        info = expand(info, [trees[b].num_nodes for b in pen])
        hist = RowHistory(torch.cat(request), torch.cat(extra_rows), torch.cat(extra_tokens))
        if every_row:
            return apply_penalties(logits, info, prompts, outputs, hist)
        sel = torch.cat(rows).to(logits.device)
        out = logits.clone()
        out[sel] = apply_penalties(logits[sel], info, prompts, outputs, hist)
        return out

    def _commit(self, r: RunnerReq, res: VerifyResult) -> None:
        nodes = res.accepted_nodes
        if all(u == i for i, u in enumerate(nodes)):
            return  # root + nodes 1, 2, ...: their KV is where it was written (a chain's path)
        path = torch.tensor(nodes)
        moved = path != torch.arange(path.numel())
        if bool(moved.any()):
            base = r.slots[r.prefix_len :]
            self.runner.kv_pool.move(base[path[moved]], base[torch.nonzero(moved).flatten()])
