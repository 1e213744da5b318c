"""The scheduler: admission, continuous batching, chunked prefill, retraction, stop checks.

One `step()` forms one batch, sends it to the model runner (`run_batch`) and turns the result
into `TokenOut` messages (`emit`). It never runs the model and is the only writer of KV slot
bookkeeping (allocator, radix cache, each request's slot list). Feeding a request's pending
tokens is one rule for every phase: a step extends `fill_ids[kv_len:]` (all of them, or a chunk)
and, when the chunk reaches the end, samples the next token. Decode is the 1-pending case.

Batches are mixed: while prompts are being prefilled, every decoding request rides along with
one token (a prefill never pauses decoding), and the prompt chunks share the step's token budget
(`chunked_prefill_size`) with them. A step without prefill work is a decode step, where
speculative requests get draft-tree nodes as the speculation controller plans them (`spec`,
specserve/runtime/speculation.py: `SpecController`), one KV slot per node.

The runner keeps each request's slot list itself: an entry ships only the slots the runner does
not have yet (`slots_start`), so a step's message grows with the new tokens, not with the
requests' lengths.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from specserve.runtime.forward_batch import ForwardMode
from specserve.runtime.mem_cache.allocator import OutOfSlotsError, TokenSlotAllocator
from specserve.runtime.mem_cache.radix_cache import RadixCache
from specserve.runtime.messages import (
    GRAMMAR_END,
    GRAMMAR_REJECTED,
    AbortReq,
    BatchResult,
    FlushCacheReq,
    GenerateReq,
    GetInfoReq,
    InfoOut,
    ReqBatchEntry,
    RunBatch,
    TokenOut,
    TraceStep,
    pack_ints,
)
from specserve.runtime.sampling import logprobs as lp_payload
from specserve.runtime.scheduler.req import Req
from specserve.runtime.scheduler.stop import StopChecker
from specserve.runtime.speculation import SpecController, StepPlan
from specserve.runtime.verify_cost import MEASURE_PREFIX, VerifyCost

logger = logging.getLogger(__name__)
MAX_DESCRIBED = 64  # running requests /server_info lists, at most


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 32
    chunked_prefill_size: int = 512
    schedule_policy: str = "fcfs"  # fcfs | lpm
    # priority scheduling (SGLang's options): the queue is ordered by request priority first
    # (then by the policy above), and a waiting request more urgent than a running one by
    # more than `priority_preemption_threshold` levels takes its seat and KV (the running one
    # is retracted to the queue); by default a higher value is more urgent
    enable_priority_scheduling: bool = False
    low_priority_values_first: bool = False
    priority_preemption_threshold: int = 10
    # --max-queued-requests, enforced here under priority scheduling (SGLang's rule: a full
    # queue drops its least urgent request for a more urgent newcomer); otherwise the front
    # end bounds the queue, refusing whole requests before they start
    max_queued_requests: int | None = None
    disable_radix_cache: bool = False
    # a waiting request that shares at least this many uncached prompt tokens with a prompt
    # being prefilled waits until that prompt is cached, then prefills only the rest (SGLang's
    # in-batch prefix caching, same threshold); 0 = prefill such prompts side by side
    # (--shared-prefill-min-tokens)
    shared_prefill_min_tokens: int = 32
    # KV kept free for running requests' future tokens, as a fraction of their remaining budget
    decode_reserve_ratio: float = 0.3

    @classmethod
    def from_server_args(cls, server_args) -> SchedulerConfig:
        """The scheduler's part of resolved server args."""
        return cls(
            max_running_requests=server_args.max_running_requests,
            chunked_prefill_size=server_args.chunked_prefill_size,
            schedule_policy=server_args.schedule_policy,
            enable_priority_scheduling=server_args.enable_priority_scheduling,
            low_priority_values_first=server_args.schedule_low_priority_values_first,
            priority_preemption_threshold=server_args.priority_scheduling_preemption_threshold,
            max_queued_requests=server_args.max_queued_requests,
            disable_radix_cache=server_args.disable_radix_cache,
            shared_prefill_min_tokens=server_args.shared_prefill_min_tokens,
        )


