"""benchmark/bench_gemm: the model's shapes, every requested row count, a positive time each."""

from __future__ import annotations

import pytest

from benchmark.bench_gemm import model_shapes
from specserve.kernels import cpu

OK, WHY = cpu.available()


def test_shapes_follow_the_config():
    shapes = model_shapes({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                           "intermediate_size": 96, "vocab_size": 300})
    assert shapes["qkv"][:2] == ((4 + 2 * 2) * 16, 64)
    assert shapes["gate_up"] == (192, 64, 2) and shapes["down"][:2] == (64, 96)
    assert shapes["lm_head"][:2] == (300, 64)


@pytest.mark.skipif(not OK, reason=f"CPU kernels unavailable: {WHY}")
def test_times_every_row_count_of_the_default_model(tmp_path):
    from benchmark.bench_gemm import main

    report = main(["--rows", "1,33", "--shapes", "qkv,gate_up", "--reps", "3", "--threads", "1",
                   "--quantize", "--output", str(tmp_path / "g.json")])
    assert [c["rows"] for c in report["results"]] == [1, 33]
    for cell in report["results"]:
        assert set(cell["ms"]) == {"qkv", "gate_up"} and all(v > 0 for v in cell["ms"].values())
        assert cell["per_row_ms"] == pytest.approx(cell["per_forward_ms"] / cell["rows"])
        assert set(cell["quantize_ms"]) == {"qkv", "gate_up"}
        assert cell["quantize_per_forward_ms"] == pytest.approx(
            report["layers"] * sum(cell["quantize_ms"].values()))
    assert (tmp_path / "g.json").exists()
