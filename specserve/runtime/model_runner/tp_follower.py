"""A tensor-parallel rank other than 0: it holds its shard of the weights and KV, and runs
what rank 0 sends (specserve/runtime/distributed.py) until rank 0 stops or is gone."""

from __future__ import annotations

import logging
import os

import torch

from specserve.runtime.distributed import OP_FORWARD, OP_MOVE_KV, OP_STOP
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from specserve.runtime.proc_utils import (
    die_with_parent,
    setup_logging,
    thread_locks_for_progress_bars,
)

logger = logging.getLogger(__name__)


def follow(runner: ModelRunner) -> int:
    """Run rank 0's commands until it stops; returns how many forwards ran."""
    tp = runner.tp
    hidden = runner.model_config.hidden_size
    forwards = 0
    while True:
        try:
            op, a = tp.recv(hidden)
        except RuntimeError as exc:  # the group broke: rank 0 exited or died
            logger.info("tensor-parallel rank %d: rank 0 is gone (%s); exiting", tp.rank,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return forwards
        if op == OP_FORWARD:
            if a["hidden_in"] is not None:
                a["hidden_in"] = a["hidden_in"].to(runner.device, runner.dtype)
            runner.forward(**a)
            forwards += 1
        elif op == OP_MOVE_KV:
            runner.kv_pool.move(a["src"], a["dst"])
        elif op == OP_STOP:
            return forwards
        else:
            raise RuntimeError(f"tensor-parallel rank {tp.rank}: unknown command {op}")


def run_tp_follower_process(config: RunnerConfig, log_level: str) -> None:
    die_with_parent(f"specserve-tp{config.tp_rank}")
    thread_locks_for_progress_bars()
    setup_logging(log_level, f"tp{config.tp_rank}")
    threads = config.num_threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    logger.info("tensor-parallel rank %d of %d: %d threads (pid %d)", config.tp_rank,
                config.tp_size, threads, os.getpid())
    runner = ModelRunner(config)
    torch.set_num_threads(1)  # torch ops here are bookkeeping; the engine has its own pool
    try:
        follow(runner)
    finally:
        runner.tp.close()
