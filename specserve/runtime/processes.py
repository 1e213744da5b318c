"""Start the scheduler and model-runner processes, wait for readiness, watch, tear down.

Shared by the HTTP launcher and `Engine`. Children ask the kernel to kill them if this
process dies (PR_SET_PDEATHSIG) and also exit when they see their parent gone, so no child is
ever orphaned.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import time

import zmq

from specserve.runtime.errors import ModelLoadError
from specserve.runtime.ipc import Receiver, ipc_addr, make_ipc_dir
from specserve.runtime.messages import TO_TOKENIZER, ReadyOut
from specserve.runtime.model_loader.tokenizer import load_tokenizer
from specserve.runtime.model_runner.runner_process import (
    StartupQuiet,
    run_model_runner_process,
    runner_config,
)
from specserve.runtime.model_runner.tp_follower import run_tp_follower_process
from specserve.runtime.scheduler.scheduler_process import run_scheduler_process
from specserve.runtime.server_args import BaseServerArgs
from specserve.runtime.speculation import Speculation

logger = logging.getLogger(__name__)


class StartupError(RuntimeError):
    pass


class Backend:
    """The scheduler + model-runner processes of one server."""

    def __init__(self, args: BaseServerArgs, speculation: Speculation | None = None) -> None:
        """`args`: resolved; `speculation`: what the launcher built of the speculative options
        (None: plain decoding)."""
        self.args = args
        server = args.server_part()
        self.ipc_dir = make_ipc_dir()
        ctx = mp.get_context("spawn")
        parent = os.getpid()
        # set by this process and the scheduler once their tokenizers are loaded: the runner
        # waits for both before it times its verify-cost curve (StartupQuiet). Held here, not
        # only in the Process args: Process.start drops its args, and a collected event's
        # semaphore is gone before a spawned child unpickles it.
        self.front_loaded, self.sched_loaded = ctx.Event(), ctx.Event()
        quiet = StartupQuiet((self.front_loaded, self.sched_loaded))
        self.procs = {
            "model_runner": ctx.Process(
                target=run_model_runner_process,
                args=(server, self.ipc_dir, parent, quiet, speculation),
                name="specserve-model-runner", daemon=True,
            ),
            "scheduler": ctx.Process(
                target=run_scheduler_process,
                args=(server, self.ipc_dir, parent, self.sched_loaded, speculation),
                name="specserve-scheduler", daemon=True,
            ),
        }
        self.procs.update(tp_follower_procs(server, ctx))
        self.ready_info: dict = {}
        self.tokenizer = None  # the front end's, loaded during start()

    def start(self, timeout_s: float = 900.0) -> dict:
        """Start the children and block until the scheduler reports ready (with model facts).
        The front end's tokenizer loads here meanwhile (`self.tokenizer`), while the children
        import and the runner loads the model, instead of after them."""
        for proc in self.procs.values():
            proc.start()
        try:
            self.tokenizer = load_tokenizer(self.args.model_path)
        except ModelLoadError:
            self.tokenizer = None  # the TokenizerManager loads it again and says why
        finally:
            self.front_loaded.set()
        ctx = zmq.Context.instance()
        recv = Receiver(ctx, ipc_addr(self.ipc_dir, "tokenizer_in"), bind=True,
                        msg_type=TO_TOKENIZER)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                msg = recv.recv(timeout_ms=500)
                if isinstance(msg, ReadyOut):
                    self.ready_info = msg.info
                    return msg.info
                dead = self.dead_process()
                if dead:
                    raise StartupError(f"{dead} process exited during start-up (see its log)")
            raise StartupError(f"server not ready after {timeout_s:.0f}s")
        finally:
            recv.close()

    def dead_process(self) -> str | None:
        for name, proc in self.procs.items():
            if not proc.is_alive():
                return f"{name} (pid {proc.pid}, exit code {proc.exitcode})"
        return None

    def shutdown(self) -> None:
        stop_processes(self.procs.values())
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def tp_follower_procs(args: BaseServerArgs, ctx) -> dict[str, mp.Process]:
    """This host's tensor-parallel ranks other than 0 (rank 0 is the model runner)."""
    return {f"tp_rank_{r}": ctx.Process(target=run_tp_follower_process,
                                        args=(runner_config(args, r), args.log_level),
                                        name=f"specserve-tp-rank-{r}", daemon=True)
            for r in args.node_tp_ranks() if r != 0}


def stop_processes(procs) -> None:
    """SIGTERM the started ones, SIGKILL what is left after 3 s."""
    started = [p for p in procs if p.pid is not None]
    for proc in started:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + 3.0
    for proc in started:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)


def run_tp_node(args: BaseServerArgs) -> int:
    """A host other than node 0 (`--node-rank` > 0): run its tensor-parallel ranks until they
    exit (node 0 stopped) or SIGINT/SIGTERM; 0 if every rank exited cleanly."""
    procs = tp_follower_procs(args.server_part(), mp.get_context("spawn"))
    for proc in procs.values():
        proc.start()
    logger.info("node %d: tensor-parallel ranks %s following %s", args.node_rank,
                list(args.node_tp_ranks()), args.dist_init_addr)
    try:
        while any(p.is_alive() for p in procs.values()):
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        stop_processes(procs.values())
    return max((p.exitcode or 0) for p in procs.values())
