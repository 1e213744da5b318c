"""benchmark/sweep_serving --rounds: every server up at once, configurations taking turns in
rotating order from flushed servers, each cell its median round."""

from __future__ import annotations

import argparse
import contextlib

import pytest

from benchmark import sweep_serving as sw


def sweep_args(**kw) -> argparse.Namespace:
    """The parser's defaults (every option the sweep reads), with `kw` set."""
    args = sw.build_parser().parse_args(["--config", "x="])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_interleaved_rounds_rotate_flush_and_keep_the_median(monkeypatch, tmp_path):
    events: list[tuple] = []
    started: list[str] = []
    checkouts: dict[str, object] = {}

    @contextlib.contextmanager
    def fake_server(args, log_path, timeout_s=300, checkout=sw.ROOT):
        url = f"http://{args[0]}"
        started.append(url)
        checkouts[url] = checkout
        yield url
        events.append(("stop", url))

    throughput = {"http://a": [10.0, 30.0, 20.0] * 2, "http://b": [5.0, 6.0, 7.0] * 2}

    async def fake_bench(reqs, cfg, tokenizer):
        events.append(("run", cfg.base_url, cfg.max_concurrency, len(reqs)))
        assert cfg.logprobs == (5 if cfg.base_url == "http://b" else None)  # --logprobs B=5
        tps = throughput[cfg.base_url].pop(0)
        return {"metrics": {"output_throughput": tps, "completed": len(reqs)},
                "server_info": {"url": cfg.base_url}}

    monkeypatch.setattr(sw, "server", fake_server)
    monkeypatch.setattr(sw, "run_benchmark", fake_bench)
    monkeypatch.setattr(sw, "_flush", lambda url: events.append(("flush", url)))
    monkeypatch.setattr(sw, "load_bench_tokenizer", lambda _: None)
    monkeypatch.setattr(sw, "sample_requests",
                        lambda ds, n, tok, seed, mx, split, **kw: list(range(n)))
    args = sweep_args(
        config=[("A", ["a"]), ("B", ["b"])], common_args="", concurrency=[1, 4],
        dataset="sharegpt", split="heldout", num_prompts=2, prompts_per_slot=2,
        max_new_tokens=8, seed=1, rounds=3, output=str(tmp_path / "s.json"),
        logprobs={"B": 5}, checkout={"A": tmp_path})
    res = sw.run_interleaved(args)
    assert started == ["http://a", "http://b"]  # all servers first
    assert checkouts == {"http://a": tmp_path, "http://b": sw.ROOT}  # --checkout A=DIR
    runs = [e for e in events if e[0] == "run"]
    # every run follows a flush of its own server
    for i, e in enumerate(events):
        if e[0] == "run":
            assert events[i - 1] == ("flush", e[1])
    order = [e[1][-1].upper() for e in runs]
    # c=1: rounds start with A, B, A; c=4: B, A, B (the first rotates)
    assert order == list("ABBAAB") + list("BAABBA")
    assert [e[3] for e in runs] == [2] * 6 + [8] * 6  # prompts per level: 2 per slot
    a1 = res["A"]["levels"]["1"]
    assert a1["rounds_output_throughput"] == [10.0, 30.0, 20.0]
    assert a1["metrics"]["output_throughput"] == 20.0  # the median round
    assert res["B"]["levels"]["4"]["metrics"]["output_throughput"] == 6.0
    assert events[-2:] == [("stop", "http://b"), ("stop", "http://a")]


def test_sequential_sweep_serves_every_level_from_one_server_each(monkeypatch, tmp_path):
    events: list[tuple] = []

    @contextlib.contextmanager
    def fake_server(args, log_path, timeout_s=300, checkout=sw.ROOT):
        events.append(("start", args[0]))
        yield f"http://{args[0]}"
        events.append(("stop", args[0]))

    async def fake_bench(reqs, cfg, tokenizer):
        events.append(("run", cfg.base_url, cfg.max_concurrency, len(reqs)))
        return {"metrics": {"output_throughput": 1.0, "completed": len(reqs)},
                "server_info": {}}

    monkeypatch.setattr(sw, "server", fake_server)
    monkeypatch.setattr(sw, "run_benchmark", fake_bench)
    monkeypatch.setattr(sw, "load_bench_tokenizer", lambda _: None)
    monkeypatch.setattr(sw, "sample_requests",
                        lambda ds, n, tok, seed, mx, split, **kw: list(range(n)))
    args = sweep_args(
        config=[("A", ["a"]), ("B", ["b"])], common_args="", concurrency=[1, 8],
        dataset="sharegpt", split="heldout", num_prompts=4, prompts_per_slot=2,
        max_new_tokens=8, seed=1, rounds=0, output=str(tmp_path / "s.json"), logprobs={})
    res = sw.run_sweep(args)
    assert events == [("start", "a"), ("run", "http://a", 1, 4), ("run", "http://a", 8, 16),
                      ("stop", "a"), ("start", "b"), ("run", "http://b", 1, 4),
                      ("run", "http://b", 8, 16), ("stop", "b")]
    assert set(res["B"]["levels"]) == {"1", "8"}


