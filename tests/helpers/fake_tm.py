"""A real `TokenizerManager` in front of a fake scheduler: HTTP tests without processes or model.

The tm is the production class (real tokenizer, chat template, validation, incremental
detokenization, abort-on-close); only its scheduler socket is replaced by `FakeScheduler`, which
answers over the same msgspec messages. Its "model" repeats a fixed reply (with multi-byte
characters, then EOS), starting `seed` tokens in, one step every `token_delay` seconds, and it
records every abort it receives.

    tm, sched = make_fake_tm(tmp_path)
    app = create_app(tm, tm.server_args)
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import msgspec

from specserve.launch.server_args import ServerArgs
from specserve.runtime.messages import (
    TO_SCHEDULER,
    AbortReq,
    FlushCacheReq,
    GenerateReq,
    GetInfoReq,
    InfoOut,
    SpecStep,
    TokenOut,
    TraceStep,
)
from specserve.runtime.tokenizer.tokenizer_manager import TokenizerManager
from tests.helpers.tiny_models import EOS_ID, TINY_VOCAB_SIZE, write_tiny_tokenizer_files

REPLY_TEXT = "Hello, world! café naïve 日本語 the quick brown fox jumps over the lazy dog"
CONTEXT_LENGTH = 256
MODEL_NAME = "tiny-test"


class FakeScheduler:
    """Stands in for the scheduler process behind the tm's PUSH socket (`tm._send`)."""

    def __init__(self, tm: TokenizerManager, token_delay: float = 0.0,
                 tokens_per_step: int = 1) -> None:
        self.tm = tm
        self.token_delay = token_delay
        self.tokens_per_step = tokens_per_step
        self.reply_ids = tm.tokenize(REPLY_TEXT) + [EOS_ID]
        self.extra_meta: dict = {"spec_accept_length": 2.5, "spec_verify_ct": 3}
        self.flush_ok = True
        self.die_after_tokens: int | None = None  # then the "processes die" (tm.mark_dead)
        self.refusal: dict | None = None  # set: every new request finishes at once with it
        self.requests: list[GenerateReq] = []
        self.aborted: list[str] = []
        self._dec = msgspec.msgpack.Decoder(TO_SCHEDULER)
        self._enc = msgspec.msgpack.Encoder()
        self._tasks: dict[str, asyncio.Task] = {}
        self._outputs: dict[str, tuple[GenerateReq, list[int]]] = {}

    @property
    def running(self) -> list[str]:
        return list(self._tasks)

    # the tm calls this exactly as it calls zmq's socket.send
    def send(self, data: bytes) -> None:
        msg = self._dec.decode(data)
        loop = asyncio.get_running_loop()
        if isinstance(msg, GenerateReq):
            self.requests.append(msg)
            self._outputs[msg.rid] = (msg, [])
            if self.refusal is not None:  # as the scheduler refuses at a full queue
                loop.call_soon(self._emit, msg.rid, [], dict(self.refusal))
                return
            self._tasks[msg.rid] = loop.create_task(self._run(msg))
        elif isinstance(msg, AbortReq):
            self.aborted.append(msg.rid)
            task = self._tasks.pop(msg.rid, None)
            if task is not None:  # like the scheduler: the request finishes as "abort"
                task.cancel()
                loop.call_soon(self._emit, msg.rid, [], {"type": "abort"})
        elif isinstance(msg, FlushCacheReq):
            ok = self.flush_ok and not self._tasks
            loop.call_soon(self._deliver, InfoOut(req_id=msg.req_id, info={"success": ok}))
        elif isinstance(msg, GetInfoReq):
            loop.call_soon(self._deliver, InfoOut(req_id=msg.req_id, info=self.info()))

    def info(self) -> dict:
        return {"num_running_reqs": len(self._tasks), "num_waiting_reqs": 0,
                "kv_usage": 0.125, "avg_spec_accept_length": 2.5,
                "finished": len(self.requests) - len(self.aborted)}

    async def _run(self, req: GenerateReq) -> None:
        p = req.sampling_params
        out = self._outputs[req.rid][1]
        offset = p.seed or 0
        while True:
            await asyncio.sleep(self.token_delay)
            new: list[int] = []
            reason = None
            while reason is None and len(new) < self.tokens_per_step:
                token = self.reply_ids[(offset + len(out)) % len(self.reply_ids)]
                out.append(token)
                new.append(token)
                reason = self._finish_reason(req, out)
            if reason is not None:
                self._tasks.pop(req.rid, None)
            lp = None
            if req.logprobs is not None:
                lp = fake_logprobs(new, req.logprobs.top)
                if len(out) == len(new):  # the first step also carries the prompt's
                    lp.update(fake_input_logprobs(req.input_ids, req.logprobs))
            trace = fake_trace_step(req.input_ids + out, len(out) - len(new), new) \
                if req.spec_trace else None
            self._emit(req.rid, new, reason, lp, trace)
            if reason is not None:
                return
            if self.die_after_tokens is not None and len(out) >= self.die_after_tokens:
                for task in self._tasks.values():
                    if task is not asyncio.current_task():
                        task.cancel()
                self._tasks.clear()
                self.tm.mark_dead("scheduler died")
                return

    def _finish_reason(self, req: GenerateReq, out: list[int]) -> dict | None:
        p, token = req.sampling_params, out[-1]
        if token in p.stop_token_ids or (token == EOS_ID and not p.ignore_eos):
            return {"type": "stop", "matched": token}
        if p.stop:
            text = self.tm.tokenizer.decode(out)
            for s in p.stop:
                if s in text:
                    return {"type": "stop", "matched": s}
        if len(out) >= p.max_new_tokens or len(req.input_ids) + len(out) >= CONTEXT_LENGTH:
            return {"type": "length", "length": len(out)}
        return None

    def _emit(self, rid: str, new: list[int], reason: dict | None,
              logprobs: dict | None = None, trace: TraceStep | None = None) -> None:
        meta = {}
        if reason is not None:
            req, out = self._outputs.pop(rid)
            meta = {"prompt_tokens": len(req.input_ids), "completion_tokens": len(out),
                    "cached_tokens": 0, **self.extra_meta}
        self._deliver(TokenOut(rids=[rid], new_token_ids=[new], finish_reasons=[reason],
                               meta_infos=[meta],
                               logprobs=None if logprobs is None else [logprobs],
                               spec_trace=None if trace is None else [[trace]]))

    def _deliver(self, msg: TokenOut | InfoOut) -> None:
        """What the tm's receive loop does with a message, after a wire round trip."""
        msg = self.tm._dec.decode(self._enc.encode(msg))
        if isinstance(msg, TokenOut):
            self.tm._on_tokens(msg)
            return
        fut = self.tm._info_waiters.pop(msg.req_id, None)
        if fut is not None and not fut.done():
            fut.set_result(msg.info)


