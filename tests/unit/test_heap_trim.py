"""The model runner's heap trimmer: when it trims (a fake clock), and that glibc's trim really
hands freed heap pages back (RSS of a child process)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from specserve.launch.server_args import ServerArgs
from specserve.runtime.proc_utils import HeapTrimmer, _glibc_malloc_trim


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_trims_every_interval_of_work_and_once_per_idle_spell():
    calls: list[int] = []
    clock = Clock()
    t = HeapTrimmer(30.0, trim=lambda pad: calls.append(pad) or 1, clock=clock)
    assert t.enabled
    t.idle()
    assert calls == []  # nothing ran since start: nothing to give back
    for _ in range(5):
        clock.t += 5.0
        t.after_step()
    assert calls == []  # 25 s of work
    clock.t += 5.0
    t.after_step()
    assert calls == [0] and t.trims == 1  # 30 s
    clock.t += 1.0
    t.after_step()
    assert t.trims == 1  # the interval restarts at each trim
    t.idle()
    assert t.trims == 2
    t.idle()
    t.idle()
    assert t.trims == 2  # one trim per idle spell, not one per idle poll
    clock.t += 29.0
    t.after_step()
    assert t.trims == 2  # 29 s since the idle trim
    clock.t += 1.0
    t.after_step()
    assert t.trims == 3 and t.trim_seconds >= 0.0


def test_interval_zero_turns_it_off():
    calls: list[int] = []
    t = HeapTrimmer(0.0, trim=lambda pad: calls.append(pad) or 1, clock=Clock())
    assert not t.enabled
    for _ in range(3):
        t.after_step()
        t.idle()
    assert calls == []


def test_server_arg_checked():
    assert ServerArgs().heap_trim_interval == 30.0
    with pytest.raises(ValueError, match="heap-trim-interval"):
        ServerArgs(heap_trim_interval=-1.0).resolve()


@pytest.mark.skipif(_glibc_malloc_trim() is None, reason="glibc's malloc_trim only")
def test_glibc_trim_returns_freed_heap_pages():
    # In a fresh interpreter: free one 16 MiB block (glibc then raises its mmap threshold to
    # 16 MiB, as after a runner step's large free), fill 96 x 2 MiB heap blocks, free all but
    # every 8th (the survivors keep the heap from shrinking at its top). The freed pages stay
    # resident until the trimmer trims.
    code = textwrap.dedent("""
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        from specserve.runtime.proc_utils import HeapTrimmer, rss_mb

        libc.free(libc.malloc(16 << 20))
        blocks = []
        for _ in range(96):
            p = libc.malloc(2 << 20)
            ctypes.memset(p, 1, 2 << 20)
            blocks.append(p)
        for i, p in enumerate(blocks):
            if i % 8:
                libc.free(p)
        before = rss_mb()
        t = HeapTrimmer(1.0)
        t.after_step()
        t.idle()
        print(before, rss_mb(), t.trims)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    before, after, trims = float(out[0]), float(out[1]), int(out[2])
    assert trims == 1
    assert before - after > 100, (before, after)  # 84 freed blocks = 168 MiB
