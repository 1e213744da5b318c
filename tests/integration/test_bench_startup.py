"""benchmark.bench_startup: one round on the default model, plain decoding."""

from __future__ import annotations

import json

import pytest

from benchmark.bench_startup import main


@pytest.mark.slow
def test_bench_startup_times_ready_then_first_token(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["--algorithms", "none", "--rounds", "1", "--output", str(out)]) == 0
    res = json.loads(out.read_text())["results"]["none"]
    med = res["median"]
    assert 0 < med["ready_s"] < med["first_token_s"] < 300
    assert len(res["rounds"]) == 1
    assert capsys.readouterr().out.rstrip().splitlines()[-1].lstrip().startswith("none")


@pytest.mark.slow
def test_bench_startup_via_the_launcher_times_health_then_a_request(tmp_path, capsys):
    out = tmp_path / "l.json"
    assert main(["--via", "launcher", "--algorithms", "none", "--rounds", "1",
                 "--output", str(out)]) == 0
    med = json.loads(out.read_text())["results"]["none"]["median"]
    assert 0 < med["ready_s"] < med["first_token_s"] < 300 and med["stop_s"] > 0
    assert "via launcher" in capsys.readouterr().out
    assert (tmp_path / "l.none.log").exists()  # the server's own log, beside the JSON
