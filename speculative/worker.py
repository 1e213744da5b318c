"""One speculative decode step inside the model runner: draft → tree-masked verify → commit.

KV slots come from the scheduler: each request arrives with its prefix slots plus `budget`
fresh slots. Tree node i is written to fresh slot i; after verification the accepted path's KV
is moved to the first fresh slots in path order (commit by move), so the request's KV stays a
plain ordered slot list. The request gains `len(path)` tokens of KV (root + accepted drafts) and
`len(path)` output tokens (accepted drafts + the bonus token); the scheduler frees the other
fresh slots.

Verification sees, at every node, exactly what plain decoding would see after that node's path:
penalties (repetition / frequency / presence) are applied per node with the request's history
plus the node's ancestors (`runtime/sampling/penalties.py: RowHistory`), then greedy rows take
the argmax, sampled rows the processed distribution. Seeded requests are verified by their
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
from dataclasses import dataclass

import torch

from runtime.constrained.runner_grammars import mask_output
from runtime.model_runner.forward_batch import ForwardBatch, ForwardMode
from runtime.models.llama import ModelOutput
from runtime.sampling.argmax import argmax_rows
from runtime.sampling.logprobs import logit_top, logprob_rows, split_rows
from runtime.sampling.penalties import RowHistory, apply_penalties
from runtime.sampling.sampler import SamplingBatchInfo, expand, process_logits
from runtime.sampling.seeded import seed_to_int64, seeded_sample
from runtime.verify_cost import VerifyCost, measure_verify_cost, stored_verify_cost
from speculative.base import Drafter, SpecReq, TargetRows
from speculative.options import SpecConfig
from speculative.tree import DraftTree
from speculative.tree_ops import make_tree_ops
from speculative.verify import (
    QMode,
    VerifyResult,
    greedy_walk,
    verify_seeded,
    verify_stochastic,
)

logger = logging.getLogger(__name__)


@dataclass
class SpecReqState:
    # moving average of draft tokens accepted per verify step (optimistic start)
    accept_ema: float = 1.0
    steps_since_probe: int = 0
    probe_interval: int = 0  # steps between probes (0: the drafter's probe_every); doubles
    probe_bar: float | None = None  # set while a probe is out: the break-even it must beat
    global_probe: bool = False  # that probe is the server-wide one


@dataclass(slots=True)
class SpecEntry:
    rid: str
    tokens: list[int]  # history; tokens[-1] = root
    prefix_len: int
    slots: torch.Tensor  # [prefix_len + budget]
    state: object  # RunnerReqState: params, prompt_ids, output_ids (tokens[-1] = the root)

    @property
    def fresh(self) -> int:
        """Fresh KV slots the scheduler gave this step: tree nodes, root included (> 1: it
        may draft)."""
        return self.slots.numel() - self.prefix_len


def _grammar_masked(entries: list[SpecEntry], sizes: list[int],
                    out: ModelOutput) -> ModelOutput:
    """`out` (sizes[b] logits rows per request, in entry order) with the row of each request
    that follows a grammar masked by its matcher (runtime/constrained/runner_grammars.py), as
    plain decoding masks it. Such a request drafts nothing (budget 1): its one row is its
    root's, where its matcher stands."""
    rows, matchers, off = [], [], 0
    for e, n in zip(entries, sizes):
        matcher = getattr(e.state, "grammar", None)
        if matcher is not None:
            assert n == 1, f"{e.rid}: a request with a grammar drafted {n - 1} tokens"
            rows.append(off)
            matchers.append(matcher)
        off += n
    return mask_output(out, rows, matchers)


def _interpreted(runner) -> bool:
    """Whether the runner's attention kernel runs under Triton's CPU interpreter."""
    name = type(getattr(runner, "attn_backend", None)).__name__.lower()
    return "triton" in name and os.environ.get("TRITON_INTERPRET") == "1"


