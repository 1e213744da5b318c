"""The draft-cost model's arithmetic on a hand-made result: tau = 1 + sum of per-position
acceptance, k measured = target ms per token / draft ms per token, speedup tau / (1 + S / k)."""

from __future__ import annotations

from benchmark.draft_cost_model import KS, rows


def test_model_rows_follow_the_formula():
    result = {"runs": [
        {"dataset": "d", "concurrency": 1, "temperature": 0.0, "config": "baseline",
         "metrics": {"output_tokens_per_s": 100.0}},
        {"dataset": "d", "concurrency": 1, "temperature": 0.0, "config": "STANDALONE",
         "metrics": {"output_tokens_per_s": 80.0, "draft_tokens_per_step": 3.0,
                     "draft_ms_per_step": 6.0, "accept_rate_per_pos": [0.5, 0.25, 0.25]}},
        {"dataset": "d", "concurrency": 4, "temperature": 0.0, "config": "STANDALONE",
         "metrics": {"output_tokens_per_s": 1.0, "draft_tokens_per_step": 3.0,
                     "draft_ms_per_step": 6.0, "accept_rate_per_pos": [0.9]}},
    ]}
    (row,) = rows(result)
    assert row[:6] == ["d", "STANDALONE", "2.00", "2.00", "10.00", "5.0"]
    assert row[6:] == [f"{2.0 / (1 + 3.0 / k):.2f}x" for k in KS]
