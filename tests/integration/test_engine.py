"""`Engine`: the serving processes without HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specserve.launch import Engine
from specserve.runtime.errors import InvalidRequestError

pytestmark = pytest.mark.slow


def test_engine_generate_batch_stream_async_and_shutdown():
    greedy = {"max_new_tokens": 12, "temperature": 0}
    with Engine(log_level="warning", max_total_tokens=4096) as engine:
        one = engine.generate("The capital of France is", greedy)
        assert one["output_ids"] and one["meta_info"]["finish_reason"]["type"] in ("length", "stop")
        both = engine.generate(["The capital of France is", "Two plus two is"], greedy)
        assert both[0]["output_ids"] == one["output_ids"]
        chunks = list(engine.generate("The capital of France is", greedy, stream=True))
        assert len(chunks) >= 2 and chunks[-1]["text"] == one["text"]
        assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))
        assert chunks[-1]["output_ids"] == one["output_ids"]

        async def use_async():
            out = await engine.async_generate("The capital of France is", greedy)
            pieces = [c async for c in await engine.async_generate(
                "The capital of France is", greedy, stream=True)]
            return out, pieces

        out, pieces = asyncio.run(use_async())
        assert out["output_ids"] == one["output_ids"] and pieces[-1]["text"] == one["text"]
        # incremental_streaming_output: each chunk only what is new (read per stream)
        engine.server_args = dataclasses.replace(engine.server_args,
                                                 incremental_streaming_output=True)
        deltas = list(engine.generate("The capital of France is", greedy, stream=True))
        engine.server_args = dataclasses.replace(engine.server_args,
                                                 incremental_streaming_output=False)
        assert len(deltas) >= 2 and "".join(d["text"] for d in deltas) == one["text"]
        assert [t for d in deltas for t in d["output_ids"]] == one["output_ids"]
        with pytest.raises(InvalidRequestError, match="temperature"):
            engine.generate("hi", {"temperature": -1})
        # `priority` (ignored without --enable-priority-scheduling) reaches the same path
        assert engine.generate("The capital of France is", greedy, priority=7)["output_ids"] \
            == one["output_ids"]
        with pytest.raises(InvalidRequestError, match="priority"):
            engine.generate("hi", greedy, priority=2**31)
        seeded = {"max_new_tokens": 16, "temperature": 0.9, "seed": 123}
        assert engine.generate("Once", seeded)["output_ids"] == \
            engine.generate("Once", seeded)["output_ids"]
        # SGLang's `n`: a list, prompt by prompt, sample j seeded seed + j; samples after
        # the first take the prompt from the cache (a prompt of 32+ tokens: the scheduler
        # holds them until the first sample's prompt is cached); a short one's samples are not
        # held: those admitted beside its first prefill it again, later ones find it cached
        engine.flush_cache()
        tale = ("Once upon a time, in a small village at the edge of a great forest, there "
                "lived an old clockmaker who repaired every clock in the valley, and one "
                "winter night a stranger knocked at his door with")
        samples = engine.generate([tale, "Two plus two is"], {**seeded, "n": 3})
        assert len(samples) == 6
        short = samples[3]["meta_info"]["prompt_tokens"]
        assert samples[3]["meta_info"]["cached_tokens"] == 0
        assert {s["meta_info"]["cached_tokens"] for s in samples[4:]} <= {0, short - 1}
        assert [s["meta_info"]["cached_tokens"] for s in samples[:3]] == \
            [0] + [samples[0]["meta_info"]["prompt_tokens"] - 1] * 2
        assert samples[0]["output_ids"] == engine.generate(tale, seeded)["output_ids"]
        assert samples[1]["output_ids"] == engine.generate(
            tale, {**seeded, "seed": 124})["output_ids"]
        with pytest.raises(InvalidRequestError, match="sampling_params.n"):
            engine.generate("hi", {"n": 0})
        engine.flush_cache()
        info = engine.server_info()
        assert info["kv_free"] == info["kv_capacity"]
        procs = list(engine.backend.procs.values())
    assert not any(p.is_alive() for p in procs)


def test_an_engine_script_exits_cleanly_without_leaked_semaphore_warnings(tmp_path):
    """A script that starts and stops an Engine ends with nothing on stderr about leaked
    semaphores (a progress bar's default process-shared lock would be left behind by SIGTERM;
    specserve/runtime/proc_utils.py: thread_locks_for_progress_bars)."""
    script = tmp_path / "use_engine.py"
    script.write_text(textwrap.dedent("""
        from specserve.launch import Engine

        if __name__ == "__main__":
            with Engine(log_level="warning") as engine:
                engine.generate("Hi", {"max_new_tokens": 2, "temperature": 0})
    """))
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "leaked semaphore" not in r.stderr, r.stderr
