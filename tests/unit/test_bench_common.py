"""Engine specs shared by the engine benchmarks (bench_one_batch, bench_engine_quality)."""

from __future__ import annotations

from benchmark.common import parse_engine_spec


def test_engine_specs_parse_format_digits_isa_and_kv_dtype():
    assert parse_engine_spec("auto") == ("auto", None, None, None)
    assert parse_engine_spec("q4_1:1") == ("q4_1", 1, None, None)
    assert parse_engine_spec("auto@avx512") == ("auto", None, "avx512", None)
    assert parse_engine_spec("auto:3@amx/float16") == ("auto", 3, "amx", "float16")
    assert parse_engine_spec("torch/float32") == ("torch", None, None, "float32")