class SpeculativeWorker:
    def __init__(self, cfg: SpecConfig, drafter: Drafter, runner,
                 verify_cost: VerifyCost | None = None) -> None:
        self.cfg = cfg
        self.drafter = drafter
        self.runner = runner
        self.req_states: dict[str, SpecReqState] = {}
        # drafts accepted per drafting step over all requests: a new request starts from it,
        # so a drafter that rarely lands (a weak draft model) does not cost every new
        # request the ~15 steps its own average needs to fall below the threshold
        self.prior_accept = 1.0
        if verify_cost is None:
            verify_cost = stored_verify_cost(getattr(runner, "engine", "torch"))
        # T(n)/T(1) (runtime/verify_cost.py): the curve measured on this machine at start-up
        # (`worker_for`), else the engine's stored one; shared with the drafter (a drafter
        # that sizes its trees by cost reads it) and sent to the scheduler
        self.verify_cost = verify_cost
        drafter.verify_cost = verify_cost
        # None: walk each tree in Python; else the registry's batched tree ops (tree_ops.py)
        self.tree_ops = make_tree_ops(cfg.tree_ops, getattr(runner, "device", "cpu"))
        self.global_interval = drafter.probe_every  # steps between server-wide probes
        self.steps_since_global = 0
        # steps since any request had draft slots (`_off_step`); none seen yet: "long ago"
        self.steps_since_slots = self.SLOT_HORIZON + 1
        self.draft_cost: float | None = None  # extra seconds per drafting request (EMA)
        # plain step seconds / C(batch) (EMA), starting from the one-row forward timed at
        # start-up: a drafter that drafts from the first step (and keeps drafting while its
        # acceptance beats the floor) would otherwise never meet a plain step to compare
        # with, and its cost would stay unknown (EAGLE-3 drafted every step at 0.7x so)
        self.plain_t1: float | None = verify_cost.t1_s

    @classmethod
    def create(cls, cfg: SpecConfig, runner, before_measure=None) -> SpeculativeWorker:
        """The worker of a server (or benchmark): its drafter, and the verify-cost curve
        measured on this machine now unless `--speculative-verify-cost table`. Call it before
        any request holds KV slots (the measurement writes scratch KV). `before_measure` is
        called just before the timing (the runner process waits there for its neighbours'
        start-up work to finish)."""
        from speculative.base import create_drafter

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
        return cls(cfg, drafter, runner, cost)

    def release(self, rid: str) -> None:
        self.req_states.pop(rid, None)
        self.drafter.release(rid)

    def reset(self) -> None:
        """Forget everything learned (called on flush_cache, when no request runs)."""
        self.req_states.clear()
        self.prior_accept = 1.0
        self.drafter.reset()  # (the measured costs are kept: they describe the machine)

    # Backoff. On this CPU a verify pass of 8 nodes costs ~1.2x a decode step (docs/benchmarks.md),
    # so drafting pays while more than ~0.2 draft tokens are accepted per step on average.
    # Acceptance is bursty (nothing for a while, then a long copied run), so the average is slow
    # (about the last 10-20 drafting steps) and the decision binary: the full tree, or plain
    # decoding with a full-tree probe every `probe_every` steps (~2.5% overhead when nothing
    # fits). The threshold and the probe interval are the drafter's (`Drafter.min_accept_per_step`,
    # `probe_every`): a draft model's steps cost more than a trie lookup.
    #
    # What drafting costs, measured. A request that drafts makes the step longer by d seconds
    # (`draft_cost`: an EMA of a drafting step's whole time — drafting, the verify forward over
    # its extra rows, verification, commit — minus a plain step's at the same batch size,
    # shared over the requests that drafted) while it adds a accepted tokens to a batch of B
    # that yields B tokens per plain step of T(B) seconds; drafting pays only while
    # (B + a) / (T(B) + d) > B / T(B), i.e. a > B d / T(B) (`break_even`). T(B) = t1 * C(B)
    # with C the engine's verify-cost curve (runtime/scheduler/spec_budget.py) and t1 an EMA of
    # plain steps' time over C(B). Every overhead a draft brings is in d, whatever the
    # algorithm (a trie lookup's microseconds, a head's or a draft model's forwards, the verify
    # rows). The threshold is the larger of this and the drafter's floor; a backed-off request
    # probes every `probe_every * B` steps, so a batch probes about once per `probe_every`
    # steps whatever its size, and each probe that does not pay doubles the request's interval
    # (up to MAX_PROBE_INTERVAL; one that pays resets it): a drafter that never pays on this
    # text costs a few probes per request, not one every few steps. While the server-wide
    # average (`prior_accept`, which new requests start from) is below the bar too, the drafter
    # as a whole does not pay on the current traffic: requests stop probing on their own and
    # one server-wide probe (the request that waited longest) runs every `global_interval`
    # steps, doubling the same way. A short request then never pays a probe (for a draft model,
    # catching up its whole history), yet the drafter comes back when the traffic changes.
    EMA_WEIGHT = 0.1
    PRIOR_WEIGHT = 0.1
    COST_WEIGHT = 0.2
    MAX_PROBE_INTERVAL = 512

    def break_even(self, batch_size: int) -> float:
        """Accepted drafts per step a drafting request must average, at this batch size."""
        floor = self.drafter.min_accept_per_step
        if self.draft_cost is None or self.plain_t1 is None:
            return floor
        t_batch = self.plain_t1 * self.verify_cost(batch_size)
        return max(floor, batch_size * self.draft_cost / t_batch)

    def _global_probe(self, entries: list[SpecEntry]) -> str | None:
        """The request that probes for the whole server this step, if one is due."""
        if self.cfg.disable_adaptive or self.prior_accept >= self.break_even(len(entries)):
            return None
        self.steps_since_global += 1
        if self.steps_since_global < self.global_interval:
            return None
        # only a request the scheduler gave draft slots can probe; while none has them (the
        # load-aware budget keeps the batch plain) the probe stays due: a probe that could
        # not draft would teach nothing and postpone the next by a whole interval
        waiting = [(st.steps_since_probe, e.rid) for e in entries
                   if e.fresh > 1
                   and (st := self.req_states.get(e.rid)) is not None]
        if not waiting:
            return None
        self.steps_since_global = 0
        return max(waiting)[1]

    def _budget(self, e: SpecEntry, batch_size: int = 1,
                global_probe: str | None = None) -> tuple[int, bool]:
        """(tree nodes, root included, this request may draft this step; whether it is backed
        off, i.e. may draft only what its drafter is confident of)."""
        fresh = e.fresh
        if self.cfg.disable_adaptive:
            return fresh, False
        st = self.req_states.get(e.rid)
        if st is None:
            st = self.req_states[e.rid] = SpecReqState(accept_ema=self.prior_accept)
        bar = self.break_even(batch_size)
        if st.accept_ema >= bar:
            return fresh, False
        st.steps_since_probe += 1
        if self.prior_accept >= bar:  # the drafter pays in general: this request probes
            due = st.steps_since_probe >= (st.probe_interval or self.drafter.probe_every) \
                * batch_size
        else:  # it does not pay on the current traffic: only the server-wide probe
            due = e.rid == global_probe
        if due:
            st.steps_since_probe = 0
            st.probe_bar = bar
            st.global_probe = global_probe is not None and e.rid == global_probe
            return fresh, False
        if self.drafter.drafts_when_backed_off:
            return fresh, True
        return 1, False

    def _adapt(self, rid: str, drafted: int, accepted: int) -> None:
        st = self.req_states.get(rid)
        if st is None or self.cfg.disable_adaptive or drafted == 0:
            return  # no draft (no n-gram match): nothing learned, nothing paid
        st.accept_ema += self.EMA_WEIGHT * (accepted - st.accept_ema)
        self.prior_accept += self.PRIOR_WEIGHT * (accepted - self.prior_accept)
        if st.probe_bar is not None:  # a probe's outcome sets the next interval
            base = self.drafter.probe_every
            paid = accepted >= st.probe_bar
            if st.global_probe:
                self.global_interval = base if paid else min(2 * self.global_interval,
                                                             self.MAX_PROBE_INTERVAL)
            else:
                st.probe_interval = base if paid else min(2 * (st.probe_interval or base),
                                                          self.MAX_PROBE_INTERVAL)
            st.probe_bar = None

    # A `plain_without_budget` drafter (NGRAM, LOOKAHEAD) gets a plain step whenever no request
    # of the step may draft, whatever the traffic. Otherwise:
    # while the drafter as a whole does not pay on the current traffic (the server-wide regime
    # above), a step in which no request drafts and no server-wide probe is due within
    # WARM_STEPS runs as plain decoding for a `skips_when_off` drafter: no propose, no capture
    # of target hidden states, no draft extend (`_plain_step`). What a never-drafting EAGLE-3
    # server paid per step was that work plus its effect on the next forward (measured: ~0.3
    # ms outside the forward and ~0.2 ms inside a 3.2 ms decode step at batch 1,
    # `benchmark.profile_spec_step`). The WARM_STEPS steps before each server-wide probe run
    # the full path, so the probing request's head has fresh rows; the rows of skipped steps
    # never reach the head (a stale stretch of head KV: acceptance, never exactness). A probe
    # that is due waits for a request the scheduler gave draft slots (`_global_probe`), so the
    # warm steps run only while the scheduler hands slots out at all: some request of the last
    # SLOT_HORIZON steps had them (at c = 1 and 4 its per-request probes come every 16 and 64
    # steps, `spec_budget.PROBE_EVERY`; in a busy batch the load-aware plan keeps every request
    # plain and a request's probe would come after its whole life). Otherwise no request can
    # probe or draft and the step stays plain. (It was the full path, every step, for as long
    # as the probe stayed due: at c = 32 on ShareGPT ~90% of an off EAGLE-3's steps,
    # docs/benchmarks.md, "Eleventh session".)
    WARM_STEPS = 8
    SLOT_HORIZON = 64

    def _off_step(self, entries: list[SpecEntry], budgets: list[tuple[int, bool]]) -> bool:
        if any(e.fresh > 1 for e in entries):
            self.steps_since_slots = 0
        else:
            self.steps_since_slots += 1
        if self.drafter.plain_without_budget and all(b <= 1 for b, _ in budgets):
            return True  # nobody may draft: the step is plain whatever the traffic
        if not self.drafter.skips_when_off or self.cfg.disable_adaptive:
            return False
        if any(b != (1, False) for b in budgets):
            return False
        if self.prior_accept >= self.break_even(len(entries)):
            return False  # the drafter pays in general: requests probe on their own
        if self.global_interval - self.steps_since_global > self.WARM_STEPS:
            return True
        return self.steps_since_slots > self.SLOT_HORIZON

    def _plain_step(self, entries: list[SpecEntry],
                    t_step: float) -> tuple[list[list[int]], list[dict]]:
        """One plain decode step for every request (see `_off_step`): the target's own
        forward and sampling, exactly what the speculative path gives a one-node tree. A batch
        of greedy requests without penalties takes the target's argmax as the non-speculative
        runner does (what `_verify` gives a one-node tree, without building trees or
        verifying them; docs/benchmarks.md, "Tenth session")."""
        batch = ForwardBatch.build(ForwardMode.DECODE, [[e.tokens[-1]] for e in entries],
                                   [e.slots[: e.prefix_len + 1] for e in entries],
                                   [e.prefix_len for e in entries])
        batch.logit_top = logit_top(getattr(e.state, "logprobs", None) for e in entries)
        out = _grammar_masked(entries, [1] * len(entries), self.runner.forward(batch, False))
        if self.tree_ops is None and all(e.state.params.takes_argmax for e in entries):
            tokens = [[t] for t in out.row_argmax().tolist()]
        else:
            trees = [DraftTree.root(e.tokens[-1]) for e in entries]
            tokens = [r.output_tokens for r in self._verify(entries, trees, out.logits,
                                                            out.argmax)]
        self.drafter.skipped([e.rid for e in entries])
        self._measure(len(entries), 0, time.perf_counter() - t_step)
        infos = [{"drafted": 0, "accepted": 0, "draft_s": 0.0} for _ in entries]
        self._logprobs(entries, [[0]] * len(entries), tokens, out, list(range(len(entries))),
                       infos)
        return tokens, infos

    def step(self, entries: list[SpecEntry]) -> tuple[list[list[int]], list[dict]]:
        t_step = time.perf_counter()
        reqs = []
        probe = self._global_probe(entries)
        self.drafter.traffic_off = (not self.cfg.disable_adaptive and
                                    self.prior_accept < self.break_even(len(entries)))
        budgets = [(1, False) if getattr(e.state, "grammar", None) is not None
                   else self._budget(e, len(entries), probe) for e in entries]
        if self._off_step(entries, budgets):
            return self._plain_step(entries, t_step)
        for e, (budget, backed_off) in zip(entries, budgets):
            reqs.append(SpecReq(e.rid, e.tokens, budget, e.state.params,
                                prefix_slots=e.slots[: e.prefix_len], backed_off=backed_off,
                                fresh_slots=e.slots[e.prefix_len :]))
        t0 = time.perf_counter()
        trees = self.drafter.propose(reqs)
        draft_s = time.perf_counter() - t0
        slots, tokens = [], []
        for e, tree, r in zip(entries, trees, reqs):
            n = tree.num_nodes
            assert 1 <= n <= max(r.budget, 1), f"{e.rid}: drafter gave {n} nodes, budget {r.budget}"
            tokens.append(tree.token_list)
            assert tokens[-1][0] == e.tokens[-1], "tree root must be the last token"
            slots.append(e.slots[: e.prefix_len + n])
        capture = self.drafter.capture_layers
        if all(len(t) == 1 for t in tokens):
            # nobody drafted: a plain decode step (no mask to build or apply)
            batch = ForwardBatch.build(ForwardMode.DECODE, tokens, slots,
                                       [e.prefix_len for e in entries], capture_layers=capture)
        else:
            batch = ForwardBatch.build(
                ForwardMode.TARGET_VERIFY, tokens, slots, [e.prefix_len for e in entries],
                positions=torch.tensor([e.prefix_len + d for e, t in zip(entries, trees)
                                        for d in t.depth_list]),
                custom_masks=[t.ancestor_mask for t in trees], logits="all",
                capture_layers=capture,
            )
        batch.logit_top = logit_top(getattr(e.state, "logprobs", None) for e in entries)
        out = self.drafter.target_forward(batch, trees, self.drafter.needs_final_hidden)
        out = _grammar_masked(entries, [t.num_nodes for t in trees], out)
        results = self._verify(entries, trees, out.logits, out.argmax)  # logits [sum n, V]
        if self.drafter.wants_node_argmax and any(t.num_nodes > 1 for t in trees):
            am = out.row_argmax().tolist()
            per_req, off = [], 0
            for t in trees:
                per_req.append(am[off : off + t.num_nodes])
                off += t.num_nodes
            self.drafter.after_verify([e.rid for e in entries], trees, per_req,
                                      [list(r.accepted_nodes) for r in results])
        reads_hidden = self.drafter.wants_committed_rows
        # the step's drafting time, shared out over its requests (the scheduler sums it)
        draft_share = draft_s / len(entries)
        out_tokens, infos, rows = [], [], []
        off = 0
        for e, tree, res in zip(entries, trees, results):
            self._commit(e, res)
            drafted, accepted = tree.num_nodes - 1, len(res.accepted_tokens)
            self._adapt(e.rid, drafted, accepted)
            out_tokens.append(res.output_tokens)
            infos.append({"drafted": drafted, "accepted": accepted, "draft_s": draft_share})
            if reads_hidden:  # root + accepted path: rows off + node, KV now in path order
                kept = e.slots[: e.prefix_len + len(res.accepted_nodes)]
                rows.append(TargetRows(e.rid, e.prefix_len, kept,
                                       off + torch.tensor(res.accepted_nodes), res.output_tokens,
                                       [e.tokens[-1], *res.accepted_tokens],
                                       list(res.accepted_nodes)))
            off += tree.num_nodes
        if reads_hidden:
            self.drafter.draft_extend(rows, out)
        self._measure(len(trees), sum(1 for t in trees if t.num_nodes > 1),
                      time.perf_counter() - t_step)
        starts = [0]
        for t in trees:
            starts.append(starts[-1] + t.num_nodes)
        self._logprobs(entries, [r.accepted_nodes for r in results], out_tokens, out, starts,
                       infos)
        return out_tokens, infos

    @staticmethod
    def _logprobs(entries: list[SpecEntry], nodes: list[list[int]], tokens: list[list[int]],
                  out: ModelOutput, starts: list[int], infos: list[dict]) -> None:
        """infos[b]["logprobs"] for each request that asked: output token i came from the
        target's logits at accepted node nodes[b][i] (row starts[b] + node), the very row a
        plain decode step would have computed for it."""
        want = [(b, opts) for b, e in enumerate(entries)
                if (opts := getattr(e.state, "logprobs", None)) is not None]
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

    def _measure(self, batch_size: int, drafted: int, step_s: float) -> None:
        """Update the plain-step and draft-cost EMAs from one step's time (see `break_even`):
        `drafted` of its `batch_size` requests drafted."""
        w = self.COST_WEIGHT
        plain = None if self.plain_t1 is None else self.plain_t1 * self.verify_cost(batch_size)
        if not drafted:
            t = step_s / self.verify_cost(batch_size)
            self.plain_t1 = t if self.plain_t1 is None else self.plain_t1 + w * (
                t - self.plain_t1)
        elif plain is not None:
            d = max(0.0, step_s - plain) / drafted
            self.draft_cost = d if self.draft_cost is None else self.draft_cost + w * (
                d - self.draft_cost)

    def _verify(self, entries: list[SpecEntry], trees: list[DraftTree], logits: torch.Tensor,
                raw_argmax: torch.Tensor | None = None) -> list[VerifyResult]:
        """logits [sum n, vocab]: the target at every node, trees in entry order; raw_argmax
        [sum n]: their argmax, where the engine found it (used unless penalties apply)."""
        sizes = [t.num_nodes for t in trees]
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        raw = logits
        logits = self._penalise(entries, trees, logits, starts)
        params = [e.state.params for e in entries]
        results: list[VerifyResult | None] = [None] * len(entries)
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
        draws = self._seeded_draws(entries, trees, sampled, probs, local_starts)
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
    def _seeded_draws(entries: list[SpecEntry], trees: list[DraftTree], sampled: list[int],
                      probs: torch.Tensor, local_starts: list[int]) -> dict[int, torch.Tensor]:
        """The target's Gumbel-max token at every node of each seeded request: node u at depth d
        draws the token at absolute position len(tokens) + d (the root sits at len(tokens) - 1).
        """
        seeded = [(j, b) for j, b in enumerate(sampled) if entries[b].state.params.seed is not None]
        if not seeded:
            return {}
        rows, seeds, positions = [], [], []
        for j, b in seeded:
            n = trees[b].num_nodes
            rows.append(torch.arange(local_starts[j], local_starts[j] + n))
            seeds += [seed_to_int64(entries[b].state.params.seed)] * n
            positions.append(len(entries[b].tokens) + trees[b].depth)
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
    def _penalise(entries: list[SpecEntry], trees: list[DraftTree], logits: torch.Tensor,
                  starts: list[int]) -> torch.Tensor:
        """Penalised logits [sum n, vocab] for requests with penalties (others untouched): node
        u's history is the request's prompt + output (the root is its last output token) plus
        u's ancestors-or-self below the root, as plain decoding would have it after that path.
        """
        pen = [b for b, e in enumerate(entries) if e.state.params.has_penalties]
        if not pen:
            return logits
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
        sel = torch.cat(rows).to(logits.device)
        info = expand(SamplingBatchInfo.from_params([entries[b].state.params for b in pen],
                                                    logits.shape[-1], logits.device),
                      [trees[b].num_nodes for b in pen])
        hist = RowHistory(torch.cat(request), torch.cat(extra_rows), torch.cat(extra_tokens))
        out = logits.clone()
        out[sel] = apply_penalties(logits[sel], info, [entries[b].state.prompt_ids for b in pen],
                                   [entries[b].state.output_ids for b in pen], hist)
        return out

    def _commit(self, e: SpecEntry, res: VerifyResult) -> None:
        nodes = res.accepted_nodes
        if all(u == i for i, u in enumerate(nodes)):
            return  # root + nodes 1, 2, ...: their KV is where it was written (a chain's path)
        path = torch.tensor(nodes)
        moved = path != torch.arange(path.numel())
        if bool(moved.any()):
            base = e.slots[e.prefix_len :]
            self.runner.kv_pool.move(base[path[moved]], base[torch.nonzero(moved).flatten()])