def _level(tps: float, rounds: list[float] | None = None, tpot: float | None = None) -> dict:
    m = {"output_throughput": tps, "completed": 4, "failed": 0,
         "ttft_ms": {"median": 1.0, "p99": 2.0}, "itl_ms": {"median": 3.0, "p99": 4.0}}
    if tpot is not None:  # (JSONs from before the TPOT column have none)
        m["tpot_ms"] = {"median": tpot}
    out = {"metrics": m, "server_info": {}}
    if rounds is not None:
        out["rounds_output_throughput"] = rounds
    return out


def test_paired_ratio_pairs_rounds_and_the_report_prints_it(tmp_path, capsys):
    # the baseline drifts between rounds; the candidate is 0.9x of it in every round: the ratio
    # of the medians reads 1.2x, the paired ratio 0.9x
    base, cand = [100.0, 200.0, 300.0], [90.0, 180.0, 270.0]
    assert sw.paired_ratio(cand, base) == 0.9
    assert sw.paired_ratio(cand, base[:2]) is None  # rounds that do not pair
    assert sw.paired_ratio([], []) is None
    results = {"none": {"server_args": [], "levels": {"1": _level(150.0, base)}},
               "X": {"server_args": [], "levels": {"1": _level(180.0, cand, tpot=17.5)}}}
    table = sw.report(results)
    assert "paired" in table.splitlines()[0] and "TPOT med ms" in table.splitlines()[0]
    x_row = [line for line in table.splitlines() if line.strip().startswith("X")][0]
    assert "1.20x" in x_row and "0.90x" in x_row and "17.5" in x_row
    # a sequential sweep's JSON has no rounds: no paired column
    seq = {"none": {"server_args": [], "levels": {"1": _level(150.0)}},
           "X": {"server_args": [], "levels": {"1": _level(180.0)}}}
    assert "paired" not in sw.report(seq)
    path = tmp_path / "s.json"
    path.write_text(__import__("json").dumps({"results": results}))
    # the per-round ratios' range: here every round is 0.9x; a drifting candidate spreads it
    assert sw.paired_range(cand, base) == (0.9, 0.9)
    assert sw.paired_range([110.0, 160.0, 330.0], base) == (0.8, 1.1)
    assert sw.paired_range(cand, base[:2]) is None
    assert "0.90-0.90" in x_row and "round ratios" in table.splitlines()[0]
    assert sw.main(["--report", str(path)]) == 0
    assert "0.90x" in capsys.readouterr().out


def test_a_stopped_benchmark_still_stops_the_servers_it_started(tmp_path):
    """SIGTERM to a benchmark (kill, a CI timeout) runs its `finally` blocks, so a server it
    started (here a sleeping child, stopped in `finally` as `sw.server` does) does not outlive
    it; Python's default SIGTERM left it running."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        "from benchmark.common import stop_children_on_sigterm\n"
        "stop_children_on_sigterm()\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "open(sys.argv[1], 'w').write(str(child.pid))\n"
        "try:\n"
        "    time.sleep(120)\n"
        "finally:\n"
        "    child.terminate()\n"
        "    child.wait()\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", code, str(pid_file)], cwd=root,
                            env={**os.environ, "PYTHONPATH": root})
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, "the benchmark did not start"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    try:
        os.kill(child, 0)
    except ProcessLookupError:
        return  # stopped (and reaped by the benchmark)
    raise AssertionError(f"the child {child} outlived the stopped benchmark")


def test_logprobs_option_names_a_configuration():
    assert sw.parse_logprobs("lp=5") == ("lp", 5)
    for bad in ("lp", "=5", "lp=x"):
        with pytest.raises(argparse.ArgumentTypeError):
            sw.parse_logprobs(bad)
    with pytest.raises(SystemExit):
        sw.main(["--config", "none=", "--logprobs", "other=3"])


def test_checkout_names_a_checkout_and_a_configuration(tmp_path):
    (tmp_path / "launch_server.py").write_text("")
    p = sw.build_parser()
    args = p.parse_args(["--config", "old=", "--checkout", f"old={tmp_path}"])
    assert args.checkout == [("old", tmp_path.resolve())]
    with pytest.raises(SystemExit):  # a directory that is no checkout of this repository
        p.parse_args(["--config", "old=", "--checkout", f"old={tmp_path / 'nothing'}"])
    with pytest.raises(SystemExit):  # a label no --config has
        sw.main(["--config", "new=", "--checkout", f"old={tmp_path}"])