def _grammar_finish(reason: dict | None, state: str, output_ids: list[int]) -> dict | None:
    """The finish reason after a step, given the request's grammar state: a complete grammar
    stops the request (its last token is the grammar's stop token, EOS, or with `ignore_eos`
    the token that completed it; "stop" rather than "length" when that was the last token
    allowed); a rejected token ends it as an abort."""
    if state == GRAMMAR_END and (reason is None or reason["type"] == "length"):
        return {"type": "stop", "matched": output_ids[-1], "keep": len(output_ids)}
    if state == GRAMMAR_REJECTED and reason is None:
        return {"type": "abort", "message": "the output could not continue its grammar",
                "keep": len(output_ids)}
    return reason


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        kv_capacity: int,
        stop_checker: StopChecker,
        run_batch: Callable[[RunBatch], BatchResult],
        emit: Callable[[object], None],
        spec: SpecController | None = None,
    ) -> None:
        """`spec`: the speculation controller (None: plain decoding)."""
        self.cfg = cfg
        self.spec = spec
        self._plan: StepPlan | None = None  # the controller's plan for the step being built
        self.allocator = TokenSlotAllocator(kv_capacity)
        self.cache = RadixCache(self.allocator, disable=cfg.disable_radix_cache)
        self.stop = stop_checker
        self.run_batch = run_batch
        self.emit = emit
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.live: dict[str, Req] = {}  # every waiting or running request, by id
        self.released: list[str] = []
        self.batch_id = 0
        self.totals = {"requests": 0, "finished": 0, "aborted": 0, "retracted": 0,
                       "prompt_tokens": 0, "generation_tokens": 0, "cached_tokens": 0,
                       "shared_prefill_waits": 0,  # requests that waited for a shared prefix
                       "preempted": 0,  # retracted for a more urgent request (priority)
                       "rejected": 0}  # refused by a full queue (priority scheduling)
        # speculative counters (vLLM names): verify steps, draft tokens, accepted, per position
        self.spec_totals = {"spec_verify_steps": 0, "spec_decode_num_draft_tokens": 0,
                            "spec_decode_num_accepted_tokens": 0, "spec_tokens_from_verify": 0,
                            "spec_draft_s": 0.0}  # drafting time, shared out over requests
        self.spec_accepted_per_pos: list[int] = []
        # what the runner last said it keeps per request (records, grammar matchers, drafter
        # state): all 0 once every request is released
        self.runner_held: dict[str, int] = {}

    # ---- messages from the tokenizer side ------------------------------------------------
    def handle(self, msg) -> None:
        if isinstance(msg, GenerateReq):
            req = Req(msg.rid, list(msg.input_ids), msg.sampling_params,
                      msg.stream, logprobs=msg.logprobs,
                      priority=msg.priority if self.cfg.enable_priority_scheduling else None,
                      grammar=msg.grammar, constrained=msg.grammar is not None,
                      spec_trace=[] if msg.spec_trace else None,
                      disable_speculation=msg.disable_speculation)
            if len(req.prompt_ids) >= self.stop.context_length or not req.prompt_ids:
                self._finish_now(req, {"type": "abort", "message": "prompt length invalid"})
                return
            if req.rid in self.live:
                # two live requests must never share an id: the runner keys its state by it
                self._finish_now(req, {"type": "abort",
                                       "message": f"request id {req.rid!r} is still running"})
                return
            if not self._queue_admits(req):
                return
            self.totals["requests"] += 1
            self.live[req.rid] = req
            self._enqueue(req)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            ok = self.idle
            if ok:
                self.cache.reset()
                if self.spec is not None:
                    self.spec.reset()
                # the drafter's learned state (e.g. the n-gram trie) is a cache too
                self.batch_id += 1
                self._run(RunBatch(batch_id=self.batch_id, mode=ForwardMode.DECODE.value,
                                        reqs=[], released_rids=self.released,
                                        reset_drafter=True))
                self.released = []
            self.emit(InfoOut(req_id=msg.req_id, info={"success": ok}))
        elif isinstance(msg, GetInfoReq):
            self.emit(InfoOut(req_id=msg.req_id, info=self.info()))

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def abort(self, rid: str) -> None:
        req = self.live.get(rid)
        if req is None:
            return  # finished already (or never known)
        if req not in self.running:
            self._abort_waiting(req, {"type": "abort"})
            return
        req.finish_reason = {"type": "abort"}
        self._retire(req)
        self.emit(self._token_out([req], {rid: 0}))

    def info(self) -> dict:
        return {
            "num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting),
            "kv_capacity": self.allocator.capacity, "kv_free": self.allocator.num_free,
            "kv_used_by_requests": self.allocator.num_used - self.cache.total_size,
            "radix_cache_tokens": self.cache.total_size,
            "kv_usage": self.allocator.num_used / self.allocator.capacity,
            **self.runner_held,
            **self.totals,
            **self._spec_info(),
            "running_requests": [self._describe(r) for r in self.running[:MAX_DESCRIBED]],
        }

    @staticmethod
    def _describe(req: Req) -> dict:
        """A running request as /server_info lists it (the playground's server view)."""
        accepted = sum(k * c for k, c in enumerate(req.spec_accept_hist))
        return {"rid": req.rid, "prompt_tokens": len(req.prompt_ids),
                "output_tokens": len(req.output_ids), "planned_nodes": req.planned_nodes,
                "disable_speculation": req.disable_speculation,
                "spec_verify_ct": req.spec_verify_ct, "spec_num_proposed_drafts":
                req.spec_drafted, "spec_num_correct_drafts": accepted}

    def _spec_info(self) -> dict:
        if self.spec is None:
            return {}
        t = self.spec_totals
        steps = max(t["spec_verify_steps"], 1)
        return {**t, "spec_decode_num_accepted_tokens_per_pos": list(self.spec_accepted_per_pos),
                "avg_spec_accept_length": t["spec_tokens_from_verify"] / steps,
                **self.spec.cost_info()}

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one batch if there is work; returns whether anything ran."""
        preempted = self._preempt() if self.cfg.enable_priority_scheduling else ()
        if self._has_prefill_work():
            # mixed: every decoding request gains one token while prompts are prefilled
            retracted = self.totals["retracted"]
            decode = self._decode_batch(speculate=False)
            # no admission in a step that just retracted: the KV it freed is for the others
            prefill = self._prefill_batch(self.cfg.chunked_prefill_size - len(decode),
                                          admit=retracted == self.totals["retracted"],
                                          held=preempted)
            entries = decode + prefill
            mode = ForwardMode.EXTEND if prefill else ForwardMode.DECODE
        else:
            entries = self._decode_batch(speculate=True)
            mode = ForwardMode.DECODE
        if not entries:
            self._send_releases()
            return False
        self.batch_id += 1
        plan = self._plan if mode == ForwardMode.DECODE else None
        curve = self.spec.curve_update() if plan is not None else None
        msg = RunBatch(
            batch_id=self.batch_id, mode=mode.value,
            reqs=[e for _, e, _ in entries], released_rids=self.released,
            drafter_idle=plan is not None and plan.idle,
            traffic_off=plan is not None and plan.traffic_off, speculative=plan is not None,
            verify_cost=curve.to_dict() if curve is not None else None,
        )
        self.released = []
        result = self._run(msg)
        assert result.batch_id == self.batch_id, "runner answered another batch"
        if plan is not None and result.spec_info is not None:
            forward = (result.forward_rows, result.target_s) if result.forward_rows else None
            self.spec.observe([req.spec for req, _, _ in entries], result.spec_info,
                              result.forward_s, forward)
        self._apply(entries, result)
        if self.idle:  # the last requests finished: the runner forgets them now, not later
            self._send_releases()
        return True

    def measure_when_idle(self) -> None:
        """With nothing to run: time the verify-cost curve again where the controller asks
        (its start-up measurement disagrees with what the steps show), over scratch KV
        slots lent to the runner for it."""
        if self.spec is None or not self.idle:
            return
        rows = self.spec.remeasure_rows()
        if not rows:
            return
        slots = self._alloc(MEASURE_PREFIX + max(rows))
        if slots is None:
            return
        self.batch_id += 1
        result = self._run(RunBatch(
            batch_id=self.batch_id, mode=ForwardMode.DECODE.value, reqs=[],
            released_rids=self.released, measure_rows=rows, measure_slots=pack_ints(slots)))
        self.released = []
        self.allocator.free(slots)
        if result.verify_cost is not None:
            self.spec.set_prior(VerifyCost.from_dict(result.verify_cost))

    def _run(self, msg: RunBatch) -> BatchResult:
        result = self.run_batch(msg)
        if result.held is not None:
            self.runner_held = result.held
        return result

    def _send_releases(self) -> None:
        """With nothing to run, tell the runner which requests it can forget now (their
        sampling state, drafter state and grammar matchers), not at the next batch."""
        if not self.released:
            return
        self.batch_id += 1
        self._run(RunBatch(batch_id=self.batch_id, mode=ForwardMode.DECODE.value, reqs=[],
                                released_rids=self.released))
        self.released = []

    def _alloc(self, n: int) -> torch.Tensor | None:
        if self.allocator.num_free < n:
            self.cache.evict(n - self.allocator.num_free)
        try:
            return self.allocator.alloc(n)
        except OutOfSlotsError:
            return None

    def _entry(self, req: Req, chunk: int, new_slots: torch.Tensor) -> tuple:
        start = req.kv_len
        known = min(req.runner_kv_len, start)  # the runner's table holds these slots already
        slots = torch.cat([req.kv_slots[known:], new_slots]) if known < start else new_slots
        entry = ReqBatchEntry(
            rid=req.rid, new_token_ids=req.fill_slice(start, start + chunk), prefix_len=start,
            kv_slots=pack_ints(slots), slots_start=known, needs_token=chunk == req.num_pending,
        )
        if not req.runner_knows:
            entry.sampling_params = req.params
            entry.prompt_ids = req.prompt_ids
            entry.logprobs = req.logprobs
            # the runner keeps it (and its matcher) until the request is released, retractions
            # included
            entry.grammar, req.grammar = req.grammar, None
            entry.spec_trace = req.spec_trace is not None
            req.runner_knows = True
        return req, entry, new_slots

    def _reserved(self, reqs: list[Req] | None = None) -> int:
        """KV kept for the future tokens of `reqs` (the running requests by default)."""
        return int(sum(
            (r.params.max_new_tokens - len(r.output_ids))
            for r in (self.running if reqs is None else reqs)
        ) * self.cfg.decode_reserve_ratio)

    def _has_prefill_work(self) -> bool:
        return any(r.num_pending > 1 for r in self.running) or (
            bool(self.waiting) and len(self.running) < self.cfg.max_running_requests)

    def _prefill_batch(self, budget: int, admit: bool = True,
                       held: Collection[Req] = ()) -> list[tuple]:
        """Prompt chunks within `budget` tokens: unfinished prefills first, then (if `admit`)
        new requests while KV headroom lasts, up to the first of `held` (requests preempted
        for this step's). At least one token goes to prefill per step, so a full decode batch
        cannot starve the queue."""
        budget = max(budget, 1)
        entries = []
        for req in self.running:  # unfinished chunked prefills first
            if req.num_pending > 1 and budget > 0:
                chunk = min(req.num_pending, budget)
                slots = self._alloc(chunk)
                if slots is None:
                    break
                entries.append(self._entry(req, chunk, slots))
                budget -= chunk
        if self.cfg.schedule_policy == "lpm" and len(self.waiting) > 1:
            # longest cached prefix first (within a priority level): reuse KV before it is
            # evicted
            order = sorted(self.waiting, key=lambda r: (self._rank(r), -len(
                self.cache.match_prefix(r.fill_ids[:-1]).slots)))
            self.waiting = deque(order)
        # prompts being prefilled: a waiting request that shares a long uncached prefix with
        # one waits (keeping its place) and takes that prefix from the cache a step later
        sharing = self._shared_prefill_check()
        deferred: list[Req] = []
        while admit and self.waiting and budget > 0 and \
                len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            if req in held:
                break  # (what it gave up is for the requests ahead of it)
            # keep >= 1 token to compute; prompt logprobs need their rows computed, not cached
            cacheable = self._cacheable(req)
            m = self.cache.match_prefix(req.fill_ids[:cacheable])
            if sharing is not None and sharing(req, m.slots.numel(), cacheable):
                if not req.waited_for_prefix:
                    req.waited_for_prefix = True
                    self.totals["shared_prefill_waits"] += 1
                deferred.append(self.waiting.popleft())
                if len(deferred) >= self.cfg.max_running_requests:
                    break  # (bounded work per step on a long queue of one prompt)
                continue
            pending = len(req.fill_ids) - m.slots.numel()
            chunk = min(pending, budget)
            headroom = self.allocator.num_free + self.cache.evictable_size - self._reserved()
            if chunk > headroom and self.running:
                break  # wait for running requests to finish
            self.cache.lock(m.node)
            req.kv_slots, req.cache_node, req.cache_len = m.slots.clone(), m.node, m.slots.numel()
            slots = self._alloc(chunk)
            if slots is None:
                self.cache.unlock(m.node)
                req.kv_slots, req.cache_node, req.cache_len = req.kv_slots[:0], None, 0
                break
            self.waiting.popleft()
            if req.num_retractions == 0:
                req.cached_tokens = req.cache_len
                self.totals["cached_tokens"] += req.cache_len
                self.totals["prompt_tokens"] += len(req.prompt_ids)
            self.running.append(req)
            entries.append(self._entry(req, chunk, slots))
            budget -= chunk
        self.waiting.extendleft(reversed(deferred))
        return entries

    def _shared_prefill_check(self):
        """A test `(req, cached, cacheable) -> bool`: whether the waiting `req`, whose first
        `cached` tokens are in the radix cache and first `cacheable` may come from it, shares
        at least `shared_prefill_min_tokens` more with the prompt of a running request that
        is not yet cached (`Req.prompt_cached`: still prefilling, or admitted in this very
        step, as `running` grows while the caller admits). That prompt goes to the cache
        once prefilled (`_cache_prompt`), so the waiting request prefills the shared part
        once instead of beside it: the samples of an `n` > 1 request, a burst of requests
        behind one system prompt. None when the check is off or the cache is disabled."""
        t = self.cfg.shared_prefill_min_tokens
        if t <= 0 or self.cache.disable:
            return None

        def shares(req: Req, cached: int, cacheable: int) -> bool:
            end = cached + t
            if end > cacheable:
                return False
            head = None
            for r in self.running:
                if r.prompt_cached or len(r.prompt_ids) < end:
                    continue
                if head is None:
                    head = req.fill_slice(0, end)
                if r.prompt_ids[:end] == head:
                    return True
            return False

        return shares

    @staticmethod
    def _cacheable(req: Req) -> int:
        """How many leading tokens of `fill_ids` may come from the radix cache: all but the
        last, and none from where the prompt's logprobs are wanted (the row at position q
        scores token q + 1) unless a retraction re-admits a request that had them already."""
        n = len(req.fill_ids) - 1
        lp = req.logprobs
        if lp is not None and lp.input_from is not None and req.num_retractions == 0:
            n = min(n, max(lp.input_from - 1, 0))
        return n

    def _decode_batch(self, speculate: bool) -> list[tuple]:
        self._plan = None
        decoding = [r for r in self.running if r.num_pending == 1]
        if not decoding:
            return []
        # (a controller whose drafter never drafts itself, JUMP_FORWARD, plans only steps with
        # a constrained request: the others are plain steps)
        speculate = speculate and self.spec is not None and (
            self.spec.base_nodes > 1 or any(r.constrained for r in decoding))
        plain = [i for i, r in enumerate(decoding) if r.disable_speculation] if speculate else ()
        speculate = speculate and len(plain) < len(decoding)
        tokens_per_req = self.spec.base_nodes if speculate else 1
        # retract before allocating anything, so no batch entry ever points at freed KV
        while (
            len(decoding) * tokens_per_req > self.allocator.num_free + self.cache.evictable_size
            and len(decoding) > 1
        ):
            # the least urgent, then the latest arrival (it loses least work)
            victim = max(decoding, key=lambda r: (self._rank(r), r.arrival))
            decoding.remove(victim)
            self._retract(victim)
        entries = []
        sizes, confident = [1] * len(decoding), [False] * len(decoding)
        drafts = [0] * len(decoding)  # (0: every slot)
        explore = [False] * len(decoding)
        if speculate:
            for r in decoding:
                if r.spec is None:
                    r.spec = self.spec.new_request(r.constrained)
            self._plan = self.spec.plan([r.spec for r in decoding])
            sizes, confident = self._plan.sizes, self._plan.confident
            drafts = self._plan.drafts or drafts
            explore = self._plan.explore or explore
            if plain:  # (the controller learns nothing from a step without a draft)
                sizes, confident, drafts = list(sizes), list(confident), list(drafts)
                for i in plain:
                    sizes[i], confident[i], drafts[i] = 1, False, 0
        for req, n, sure, k, x in zip(decoding, sizes, confident, drafts, explore):
            req.planned_nodes = n
            # never draft past the context length: the tree's positions must exist
            room = self.stop.context_length - req.kv_len
            slots = None
            if n > tokens_per_req:  # a deep draft only from truly free slots
                slots = self._alloc(min(n, room)) if self.allocator.num_free >= n else None
            if slots is None:
                slots = self._alloc(max(1, min(n, tokens_per_req, room)))
            if slots is None:
                raise RuntimeError("KV cache too small for a single request")
            entries.append(self._entry(req, 1, slots))
            entries[-1][1].confident_only = sure
            entries[-1][1].draft_nodes = min(k, slots.numel())
            entries[-1][1].explore = x
        return entries

    def _retract(self, req: Req, why: str = "KV cache full") -> None:
        logger.info("%s: retracting %s (%d tokens) to the queue", why, req.rid, req.kv_len)
        self.totals["retracted"] += 1
        self.running.remove(req)
        self._free_kv(req)
        req.runner_kv_len = 0  # its slots are gone; re-admission ships the whole new list
        req.prompt_cached = False
        req.num_retractions += 1
        self._enqueue(req, front=True)

    # ---- priority ------------------------------------------------------------------------
    def _rank(self, req: Req) -> float:
        """Urgency as a sort key: smaller runs first. A request without a priority (every
        request without priority scheduling) ranks last, as SGLang ranks it: behind every
        priority, and preempted by any request that has one."""
        if req.priority is None:
            return math.inf
        return req.priority if self.cfg.low_priority_values_first else -req.priority

    def _enqueue(self, req: Req, front: bool = False) -> None:
        """Queue `req`: behind its priority level's requests, or (`front`, a retracted request:
        it arrived before them) ahead of them. Without priority scheduling every request has
        one level, so that is the back or the front of the queue."""
        if not self.cfg.enable_priority_scheduling:
            (self.waiting.appendleft if front else self.waiting.append)(req)
            return
        rank = self._rank(req)
        q = self.waiting
        if not q or (not front and self._rank(q[-1]) <= rank):
            q.append(req)  # (the common case, in O(1): a batch's sequences arrive in a row)
            return
        if front and self._rank(q[0]) >= rank:
            q.appendleft(req)
            return
        for i, other in enumerate(self.waiting):
            if self._rank(other) > rank or (front and self._rank(other) == rank):
                self.waiting.insert(i, req)
                return
        self.waiting.append(req)

    def _abort_waiting(self, req: Req, reason: dict) -> None:
        self.waiting.remove(req)
        del self.live[req.rid]
        self._release(req)
        self.totals["aborted"] += 1
        self._finish_now(req, reason)

    def _queue_admits(self, req: Req) -> bool:
        """--max-queued-requests under priority scheduling, as SGLang applies it: when the
        queue beyond the free seats is full, the least urgent waiting request (the latest of
        them) is aborted for a strictly more urgent newcomer, else the newcomer is refused.
        Either finishes as an abort with status 503 and SGLang's message; the front end
        answers a refusal with HTTP 503 "The request queue is full."."""
        limit = self.cfg.max_queued_requests
        if not self.cfg.enable_priority_scheduling or limit is None:
            return True
        free_seats = max(self.cfg.max_running_requests - len(self.running), 0)
        if len(self.waiting) - free_seats < limit:
            return True
        victim = max(self.waiting, key=lambda r: (self._rank(r), r.arrival), default=None)
        if victim is not None and self._rank(req) < self._rank(victim):
            logger.info("queue full: %s (priority %s) aborted for %s (priority %s)",
                        victim.rid, victim.priority, req.rid, req.priority)
            self._abort_waiting(victim, {"type": "abort", "status_code": 503, "message":
                                         "The request is aborted by a higher priority request."})
            return True
        self.totals["rejected"] += 1
        self._finish_now(req, {"type": "abort", "status_code": 503,
                               "message": "The request queue is full."})
        return False

    def _preempt(self) -> list[Req]:
        """Priority preemption (SGLang's): before a step is built, retract running requests
        that the queue's most urgent requests outrank by more than the threshold, the least
        urgent (then the latest) first, so that those requests are admitted in this step.

        The queue is walked in order, as admission will walk it, with the step's prefill
        budget: a request that a free seat and free KV already admit takes them; one that
        does not takes victims' seats and KV while it outranks them, and nothing is retracted
        for a request that victims cannot make room for (nor for any behind it). A retracted
        request keeps its outputs and resumes from the prefix cache, which holds its KV; it is
        not re-admitted in the step it gave its room up for. Returns the retracted requests."""
        if not self.waiting or not self.running:
            return []
        threshold = self.cfg.priority_preemption_threshold
        candidates = sorted(self.running, key=lambda r: (self._rank(r), r.arrival))
        if not self._rank(candidates[-1]) - self._rank(self.waiting[0]) > threshold:
            return []  # the most urgent waiting request outranks no one: no one behind it does
        seats = self.cfg.max_running_requests - len(self.running)
        headroom = self.allocator.num_free + self.cache.evictable_size - self._reserved()
        budget = max(self.cfg.chunked_prefill_size - len(self.running), 1)  # (as admission's)
        victims: list[Req] = []
        for req in self.waiting:
            if budget <= 0:
                break
            # what admission would allocate: the uncached part, within the step's budget
            cached = self.cache.match_prefix(req.fill_ids[:self._cacheable(req)]).slots.numel()
            need = min(len(req.fill_ids) - cached, max(budget, 1))
            chosen: list[Req] = []
            while (seats < 1 or need > headroom) and candidates and \
                    self._rank(candidates[-1]) - self._rank(req) > threshold:
                v = candidates.pop()
                chosen.append(v)
                seats += 1
                # its KV goes to the cache (evictable) and its reserve is released
                headroom += v.kv_len - v.cache_len + self._reserved([v])
            if seats < 1 or need > headroom:
                candidates.extend(reversed(chosen))  # no room even so: leave them running
                break
            victims += chosen
            seats -= 1
            headroom -= need
            budget -= need
        for v in victims:
            self.totals["preempted"] += 1
            self._retract(v, why=f"priority {v.priority} preempted")
        return victims

    def _free_kv(self, req: Req) -> None:
        fill = req.fill_ids
        self.cache.cache_finished(fill[: req.kv_len], req.kv_slots, req.cache_node, req.cache_len)
        req.kv_slots, req.cache_node, req.cache_len = req.kv_slots[:0], None, 0

    def _apply(self, entries: list[tuple], result: BatchResult) -> None:
        got: dict[str, int] = {}
        out_reqs = []
        spec_info = result.spec_info or [None] * len(entries)
        lps = result.logprobs or [None] * len(entries)
        grammar = result.grammar_states or [""] * len(entries)
        for (req, entry, new_slots), tokens, spec, lp, gs in zip(
                entries, result.next_token_ids, spec_info, lps, grammar):
            # a prefill chunk keeps all its slots; a (speculative) decode step keeps one per
            # token gained (root + accepted drafts) and frees the rest of its tree's slots
            num_new = new_slots.numel()
            keep_slots = len(tokens) if entry.needs_token and len(entry.new_token_ids) == 1 \
                else num_new
            if keep_slots >= num_new:  # (no slices to take: torch ops are dear between forwards)
                req.kv_slots = torch.cat([req.kv_slots, new_slots])
            else:
                req.kv_slots = torch.cat([req.kv_slots, new_slots[:keep_slots]])
                self.allocator.free(new_slots[keep_slots:])
            req.runner_kv_len = req.kv_len  # the runner's table: these, then the freed ones
            if not req.prompt_cached and req.kv_len >= len(req.prompt_ids):
                self._cache_prompt(req)
            if lp:
                req.pending_logprobs = lp if req.pending_logprobs is None else \
                    lp_payload.concat([req.pending_logprobs, lp])
            if not tokens:
                continue
            req.output_ids.extend(tokens)
            reason = _grammar_finish(self.stop.check(req, len(tokens)), gs, req.output_ids)
            n_new = len(tokens)
            if reason is not None:
                keep = reason.pop("keep")
                n_new -= len(req.output_ids) - keep
                del req.output_ids[keep:]
                req.finish_reason = reason
                self._trim_kv(req)
            # count what the request keeps, after a stop cut the step's tokens short
            self.totals["generation_tokens"] += n_new
            if spec is not None:
                self._count_spec(req, spec, n_new)
            got[req.rid] = n_new
            if req.spec_trace is not None:
                self._trace(req, n_new, result)
            out_reqs.append(req)
        for req in out_reqs:
            if req.finished:
                self._retire(req)
        if out_reqs:
            self.emit(self._token_out(out_reqs, got))

    def _cache_prompt(self, req: Req) -> None:
        """Once its prompt is prefilled, a request hands the prompt's KV to the radix cache
        (protocol step 5) instead of at its end, so a request with the same prompt, or a
        prefix of it, admitted while this one still decodes prefills only the rest: the other
        samples of an `n` > 1 request (the front end starts them once the first has its
        first token), a system prompt under concurrent load. Only when nothing else cached
        a longer part of the prompt meanwhile: then the cache takes exactly the request's own
        slots, and the runner's slot table stays as it is (otherwise the request keeps its
        slots and `cache_finished` frees the duplicates at the end, as before)."""
        req.prompt_cached = True
        prompt = req.prompt_ids
        if self.cache.disable or req.cache_len >= len(prompt) or \
                self.cache.match_prefix(prompt).slots.numel() != req.cache_len:
            return
        m = self.cache.cache_unfinished(prompt, req.kv_slots[: len(prompt)], req.cache_node,
                                        req.cache_len)
        assert torch.equal(m.slots, req.kv_slots[: len(prompt)]), "the cache took other slots"
        req.cache_node, req.cache_len = m.node, m.slots.numel()

    def _trim_kv(self, req: Req) -> None:
        """After a stop cut the output short, drop KV of tokens past the new end."""
        limit = len(req.prompt_ids) + len(req.output_ids) - 1
        if req.kv_len > limit:
            self.allocator.free(req.kv_slots[limit:])
            req.kv_slots = req.kv_slots[:limit]

    def _count_spec(self, req: Req, spec: dict, num_tokens: int) -> None:
        t = self.spec_totals
        t["spec_verify_steps"] += 1
        t["spec_decode_num_draft_tokens"] += spec["drafted"]
        t["spec_decode_num_accepted_tokens"] += spec["accepted"]
        t["spec_tokens_from_verify"] += num_tokens
        t["spec_draft_s"] += spec.get("draft_s", 0.0)
        acc = spec["accepted"]
        if len(self.spec_accepted_per_pos) < acc:
            self.spec_accepted_per_pos += [0] * (acc - len(self.spec_accepted_per_pos))
        for pos in range(acc):
            self.spec_accepted_per_pos[pos] += 1
        req.spec_verify_ct += 1
        req.spec_drafted += spec["drafted"]
        if len(req.spec_accept_hist) <= acc:
            req.spec_accept_hist += [0] * (acc + 1 - len(req.spec_accept_hist))
        req.spec_accept_hist[acc] += 1

    @staticmethod
    def _trace(req: Req, n_new: int, result: BatchResult) -> None:
        start = len(req.output_ids) - n_new
        tree = result.spec_trace.get(req.rid) if result.spec_trace else None
        req.spec_trace.append(TraceStep(start, req.output_ids[start:], result.forward_s,
                                        len(result.next_token_ids), tree))

    @staticmethod
    def _take_trace(req: Req) -> list[TraceStep] | None:
        steps = req.spec_trace
        if not steps:
            return None
        req.spec_trace = []
        return steps

    def _retire(self, req: Req) -> None:
        self.running.remove(req)
        del self.live[req.rid]
        self._free_kv(req)
        self._release(req)
        self.totals["aborted" if req.finish_reason["type"] == "abort" else "finished"] += 1

    def _release(self, req: Req) -> None:
        if req.runner_knows:
            self.released.append(req.rid)

    def _finish_now(self, req: Req, reason: dict) -> None:
        req.finish_reason = reason
        self.emit(self._token_out([req], {req.rid: 0}))

    def _token_out(self, reqs: list[Req], got: dict[str, int]) -> TokenOut:
        metas = []
        for r in reqs:
            meta = {}
            if r.finished:
                meta = {"prompt_tokens": len(r.prompt_ids),
                        "completion_tokens": len(r.output_ids),
                        "cached_tokens": r.cached_tokens}
                if r.spec_verify_ct:
                    accepted = sum(k * c for k, c in enumerate(r.spec_accept_hist))
                    meta.update(
                        spec_verify_ct=r.spec_verify_ct,
                        # SGLang's definition: completion tokens per verify step
                        spec_accept_length=len(r.output_ids) / r.spec_verify_ct,
                        spec_accept_rate=accepted / max(r.spec_drafted, 1),
                        spec_num_correct_drafts=accepted,
                        spec_num_proposed_drafts=r.spec_drafted,
                        spec_accept_histogram=r.spec_accept_hist,
                    )
            metas.append(meta)
        logprobs = None
        if any(r.logprobs is not None for r in reqs):
            logprobs = []
            for r in reqs:  # the step's payload, its output part cut where a stop cut tokens
                pending, r.pending_logprobs = r.pending_logprobs, None
                logprobs.append(None if pending is None else
                                lp_payload.head(pending, got[r.rid]))
        spec_trace = None
        if any(r.spec_trace for r in reqs):
            spec_trace = [self._take_trace(r) for r in reqs]
        return TokenOut(
            spec_trace=spec_trace,
            rids=[r.rid for r in reqs],
            new_token_ids=[r.output_ids[len(r.output_ids) - got[r.rid]:] if got[r.rid] else []
                           for r in reqs],
            finish_reasons=[r.finish_reason for r in reqs],
            meta_infos=metas,
            logprobs=logprobs,
        )

    def check_no_leak(self) -> None:
        """Idle invariant: every slot is free or held by the radix cache."""
        assert self.idle and not self.live, "requests still running"
        self.cache.check_integrity()
        assert self.allocator.num_free + self.cache.total_size == self.allocator.capacity, (
            f"KV leak: {self.allocator.num_free} free + {self.cache.total_size} cached "
            f"!= {self.allocator.capacity}"
        )