def fake_trace_step(history: list[int], start: int, new: list[int]) -> TraceStep:
    """The step that gave `new` (output index `start` on) as a verify step of a chain that
    drafted them and one wrong sibling of the first, all but the last accepted (a plain step
    when it is one token)."""
    if len(new) == 1:
        return TraceStep(start, list(new), 0.004, 1)
    root = history[len(history) - len(new) - 1]
    n = len(new)
    tree = SpecStep(tokens=[root, *new[:-1], (new[0] + 1) % TINY_VOCAB_SIZE],
                    parents=[-1, *range(n - 1), 0], accepted=list(range(n)), bonus=new[-1],
                    draft_s=0.001)
    return TraceStep(start, list(new), 0.006, 1, tree)


def fake_logprob(token: int) -> float:
    """The fake model's logprob of a token it chose (its most likely one)."""
    return -0.125 * (1 + token % 5)


def fake_logprobs(tokens: list[int], top: int, prefix: str = "") -> dict:
    """A specserve/runtime/sampling/logprobs.py payload: each token is its position's most likely,
    followed by the next ids, each one nat less likely."""
    out: dict = {prefix + "lp": [fake_logprob(t) for t in tokens]}
    if top:
        out[prefix + "top_ids"] = [[(t + j) % TINY_VOCAB_SIZE for j in range(top)]
                                   for t in tokens]
        out[prefix + "top_lp"] = [[fake_logprob(t) - j for j in range(top)] for t in tokens]
    return out


def fake_input_logprobs(prompt: list[int], options) -> dict:
    """The prompt part: tokens from position max(input_from, 1) on."""
    start = options.input_from
    if start is None:
        return {}
    pos = max(start, 1)
    return {"in_pos": pos, **fake_logprobs(prompt[pos:], options.top, "in_")}


def make_fake_tm(model_dir: str | Path, token_delay: float = 0.0,
                 **server_args: object) -> tuple[TokenizerManager, FakeScheduler]:
    """A tm over a tiny tokenizer written into `model_dir`, wired to a `FakeScheduler`."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    if not (model_dir / "tokenizer.json").is_file():
        write_tiny_tokenizer_files(model_dir, max_length=CONTEXT_LENGTH)
    args = ServerArgs(model_path=str(model_dir), served_model_name=MODEL_NAME)
    args = dataclasses.replace(args, **server_args)
    ready = {"context_length": CONTEXT_LENGTH, "vocab_size": TINY_VOCAB_SIZE,
             "max_total_tokens": 4096, "speculative_algorithm": None}
    tm = TokenizerManager(args, ipc_dir=str(model_dir), ready_info=ready)
    sched = FakeScheduler(tm, token_delay)
    tm._send = sched
    return tm, sched
