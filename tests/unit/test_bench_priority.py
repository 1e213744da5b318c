"""bench_priority's pieces that need no server: the requests it sends and its table."""

from __future__ import annotations

from benchmark.bench_priority import _calls, build_parser, report
from specserve.corpora.datasets import load_bench_tokenizer, sample_requests


def test_every_request_carries_its_priority_and_ignores_eos():
    tok = load_bench_tokenizer(None)
    reqs = sample_requests("sharegpt", 3, tok, 0, 16, split="heldout")
    calls = _calls(reqs, 42, tok, ignore_eos=True)
    assert [c.path for c in calls] == ["/generate"] * 3
    assert all(c.payload["priority"] == 42 and c.payload["stream"] for c in calls)
    assert all(c.payload["sampling_params"]["ignore_eos"] for c in calls)


def _run(ttft_p50: float, bg: float, preempted: int, failed: int = 0) -> dict:
    dist = {"median": ttft_p50, "p90": ttft_p50 * 2, "p99": ttft_p50 * 3, "mean": ttft_p50}
    return {"probe_metrics": {"ttft_ms": dist, "e2e_ms": dist, "tpot_ms": dist},
            "background_tok_s": bg, "preempted": preempted, "failed_probes": failed,
            "background_errors": 2 * failed}


def test_report_gives_each_config_its_gain_over_the_first():
    args = vars(build_parser().parse_args([]))
    results = {"args": args, "configs": {
        "fcfs": {"median": _run(5000, 200.0, 0, 3), "rounds": [_run(5000, 200.0, 0, 3)] * 2},
        "priority": {"median": _run(250, 190.0, 14),
                     "rounds": [_run(250, 190.0, 14), _run(300, 195.0, 15)]},
    }}
    lines = report(results).splitlines()
    row = next(line for line in lines if line.strip().startswith("priority"))
    assert "20.0x" in row and "0.95x" in row and "250 / 300" in row and "14 / 15" in row
    fcfs = next(line for line in lines if line.strip().startswith("fcfs"))
    assert "1.0x" in fcfs and "3 / 3" in fcfs and "6 / 6" in fcfs
