"""Process helpers shared by the launcher and its children: die with the parent, logging."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies: no orphans, whatever happens."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def setup_logging(level: str, process_name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {process_name:<9} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
