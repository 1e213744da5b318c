"""The scheduler process: receives requests, runs `Scheduler.step()` in a loop, talks to the
model runner. It blocks in ZMQ polls whenever it has nothing to do."""

from __future__ import annotations

import logging
import os

import torch
import zmq

from specserve.runtime.ipc import Receiver, Sender, ipc_addr
from specserve.runtime.messages import (
    FROM_RUNNER,
    TO_SCHEDULER,
    BatchResult,
    ReadyOut,
    RunBatch,
    RunnerError,
    RunnerReady,
)
from specserve.runtime.model_loader.tokenizer import load_tokenizer
from specserve.runtime.proc_utils import (
    die_with_parent,
    parent_alive,
    setup_logging,
    thread_locks_for_progress_bars,
)
from specserve.runtime.scheduler.scheduler import Scheduler, SchedulerConfig
from specserve.runtime.scheduler.stop import StopChecker
from specserve.runtime.speculation import Speculation
from specserve.runtime.verify_cost import VerifyCost, stored_verify_cost

logger = logging.getLogger(__name__)


class RunnerDiedError(RuntimeError):
    pass


def run_scheduler_process(server_args, ipc_dir: str, parent_pid: int, loaded=None,
                          speculation: Speculation | None = None) -> None:
    """`loaded`: an event set once the tokenizer is loaded (the runner times its verify-cost
    curve after it, so this start-up work overlaps the runner's model load, not its timing).
    `speculation`: the launcher's speculative configuration (None: plain decoding)."""
    die_with_parent("specserve-sched")
    thread_locks_for_progress_bars()
    setup_logging(server_args.log_level, "scheduler")
    torch.set_num_threads(1)  # the model runner gets the cores
    try:
        tokenizer = load_tokenizer(server_args.model_path)
    finally:
        if loaded is not None:
            loaded.set()
    ctx = zmq.Context()
    recv = Receiver(ctx, ipc_addr(ipc_dir, "scheduler_in"), bind=True, msg_type=TO_SCHEDULER)
    to_tokenizer = Sender(ctx, ipc_addr(ipc_dir, "tokenizer_in"), bind=False)
    to_runner = Sender(ctx, ipc_addr(ipc_dir, "runner_in"), bind=False)
    from_runner = Receiver(ctx, ipc_addr(ipc_dir, "runner_out"), bind=True, msg_type=FROM_RUNNER)

    def wait_runner():
        while True:
            msg = from_runner.recv(timeout_ms=1000)
            if msg is not None:
                if isinstance(msg, RunnerError):
                    raise RunnerDiedError(msg.message)
                return msg
            if not parent_alive(parent_pid):
                raise SystemExit(0)

    try:
        ready = wait_runner()
    except RunnerDiedError:
        raise SystemExit(1) from None  # the runner has logged why it did not start
    assert isinstance(ready, RunnerReady), f"expected RunnerReady, got {type(ready).__name__}"
    info = ready.info
    eos = list(info["eos_token_ids"])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    stop = StopChecker(tokenizer, eos, int(info["context_length"]))

    def run_batch(batch: RunBatch) -> BatchResult:
        to_runner.send(batch)
        result = wait_runner()
        assert isinstance(result, BatchResult), f"unexpected {type(result).__name__}"
        return result

    cfg = SchedulerConfig.from_server_args(server_args)
    spec = None
    if speculation is not None:
        # speculation plans with the verify-cost curve the runner measured, else the stored
        # one of the engine it actually runs
        measured = info.get("verify_cost")
        curve = VerifyCost.from_dict(measured) if measured else \
            stored_verify_cost(str(info.get("engine", "torch")))
        spec = speculation.create_controller(curve)
    sched = Scheduler(cfg, int(info["kv_capacity"]), stop, run_batch, to_tokenizer.send, spec)
    to_tokenizer.send(ReadyOut(info={**info, "scheduler_pid": os.getpid()}))
    logger.info("scheduler ready: %d KV slots, max %d running requests",
                info["kv_capacity"], cfg.max_running_requests)
    while True:
        if sched.idle:
            msg = recv.recv(timeout_ms=1000)  # block: nothing to do
            if msg is None:
                if not parent_alive(parent_pid):
                    return
                sched.measure_when_idle()  # (a second without a request)
                continue
            sched.handle(msg)
        for msg in recv.drain():
            sched.handle(msg)
        sched.step()
