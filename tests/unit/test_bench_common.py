"""Engine specs shared by the engine benchmarks (bench_one_batch, bench_engine_quality)."""

from __future__ import annotations

from benchmark.common import parse_engine_spec


def test_engine_specs_parse_format_digits_isa_and_kv_dtype():
    assert parse_engine_spec("auto") == ("auto", None, None, None)
    assert parse_engine_spec("q4_1:1") == ("q4_1", 1, None, None)
    assert parse_engine_spec("auto@avx512") == ("auto", None, "avx512", None)
    assert parse_engine_spec("auto:3@amx/float16") == ("auto", 3, "amx", "float16")
    assert parse_engine_spec("torch/float32") == ("torch", None, None, "float32")


def test_the_verify_curve_plot_draws_each_engine(tmp_path, monkeypatch) -> None:
    import matplotlib.pyplot as plt

    from benchmark.plots import plot_verify_curve

    lines: list[list[str]] = []
    close = plt.close

    def keep(fig) -> None:
        lines.append([ln.get_label() for ln in fig.axes[0].get_lines()])
        close(fig)

    monkeypatch.setattr(plt, "close", keep)
    curve = [{"n": n, "time_s": 0.01 * r, "ratio_to_n1": r}
             for n, r in ((1, 1.0), (2, 1.2), (4, 1.7), (8, 2.6))]
    result = {"args": {"verify_prefix": 512},
              "engines": [{"engine": "auto", "verify_curve": curve},
                          {"engine": "auto:1", "verify_curve": curve}]}
    path = plot_verify_curve(result, tmp_path / "sub" / "curve.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert lines == [["auto", "auto:1", "rows for free", "no sharing (n x T(1))"]]
