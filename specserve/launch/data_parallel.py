"""`python -m launch_server --dp-size N`: N engine replicas behind sglang-router.

Each replica is a server of its own, `python -m launch_server` with the user's flags on a free
loopback port and `--num-threads` = --threads-per-replica: its own scheduler, model runner, KV
and prefix cache. Once every replica answers /health, sglang-router starts on the user's
--host/--port (specserve/launch/router.py) and the launcher logs one `ready` line. A replica
that would time its verify-cost curve at start-up (`--speculative-verify-cost measure`) would
time it while the others load their models beside it, so the first replica starts alone and
the others, and every restart, start from the curve it timed (a file, passed as
`--speculative-verify-cost`): one measurement, whatever order the replicas come up in. Then:
- a replica that exits is taken out of the router's rotation at once (a thread waits on each),
  restarted with the same port and flags by the watchdog, which looks every 0.5 s (while it
  fails to start, again after 1, 2, 4 ... 30 s), and put back once its /health answers. Its
  requests in flight are lost to it: the router sends a non-streamed one again to another
  replica, a stream that had begun ends with an error;
- the router exiting stops everything (exit code 1).
SIGINT/SIGTERM stop the router, then the replicas (SIGKILL after 15 s). Children get SIGKILL
if the launcher dies (PR_SET_PDEATHSIG) and a replica's own processes die with it; they run in
their own process group, so a terminal's Ctrl-C reaches the launcher only, which stops them in
that order. Their output reaches our stderr line by line, prefixed with their name.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import httpx

from specserve.launch.router import RouterClient, connect_host, router_command
from specserve.launch.server_args import to_argv
from specserve.runtime.proc_utils import free_port, pdeathsig_preexec, setup_logging

logger = logging.getLogger("specserve")
logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per /health poll otherwise
POLL_S = 0.5
START_TIMEOUT_S = 900.0  # as one server's (specserve/runtime/processes.py)
STOP_WAIT_S = 15.0
MAX_BACKOFF_S = 30.0
REAP_GRACE_S = 1.0
_output_lock = threading.Lock()


def _forward(stream, label: str) -> None:
    for line in iter(stream.readline, b""):
        with _output_lock:
            sys.stderr.write(label + line.decode(errors="replace"))
            sys.stderr.flush()
    stream.close()


def spawn(argv: list[str], name: str) -> subprocess.Popen:
    # PR_SET_PDEATHSIG fires when the *thread* that forked exits: only the main thread forks
    assert threading.current_thread() is threading.main_thread(), "spawn from the main thread"
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=pdeathsig_preexec(os.getpid()))
    threading.Thread(target=_forward, args=(proc.stdout, f"{name} | "),
                     name=f"output-{name}", daemon=True).start()
    return proc


def stop_all(procs: list[subprocess.Popen], wait_s: float) -> None:
    """SIGTERM each, SIGKILL those still running after `wait_s`."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.terminate()
    deadline = time.monotonic() + wait_s
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def reap_groups(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGKILL what is left, after `grace_s`, of the process groups of exited children: a
    server's own children set PR_SET_PDEATHSIG only once they run, so those still starting
    when it exited would linger until they noticed."""
    deadline = time.monotonic() + grace_s
    groups = {p.pid for p in procs}  # each child leads its group (start_new_session)
    while groups:
        late = time.monotonic() > deadline
        for pgid in list(groups):
            try:
                os.killpg(pgid, signal.SIGKILL if late else 0)
            except ProcessLookupError:
                groups.discard(pgid)
        if late:
            return
        time.sleep(0.05)


@dataclass
class Replica:
    index: int
    port: int
    argv: list[str]
    proc: subprocess.Popen | None = None
    serving: bool = False  # started and put in the router; False again once it exits
    in_router: bool = False
    failed_starts: int = 0  # in a row
    next_start: float = 0.0  # monotonic
    down_since: float = 0.0

    @property
    def name(self) -> str:
        return f"replica{self.index}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def replica_argv(given, threads: int, port: int) -> list[str]:
    """The command of one replica: the user's flags (as given, each replica resolves them)
    on a loopback port with `threads` torch threads."""
    one = dataclasses.replace(given, dp_size=1, threads_per_replica=None, num_threads=threads,
                              host="127.0.0.1", port=port)
    return [sys.executable, "-m", "launch_server", *to_argv(one)]


class DataParallel:
    def __init__(self, given, args) -> None:
        """`given`: the parsed flags; `args`: the same, resolved."""
        self.given, self.args = given, args
        self.cost_dir: str | None = None  # the start-up curve the replicas share
        threads = args.threads_per_replica
        self.replicas = [Replica(i, port, replica_argv(given, threads, port))
                         for i, port in enumerate(free_port() for _ in range(args.dp_size))]
        self.router_proc: subprocess.Popen | None = None
        self.router: RouterClient | None = None
        self.router_metrics_port = free_port()
        self.router_lock = threading.Lock()  # the exit watchers call the router too
        self.stop_signal: int | None = None
        self.http = httpx.Client(timeout=1)  # one client for every /health poll

    def _on_signal(self, signum, frame) -> None:
        self.stop_signal = signum

    def serve(self) -> int:
        t0 = time.perf_counter()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            try:
                self._start()
            except RuntimeError as exc:
                if self.stop_signal is None:
                    logger.error("start-up failed: %s", exc)
                    return 1
            if self.stop_signal is not None:
                logger.info("stopping (%s)", signal.Signals(self.stop_signal).name)
                return 0
            a = self.args
            listed = ", ".join(f"{r.name} {r.url} (pid {r.proc.pid})" for r in self.replicas)
            metrics = f"; router metrics http://127.0.0.1:{self.router_metrics_port}/metrics" \
                if a.enable_metrics else ""
            logger.info("ready in %.1fs: http://%s:%d  sglang-router (cache_aware) in front of "
                        "%d replicas, %d thread(s) each: %s%s", time.perf_counter() - t0,
                        a.host, a.port, a.dp_size, a.threads_per_replica, listed, metrics)
            return self._watch()
        finally:
            self._shutdown()

    def _start_replica(self, r: Replica) -> None:
        r.proc = spawn(r.argv, r.name)
        threading.Thread(target=self._on_exit, args=(r, r.proc), name=f"exit-{r.name}",
                         daemon=True).start()

    def _on_exit(self, r: Replica, proc: subprocess.Popen) -> None:
        """Take a replica out of the router the moment its process exits: the router's tries
        of a request sent to it last 0.8 s (specserve/launch/router.py), the watchdog's look every
        0.5 s could come too late."""
        code = proc.wait()
        with self.router_lock:
            if self.stop_signal is None and r.in_router:
                self._take_out(r, proc.pid, code)
        if self.stop_signal is None:
            reap_groups([proc], REAP_GRACE_S)

    def _take_out(self, r: Replica, pid: int, code: int) -> None:
        """Remove an exited replica from the router and say so (holding `router_lock`)."""
        r.in_router = False
        t0 = time.monotonic()
        removed = self._try(self.router.remove, r.url)
        took = (f"out of the router in {(time.monotonic() - t0) * 1e3:.0f} ms" if removed
                else "still in the router")
        logger.error("%s (pid %d) exited with code %s: %s, restarting it", r.name, pid, code,
                     took)

    def _start(self) -> None:
        if self._measures_cost():
            # each replica would time its verify-cost curve while the others load their models
            # beside it: the first times it alone, the others (and every restart) take its curve
            self._start_and_wait(self.replicas[:1])
            if self.stop_signal is None:
                self._share_cost(self.replicas[0])
            self._start_and_wait(self.replicas[1:])
        else:
            self._start_and_wait(self.replicas)
        if self.stop_signal is not None:
            return
        a = self.args
        self.router_proc = spawn(router_command(
            [r.url for r in self.replicas], a.host, a.port, self.router_metrics_port,
            a.api_key, a.log_level), "router")
        self.router = RouterClient(f"http://{connect_host(a.host)}:{a.port}", a.api_key)
        self.router.wait_workers([r.url for r in self.replicas],
                                 lambda: self.router_proc.poll() is None and
                                 self.stop_signal is None, timeout_s=120)
        with self.router_lock:
            for r in self.replicas:
                r.serving = r.in_router = True

    def _start_and_wait(self, replicas: list[Replica]) -> None:
        for r in replicas:
            self._start_replica(r)
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = list(replicas)
        while waiting and self.stop_signal is None:
            for r in list(waiting):
                if not r.alive():
                    raise RuntimeError(f"{r.name} exited during start-up (exit code "
                                       f"{r.proc.returncode}; its log is above)")
                if self._healthy(r):
                    waiting.remove(r)
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas not ready after {START_TIMEOUT_S:.0f}s")
            time.sleep(POLL_S)

    def _measures_cost(self) -> bool:
        """Whether the replicas would time a verify-cost curve at start-up."""
        cfg = self.args.spec_config()
        return self.args.dp_size > 1 and cfg is not None and cfg.verify_cost == "measure"

    def _share_cost(self, r: Replica) -> None:
        """Every replica's command (restarts too) takes the curve `r` timed at start-up."""
        try:
            curve = self.http.get(f"{r.url}/server_info", timeout=30).json()["verify_cost_prior"]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            logger.warning("%s: no verify-cost curve to share (%r); each replica times its own",
                           r.name, exc)
            return
        self.cost_dir = tempfile.mkdtemp(prefix="specserve-dp-")  # (mode 0700)
        path = os.path.join(self.cost_dir, "verify_cost.json")
        with open(path, "w") as f:
            json.dump(curve, f)
        given = dataclasses.replace(self.given, speculative_verify_cost=path)
        for rep in self.replicas:
            rep.argv = replica_argv(given, self.args.threads_per_replica, rep.port)
        logger.info("verify cost: %s's start-up curve (%s) for every replica", r.name,
                    curve.get("source", ""))

    def _healthy(self, r: Replica) -> bool:
        try:
            return self.http.get(f"{r.url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _watch(self) -> int:
        while self.stop_signal is None:
            if self.router_proc.poll() is not None:
                logger.error("sglang-router exited (exit code %s): shutting down",
                             self.router_proc.returncode)
                return 1
            now = time.monotonic()
            for r in self.replicas:
                self._tend(r, now)
            time.sleep(POLL_S)
        logger.info("stopping (%s)", signal.Signals(self.stop_signal).name)
        return 0

    def _tend(self, r: Replica, now: float) -> None:
        """One look at a replica: restart it when it has exited and a start is due, put it
        back in the router once it answers /health."""
        if r.alive():
            if not r.serving and self._healthy(r):
                self._put_back(r, now)
            return
        if r.proc is not None:  # exited since the last look
            r.proc.wait()
            with self.router_lock:
                if r.in_router:  # before its exit watcher (or while being put back)
                    self._take_out(r, r.proc.pid, r.proc.returncode)
            if r.serving:
                r.serving, r.down_since, r.failed_starts, r.next_start = False, now, 0, now
            else:
                r.failed_starts += 1
                delay = min(MAX_BACKOFF_S, 2.0 ** (r.failed_starts - 1))
                r.next_start = now + delay
                logger.error("%s exited during its restart (exit code %s); next try in %.0fs",
                             r.name, r.proc.returncode, delay)
            r.proc = None
        if now >= r.next_start:
            self._start_replica(r)

    def _put_back(self, r: Replica, now: float) -> None:
        with self.router_lock:
            if not self._try(self.router.add, r.url):
                return  # tried again at the next look
            r.serving = r.in_router = True
        logger.info("%s is back in the router, %.1fs after it exited (pid %d)", r.name,
                    now - r.down_since, r.proc.pid)

    @staticmethod
    def _try(call, url: str) -> bool:
        try:
            call(url)
            return True
        except httpx.HTTPError as exc:
            logger.warning("sglang-router: %s %s failed: %r", call.__name__, url, exc)
            return False

    def _shutdown(self) -> None:
        self.stop_signal = self.stop_signal or signal.SIGTERM  # the exit watchers stand down
        children = [r.proc for r in self.replicas if r.proc is not None]
        if self.router_proc is not None:
            stop_all([self.router_proc], 5.0)
            children.append(self.router_proc)
        stop_all([r.proc for r in self.replicas if r.proc is not None], STOP_WAIT_S)
        reap_groups(children, REAP_GRACE_S)
        if self.router is not None:
            self.router.close()
        self.http.close()
        if self.cost_dir is not None:
            shutil.rmtree(self.cost_dir, ignore_errors=True)
        logger.info("shut down")


def serve_data_parallel(given, args) -> int:
    """Serve `args.dp_size` replicas behind sglang-router until SIGINT/SIGTERM or the router
    exits; `given`: the parsed flags, `args`: the same resolved."""
    setup_logging(args.log_level, "launcher")
    return DataParallel(given, args).serve()
