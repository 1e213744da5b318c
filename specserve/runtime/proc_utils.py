"""Process helpers shared by the launcher and its children: die with the parent, logging."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def die_with_parent(name: str | None = None) -> None:
    """Ask Linux to SIGKILL this process when its parent dies: no orphans, whatever happens.

    `name` (at most 15 bytes) also becomes the process's name in `ps`, `top` and
    /proc/<pid>/comm, so a human (and the soak's per-process RSS) can tell the children apart.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if name:
                libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
        except OSError:
            pass


def pdeathsig_preexec(parent_pid: int) -> Callable[[], None] | None:
    """A `subprocess.Popen(preexec_fn=...)` that makes the child (any program, ours or not) get
    SIGKILL when the thread that started it dies, and exit at once if `parent_pid` is already
    gone. libc is loaded here, in the parent: the function runs between fork and exec, where
    loading a library could deadlock on a lock another thread held at the fork. None off Linux.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before the line above
            os._exit(1)

    return preexec


def thread_locks_for_progress_bars() -> None:
    """tqdm's first bar in a process creates a multiprocessing lock (a named semaphore) for
    bars shared across processes. A child is stopped by SIGTERM before that lock's finalizer
    runs, so the resource tracker warned "1 leaked semaphore objects" when every Engine or
    server exited (the runner's "packing weights" bar). The children's bars are their own:
    a thread lock does."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def setup_logging(level: str, process_name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {process_name:<9} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def _glibc_malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class HeapTrimmer:
    """Give the heap's freed pages back to the OS: once every `interval_s` seconds of work and
    once whenever the process goes idle after working.

    The model runner frees buffers of a different size every step (logits of a verify tree,
    a prompt chunk's activations, sampling's temporaries). glibc keeps freed chunks below its
    mmap threshold (which rises to 32 MiB after the first large free) in the heap, and their
    pages stay resident, so the runner's RSS drifts hundreds of MB above what it uses and a
    leak cannot be told from fragmentation. `malloc_trim(0)` returns every free page of every
    arena: 5.5-16.5 ms a trim for ~500 MB in a 64-stream SUFFIX soak (docs/benchmarks.md,
    "Admission, soak and fuzz"). Under load the heap refills within seconds, so this does not shrink
    a busy process; it hands the memory back once the load stops. A no-op off glibc or with
    interval 0.
    """

    def __init__(self, interval_s: float, trim: Callable[[int], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._trim = (trim or _glibc_malloc_trim()) if interval_s > 0 else None
        self._clock = clock
        self._last = clock()
        self._dirty = False
        self.trims = 0
        self.trim_seconds = 0.0

    @property
    def enabled(self) -> bool:
        return self._trim is not None

    def after_step(self) -> None:
        self._dirty = True
        if self._trim is not None and self._clock() - self._last >= self.interval_s:
            self.trim()

    def idle(self) -> None:
        if self._dirty and self._trim is not None:
            self.trim()

    def trim(self) -> None:
        assert self._trim is not None
        before = rss_mb() if logger.isEnabledFor(logging.DEBUG) else 0.0
        t0 = time.perf_counter()
        self._trim(0)
        dt = time.perf_counter() - t0
        self.trims += 1
        self.trim_seconds += dt
        self._dirty = False
        self._last = self._clock()
        if before:
            logger.debug("malloc_trim: RSS %.0f -> %.0f MB in %.1f ms (%d trims, %.2f s in all)",
                         before, rss_mb(), dt * 1e3, self.trims, self.trim_seconds)


def rss_mb() -> float:
    """This process's resident set (MB), from /proc/self/statm; 0.0 where there is none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
