"""The model-runner process: receives `RunBatch`, runs one step, replies `BatchResult`.

It keeps one record per request (`RunnerReq`, specserve/runtime/model_runner/req.py) with what the
scheduler does not need: sampling parameters and the token history (penalties, drafters, and the
position a seeded request's next draw is keyed by), and a copy of each request's slot list,
updated from the slots each entry ships (`slots_start`). KV *tensors* live here; which slot
means what is the scheduler's.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import traceback

import torch
import zmq

from specserve.runtime.constrained import create_backend
from specserve.runtime.constrained.runner_grammars import (
    RunnerGrammars,
    advance,
    finite_logprobs,
    mask_output,
)
from specserve.runtime.errors import SpecserveError
from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.ipc import Receiver, Sender, ipc_addr
from specserve.runtime.messages import (
    GRAMMAR_REJECTED,
    TO_RUNNER,
    BatchResult,
    RunBatch,
    RunnerError,
    RunnerReady,
    ShutdownReq,
    unpack_ints,
)
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from specserve.runtime.model_runner.req import RunnerReq
from specserve.runtime.models.llama import ModelOutput
from specserve.runtime.proc_utils import (
    HeapTrimmer,
    die_with_parent,
    parent_alive,
    setup_logging,
    thread_locks_for_progress_bars,
)
from specserve.runtime.sampling.logprobs import logit_top, logprob_rows, split_rows
from specserve.runtime.sampling.sampler import SamplingBatchInfo, sample
from specserve.runtime.speculation import Speculation, SpecWorker, TargetRows
from specserve.runtime.verify_cost import VerifyCost, measure_verify_cost

logger = logging.getLogger(__name__)


class RunnerWorker:
    """Executes batches on a `ModelRunner`; separate from the process loop so tests can call it.

    With a speculative worker (specserve/runtime/speculation.py: `SpecWorker`), a decode batch is a
    speculative step (draft → verify → commit) for the slots each entry got; everything else is
    plain. A drafter that reads target hidden states (EAGLE) gets every prefill chunk's rows
    through `draft_extend`, so its own KV covers every committed position from the first step.
    """

    def __init__(self, runner: ModelRunner, spec: SpecWorker | None = None,
                 grammars: RunnerGrammars | None = None) -> None:
        self.runner = runner
        self.spec = spec
        self.grammars = grammars
        self.states: dict[str, RunnerReq] = {}

    def _state(self, entry) -> RunnerReq:
        st = self.states.get(entry.rid)
        if st is not None and entry.sampling_params is not None:
            # only a request's first entry carries its params: a state under the same id is a
            # finished or aborted request's whose release has not reached us; it must not leak
            # its tokens, slots or draft state into the new one
            logger.warning("%s: a new request replaces a stale state of the same id", entry.rid)
            self._release(entry.rid)
            st = None
        if st is None:
            assert entry.sampling_params is not None, f"{entry.rid}: first batch lacks params"
            st = RunnerReq(entry.rid, entry.sampling_params, list(entry.prompt_ids or []),
                           logprobs=entry.logprobs, spec_trace=entry.spec_trace)
            if entry.grammar is not None:
                assert self.grammars is not None, f"{entry.rid}: a grammar, and no backend"
                st.grammar_loading = self.grammars.load(entry.grammar)  # (in the background)
            self.states[entry.rid] = st
            if self.spec is not None and st.prompt_ids:
                self.spec.observe(entry.rid, st.tokens, len(st.tokens))
        return st

    @staticmethod
    def _slots(entry, st: RunnerReq) -> torch.Tensor:
        """The entry's whole slot list [prefix_len + new]: the runner's table up to
        `slots_start`, then the shipped slots (the scheduler's list, in the same order)."""
        new = unpack_ints(entry.kv_slots)
        start = entry.slots_start
        held = st.slots.numel()
        assert start <= held, f"{entry.rid}: slots from {start}, the runner holds {held}"
        if not start:
            st.slots = new
        else:  # (no slice when it holds exactly the prefix: a decode step's case)
            st.slots = torch.cat([st.slots if start == held else st.slots[:start], new])
        assert st.slots.numel() > entry.prefix_len, f"{entry.rid}: no slot for a new token"
        return st.slots

    def _release(self, rid: str) -> None:
        self.states.pop(rid, None)  # (its grammar matcher with it)
        if self.spec is not None:
            self.spec.release(rid)

    def _append(self, st: RunnerReq, tokens: list[int]) -> str:
        """Commit sampled tokens (in place: a grammar that completes inside a speculative
        step's tokens keeps those up to its end); the request's grammar state after them
        (specserve/runtime/messages.py: BatchResult.grammar_states)."""
        state = ""
        if st.grammar_failed:
            state = GRAMMAR_REJECTED
        elif st.grammar is not None:
            kept, state = advance(st.grammar, tokens)
            del tokens[kept:]
        st.append(tokens)
        if self.spec is not None:
            self.spec.observe(st.rid, st.tokens, len(tokens))
        return state

    def _matchers(self, rid: str, st: RunnerReq) -> None:
        """The request's matcher, once its grammar has loaded (waiting for it if need be: it
        loads while the step's forward runs). A grammar that cannot load ends the request."""
        if st.grammar_loading is None:
            return
        loading, st.grammar_loading = st.grammar_loading, None
        try:
            st.grammar = self.grammars.matcher(loading)
        except Exception:  # noqa: BLE001 - one request's grammar must not stop the server
            logger.exception("%s: its grammar did not load", rid)
            st.grammar_failed = True

    def _mask(self, fwd: ModelOutput, rids: list[str], states: list[RunnerReq],
              rows: list[int]) -> ModelOutput:
        """`fwd` with the logits rows `rows` of constrained requests masked by their grammars."""
        masked, matchers = [], []
        for rid, st, row in zip(rids, states, rows):
            self._matchers(rid, st)
            if st.grammar is not None:
                masked.append(row)
                matchers.append(st.grammar)
        return mask_output(fwd, masked, matchers)

    def _run_spec(self, msg: RunBatch, states: list[RunnerReq], t0: float) -> BatchResult:
        for e, st in zip(msg.reqs, states):
            self._matchers(e.rid, st)
            st.prefix_len, st.confident_only = e.prefix_len, e.confident_only
            st.budget = e.draft_nodes or st.slots.numel() - e.prefix_len
            st.explore = e.explore
        out, infos = self.spec.step(states, idle=msg.drafter_idle, traffic_off=msg.traffic_off)
        grammar = [self._append(st, toks) for st, toks in zip(states, out)]
        lps = [info.pop("logprobs", None) for info in infos]
        lps = [finite_logprobs(lp) if st.grammar is not None else lp
               for lp, st in zip(lps, states)]
        traces = None
        if any(st.spec_trace for st in states):
            traces = {st.rid: info.pop("trace") for st, info in zip(states, infos)
                      if "trace" in info}
        return BatchResult(batch_id=msg.batch_id, next_token_ids=out, spec_info=infos,
                           forward_s=time.perf_counter() - t0,
                           logprobs=lps if any(p is not None for p in lps) else None,
                           grammar_states=grammar if any(grammar) else None,
                           spec_trace=traces)

    def _measure(self, msg: RunBatch) -> BatchResult:
        """The verify-cost curve timed now, over the scratch slots the scheduler lent."""
        slots = unpack_ints(msg.measure_slots)
        cost = measure_verify_cost(self.runner, ns=tuple(msg.measure_rows), slots=slots,
                                   when="again while idle")
        logger.info("verify cost T(n)/T(1) measured again (%s): %s", cost.source, ", ".join(
            f"{n}: {r:.2f}" for n, r in zip(cost.rows, cost.ratios)))
        return BatchResult(batch_id=msg.batch_id, next_token_ids=[],
                           verify_cost=cost.to_dict())

    @staticmethod
    def _prefill_rows(msg: RunBatch, states: list[RunnerReq],
                      slots: list[torch.Tensor]) -> list[TargetRows]:
        """Every row of a prefill chunk is committed; the token after its last row is the next
        prompt token, or the one just sampled when the chunk ends the prompt."""
        rows, off = [], 0
        for e, st, s in zip(msg.reqs, states, slots):
            n = len(e.new_token_ids)
            history = st.tokens
            nxt = history[e.prefix_len + 1 : e.prefix_len + n + 1]
            assert len(nxt) == n, f"{e.rid}: no token follows its prefill chunk"
            rows.append(TargetRows(e.rid, e.prefix_len, s, torch.arange(off, off + n), nxt,
                                   list(e.new_token_ids), admitted=e.slots_start == 0))
            off += n
        return rows

    def run(self, msg: RunBatch) -> BatchResult:
        forwards = self.runner.timed_forwards
        result = self._run(msg)
        if self.runner.timed_forwards == forwards + 1:  # one target forward: the step's own
            result.forward_rows, result.target_s = self.runner.last_timed
        result.held = self.held()
        return result

    def held(self) -> dict[str, int]:
        """What the runner keeps per request (/server_info): its records, the grammar
        matchers alive (wherever a reference to one is held) and the drafter's state. All 0
        when no request is live: a count left above that after aborts is a leak."""
        matchers = len(self.grammars.live) if self.grammars is not None else 0
        drafter = self.spec.live_requests() if self.spec is not None else 0
        return {"runner_requests": len(self.states), "grammar_matchers": matchers,
                "drafter_requests": drafter}

    def _run(self, msg: RunBatch) -> BatchResult:
        t0 = time.perf_counter()
        for rid in msg.released_rids:
            self._release(rid)
        if msg.reset_drafter and self.spec is not None:
            self.spec.reset()
        if msg.verify_cost is not None and self.spec is not None:
            self.spec.set_verify_cost(VerifyCost.from_dict(msg.verify_cost))
        if msg.measure_rows:
            return self._measure(msg)
        if not msg.reqs:
            return BatchResult(batch_id=msg.batch_id, next_token_ids=[])
        mode = ForwardMode(msg.mode)
        states = [self._state(e) for e in msg.reqs]
        slots = [self._slots(e, st) for e, st in zip(msg.reqs, states)]
        if mode == ForwardMode.DECODE and msg.speculative:
            return self._run_spec(msg, states, t0)
        spec = self.spec
        wants_rows = spec is not None and spec.wants_committed_rows
        batch = ForwardBatch.build(
            mode,
            [e.new_token_ids for e in msg.reqs],
            slots,
            [e.prefix_len for e in msg.reqs],
            capture_layers=spec.capture_layers if spec is not None else (),
        )
        input_rows = [st.input_logprob_rows(e.prefix_len, len(e.new_token_ids))
                      for e, st in zip(msg.reqs, states)]
        last = None
        if any(input_rows):  # prompt logprobs: logits for those rows too, each request's last
            batch.logits_indices, last = _logits_rows(msg, input_rows)
        batch.logit_top = logit_top(st.logprobs for st in states)
        fwd = self.runner.forward(batch, spec is not None and spec.needs_final_hidden)
        rows = [i for i, e in enumerate(msg.reqs) if e.needs_token]
        if any(states[i].constrained for i in rows):
            fwd = self._mask(fwd, [msg.reqs[i].rid for i in rows], [states[i] for i in rows],
                             rows if last is None else [last[i] for i in rows])
        out, grammar = self._sample(msg, states, fwd, rows, last)
        if wants_rows:
            spec.draft_extend(self._prefill_rows(msg, states, slots), fwd)
        lps = None
        if batch.logit_top >= 0:
            lps = self._logprobs(msg, states, out, fwd, input_rows, last)
            lps = [finite_logprobs(lp) if st.grammar is not None else lp
                   for lp, st in zip(lps, states)]
        return BatchResult(
            batch_id=msg.batch_id, next_token_ids=out, forward_s=time.perf_counter() - t0,
            logprobs=lps, grammar_states=grammar if any(grammar) else None,
        )

    def _sample(self, msg: RunBatch, states: list[RunnerReq], fwd: ModelOutput,
                rows: list[int], last: list[int] | None) -> tuple[list[list[int]], list[str]]:
        """The next token of each request in `rows` (its last row of `fwd.logits`: row b, or
        last[b] when prompt rows were scored too), committed; and the requests' grammar
        states (BatchResult.grammar_states)."""
        out: list[list[int]] = [[] for _ in msg.reqs]
        grammar = [""] * len(msg.reqs)
        if not rows:
            return out, grammar
        sel = [states[i] for i in rows]
        if all(s.params.takes_argmax for s in sel):
            # what `sample` gives such rows, without its per-row parameter tensors or a copy of
            # the selected logits (~0.3 ms of a 6 ms decode step at batch 1); the CPU engine
            # found each row's argmax while the logits were in its cache
            am = fwd.row_argmax() if last is None else fwd.row_argmax()[last]
            tokens = (am if len(rows) == len(msg.reqs) else am[rows]).tolist()
        else:
            logits = fwd.logits if last is None else fwd.logits[last]  # [B, vocab]
            info = SamplingBatchInfo.from_params([s.params for s in sel], logits.shape[-1],
                                                 logits.device)
            tokens = sample(
                logits[rows], info, [s.prompt_ids for s in sel], [s.output_ids for s in sel],
                positions=[len(s.prompt_ids) + len(s.output_ids) for s in sel],
            ).tolist()
        for i, st, tok in zip(rows, sel, tokens):
            grammar[i] = self._append(st, [tok])
            out[i] = [tok]
        return out, grammar

    @staticmethod
    def _logprobs(msg: RunBatch, states: list[RunnerReq], out: list[list[int]],
                  fwd: ModelOutput, input_rows: list[list[int]],
                  last: list[int] | None) -> list[dict | None]:
        """Per request that asked: its sampled token's logprob (its last row of `fwd.logits`:
        row b, or last[b] when prompt rows were scored too), and the prompt tokens' of this
        chunk's `input_rows` (from where `_logits_rows` put them: just before the request's
        last row)."""
        res: list[dict | None] = [None] * len(states)
        sampled = [b for b, st in enumerate(states) if st.logprobs is not None and out[b]]
        if sampled:  # the sampled tokens' rows in one call
            payload = logprob_rows(fwd.logits, [out[b][0] for b in sampled],
                                   max(states[b].logprobs.top for b in sampled),
                                   rows=sampled if last is None else [last[b] for b in sampled],
                                   stats=fwd.logit_stats)
            for b, part in zip(sampled, split_rows(payload, [1] * len(sampled),
                                                   [states[b].logprobs.top for b in sampled])):
                res[b] = part
        for b, (e, st) in enumerate(zip(msg.reqs, states)):
            opts = st.logprobs
            if opts is None:
                continue
            payload = res[b] if res[b] is not None else {}
            rows = input_rows[b]
            if rows:
                k = len(rows)
                end = last[b] + (1 if rows[-1] == len(e.new_token_ids) - 1 else 0)
                q0 = e.prefix_len + rows[0]
                score = logprob_rows(fwd.logits, st.prompt_ids[q0 + 1 : q0 + 1 + k], opts.top,
                                     rows=range(end - k, end), stats=fwd.logit_stats)
                payload.update({"in_pos": q0 + 1, **{f"in_{k2}": v for k2, v in score.items()}})
                if e.prefix_len + len(e.new_token_ids) >= len(st.prompt_ids):
                    st.input_logprobs_done = True
            res[b] = payload
        return res


def _logits_rows(msg: RunBatch, input_rows: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """logits_indices [num_logits] for a batch where some requests want their prompt rows
    scored: per request its `input_rows` (offsets in its chunk) and its last row, once; and
    where each request's last row sits among them."""
    idx, last, off = [], [], 0
    for e, rows in zip(msg.reqs, input_rows):
        n = len(e.new_token_ids)
        idx.extend(off + r for r in rows)
        if not rows or rows[-1] != n - 1:
            idx.append(off + n - 1)
        last.append(len(idx) - 1)
        off += n
    return torch.tensor(idx, dtype=torch.int64), last


class StartupQuiet:
    """Events the other processes set when their start-up work (loading a tokenizer: ~1-2 s of
    one core) is done. The runner times its verify-cost curve only after them: on a 2-core
    machine a busy neighbour would stretch some of the timed forwards and skew the curve."""

    TIMEOUT_S = 120.0

    def __init__(self, events=()) -> None:
        self.events = tuple(events)

    def wait(self, parent_pid: int | None = None) -> None:
        deadline = time.monotonic() + self.TIMEOUT_S
        for ev in self.events:
            while not ev.wait(0.5):
                if parent_pid is not None and not parent_alive(parent_pid):
                    raise SystemExit(0)
                if time.monotonic() > deadline:
                    logger.warning("start-up: the other processes are still loading after %.0fs;"
                                   " timing the verify-cost curve anyway", self.TIMEOUT_S)
                    return


def _create_spec(speculation: Speculation | None, runner: ModelRunner,
                 before_measure=None) -> SpecWorker | None:
    if speculation is None:
        return None
    worker = speculation.create_worker(runner, before_measure)
    logger.info("speculative decoding: %s, %s", speculation.algorithm, worker.describe())
    cost = worker.verify_cost
    logger.info("verify cost T(n)/T(1) (%s): %s", cost.source, ", ".join(
        f"{n}: {r:.2f}" for n, r in zip(cost.rows, cost.ratios) if n in (2, 4, 8, 16, 64)))
    return worker


def _grammars(server_args, runner: ModelRunner) -> RunnerGrammars | None:
    """The runner's grammar loader (None with --grammar-backend none). Its backend (the
    tokenizer and xgrammar's view of its vocabulary, ~1.3 s of one core) is built on a thread
    from here on: after the verify-cost curve was timed, while the first requests arrive."""
    if server_args.grammar_backend == "none":
        return None
    mc = runner.model_config

    def make():
        from specserve.runtime.model_loader.tokenizer import load_tokenizer

        return create_backend(server_args.grammar_backend, load_tokenizer(server_args.model_path),
                              mc.vocab_size, list(mc.eos_token_ids),
                              not server_args.constrained_json_disable_any_whitespace)

    return RunnerGrammars(make)


def single_torch_thread(runner) -> None:
    """On the CPU engine, torch's own ops (sampling, a draft head's attention and norms) run on
    one thread: the engine's pool owns the cores, and a second pool of torch workers waking
    beside it costs more than it saves on such small tensors (measured on an EAGLE-3 head
    step over a 200-token prefix: 1.1-1.3 ms against 2.2-7.9 ms, docs/benchmarks.md)."""
    if runner.engine == "cpu" and torch.get_num_threads() > 1:
        logger.info("torch ops on 1 thread; the CPU engine's kernels on %d",
                    runner.kernel_threads)
        torch.set_num_threads(1)


def runner_config(server_args, tp_rank: int = 0) -> RunnerConfig:
    """The `RunnerConfig` of resolved server args, for tensor-parallel rank `tp_rank`."""
    return RunnerConfig(
        server_args.model_path, server_args.device, server_args.dtype,
        server_args.attention_backend, server_args.max_total_tokens,
        server_args.context_length, weight_format=server_args.weight_format,
        activation_digits=server_args.activation_digits,
        num_threads=server_args.num_threads, kv_cache_dtype=server_args.kv_cache_dtype,
        tp_size=server_args.tp_size, tp_rank=tp_rank, dist_init_addr=server_args.dist_init_addr,
        tp_comm=server_args.tp_comm,
    )


def run_model_runner_process(server_args, ipc_dir: str, parent_pid: int,
                             quiet: StartupQuiet | None = None,
                             speculation: Speculation | None = None) -> None:
    die_with_parent("specserve-run")
    thread_locks_for_progress_bars()
    setup_logging(server_args.log_level, "runner")
    torch.set_num_threads(server_args.num_threads)
    logger.info("model runner: %d torch threads (pid %d)", torch.get_num_threads(), os.getpid())
    ctx = zmq.Context()
    recv = Receiver(ctx, ipc_addr(ipc_dir, "runner_in"), bind=True, msg_type=TO_RUNNER)
    send = Sender(ctx, ipc_addr(ipc_dir, "runner_out"), bind=False)
    try:
        runner = ModelRunner(runner_config(server_args))
        # a draft head that does not fit fails here
        spec = _create_spec(speculation, runner,
                            None if quiet is None else functools.partial(quiet.wait, parent_pid))
        single_torch_thread(runner)
    except Exception as exc:  # noqa: BLE001 - reported to the scheduler, then we exit
        send.send(RunnerError(message=f"model runner failed to start: {exc}"))
        if not isinstance(exc, (ValueError, SpecserveError)):
            raise
        # a model or draft the user named that cannot serve: one line (a traceback at debug)
        logger.error("model runner failed to start: %s", exc,
                     exc_info=logger.isEnabledFor(logging.DEBUG))
        raise SystemExit(1) from None
    worker = RunnerWorker(runner, spec, _grammars(server_args, runner))
    trimmer = HeapTrimmer(server_args.heap_trim_interval)
    mc = runner.model_config
    send.send(RunnerReady(info={
        "kv_capacity": runner.kv_capacity, "context_length": runner.context_length,
        "vocab_size": mc.vocab_size, "eos_token_ids": mc.eos_token_ids,
        "device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
        "architecture": mc.architecture, "num_layers": mc.num_hidden_layers,
        "engine": runner.engine, "weight_formats": runner.weight_formats,
        "threads": runner.kernel_threads, "runner_pid": os.getpid(),
        "tp_size": runner.tp.world if runner.tp is not None else 1,
        # speculation plans with the verify-cost curve measured here, on this machine
        "verify_cost": spec.verify_cost.to_dict() if spec is not None else None,
    }))
    while True:
        msg = recv.recv(timeout_ms=1000)
        if msg is None:
            if not parent_alive(parent_pid):
                return
            trimmer.idle()
            continue
        if isinstance(msg, ShutdownReq):
            if runner.tp is not None:
                runner.tp.send_stop()
            return
        try:
            send.send(worker.run(msg))
        except Exception:  # noqa: BLE001 - a failed step must reach the scheduler, not vanish
            send.send(RunnerError(message=traceback.format_exc()))
            raise
        trimmer.after_step()
