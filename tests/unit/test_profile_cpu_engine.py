"""benchmark/profile_cpu_engine: tree forwards and chunked prefills, every phase timed."""

from __future__ import annotations

import json

import pytest

from benchmark.profile_cpu_engine import PHASES
from specserve.kernels import cpu

OK, WHY = cpu.available()


@pytest.mark.skipif(not OK, reason=f"CPU kernels unavailable: {WHY}")
def test_prefill_mode_times_each_prompt_over_its_chunks(tmp_path):
    from benchmark.profile_cpu_engine import main

    out = tmp_path / "p.json"
    report = main(["--prefill", "40", "--chunk", "16", "--batch", "3", "--context", "8",
                   "--steps", "2", "--output", str(out)])
    (run,) = report["runs"]
    assert run["prefill"] == 40 and run["chunk"] == 16 and run["batch"] == 3
    assert set(run["phases_ms"]) == set(PHASES)
    # a prompt's phases add up over its three chunks' forwards, inside its wall time
    assert all(run["phases_ms"][k] > 0 for k in ("qkv", "attention", "gate_up", "lm_head"))
    assert 0 < sum(run["phases_ms"].values()) <= run["wall_ms"] * 1.05
    assert json.loads(out.read_text())["runs"][0]["prefill"] == 40


@pytest.mark.skipif(not OK, reason=f"CPU kernels unavailable: {WHY}")
def test_tree_mode_times_each_size(tmp_path):
    from benchmark.profile_cpu_engine import main

    report = main(["--context", "8", "--tokens", "1,4", "--steps", "2",
                   "--output", str(tmp_path / "t.json")])
    assert [r["tokens"] for r in report["runs"]] == [1, 4]
    for r in report["runs"]:
        assert 0 < sum(r["phases_ms"].values()) <= r["wall_ms"] * 1.05
