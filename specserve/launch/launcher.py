"""`python -m launch_server`: start the processes, serve HTTP, shut everything down cleanly.

The launcher process is the tokenizer process: it runs the HTTP server (uvicorn + uvloop) and
the `TokenizerManager`. A watchdog checks the children every 0.5 s; if one dies, requests in
flight fail, /health turns 503, and the launcher exits non-zero within seconds, naming the dead
process. SIGINT/SIGTERM stop uvicorn, then the children are terminated (killed after 3 s).
With --dp-size N > 1 it runs N such servers behind sglang-router instead
(specserve/launch/data_parallel.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time

import uvicorn

from specserve.launch.router import RouterUnavailable, require_router
from specserve.launch.server_args import ServerArgs, parse_args, speculation
from specserve.runtime.entrypoints.http_server import create_app
from specserve.runtime.errors import SpecserveError
from specserve.runtime.proc_utils import setup_logging
from specserve.runtime.processes import Backend, StartupError, run_tp_node
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.runtime.tokenizer.tokenizer_manager import TokenizerManager

logger = logging.getLogger("specserve")


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown; we still have children to
    stop and an exit code to set, so the signal ends here."""

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            self._captured_signals.clear()


async def _warm_up(tm: TokenizerManager) -> float:
    t0 = time.perf_counter()
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    async for _ in tm.generate(tm.tokenize("Warm-up request."), params):
        pass
    return time.perf_counter() - t0


def serve(args: ServerArgs) -> int:
    """Serve until SIGINT/SIGTERM or a child dies; `args` must be resolved."""
    setup_logging(args.log_level, "launcher")
    if args.node_rank > 0:  # another host's tensor-parallel ranks: no HTTP, no scheduler
        return run_tp_node(args)
    t0 = time.perf_counter()
    backend = Backend(args, speculation(args))
    exit_code = 0
    try:
        try:
            info = backend.start()
        except StartupError as exc:
            logger.error("start-up failed: %s", exc)
            return 1
        tm = TokenizerManager(args, backend.ipc_dir, info, backend.tokenizer)
        app = create_app(tm, args)
        config = uvicorn.Config(app, host=args.host, port=args.port, loop="uvloop",
                                log_level=args.log_level, access_log=args.log_level == "debug",
                                timeout_graceful_shutdown=3)
        server = _Server(config)
        dead: list[str] = []

        async def watchdog() -> None:
            while not server.should_exit:
                name = backend.dead_process()
                if name:
                    logger.error("%s died: failing requests in flight and shutting down", name)
                    tm.mark_dead(f"{name} died")
                    dead.append(name)
                    await asyncio.sleep(0.5)  # let in-flight requests receive their error
                    server.should_exit = True
                    return
                await asyncio.sleep(0.5)

        async def main() -> None:
            await tm.start()
            warm = await _warm_up(tm)
            task = asyncio.get_running_loop().create_task(watchdog())
            logger.info(
                "ready in %.1fs (warm-up %.2fs): http://%s:%d  model=%s device=%s dtype=%s "
                "kv_slots=%d", time.perf_counter() - t0, warm, args.host, args.port,
                args.served_model_name, info["device"], info["dtype"], info["kv_capacity"],
            )
            try:
                await server.serve()
            finally:
                task.cancel()
                await tm.stop()

        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(main())
        if dead:
            exit_code = 1
    finally:
        backend.shutdown()
        logger.info("shut down (exit code %d)", exit_code)
    return exit_code


def main(argv: list[str] | None = None) -> None:
    given = parse_args(argv)
    try:
        if given.dp_size > 1:
            require_router()
        args = given.resolve()
    except (ValueError, SpecserveError, RouterUnavailable) as exc:
        # a bad flag or model path: one clear line, no traceback
        print(f"launch_server: error: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.dp_size > 1:
        from specserve.launch.data_parallel import serve_data_parallel

        sys.exit(serve_data_parallel(given, args))
    sys.exit(serve(args))
