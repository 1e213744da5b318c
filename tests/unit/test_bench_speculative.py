"""bench_speculative without an engine: config strings, metric arithmetic on hand-built records,
comparisons against the baseline, the summary table and the plot."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI, Request

from benchmark import bench_speculative
from benchmark.bench_speculative import attach_comparisons, parse_args
from benchmark.plots import plot_speculative
from benchmark.spec_metrics import (
    ConfigError,
    SpecCounters,
    SpecRecord,
    compare_to_baseline,
    first_mismatch,
    parse_spec_config,
    parse_spec_configs,
    spec_metrics,
    speedup,
    summarize_run,
    summary_table,
)
from benchmark.spec_runner import fill_record, render_prompts, run_requests, sampling_params
from specserve.corpora.datasets import BenchRequest
from tests.helpers.live_server import live_server


# ---- config strings --------------------------------------------------------------------------
def test_config_bare_algorithm_sets_only_the_algorithm() -> None:
    cfg = parse_spec_config("ngram")
    assert cfg.label == "NGRAM"
    assert cfg.server_args == {"speculative_algorithm": "NGRAM"}
    assert not cfg.is_baseline


def test_config_keys_map_to_typed_speculative_server_args() -> None:
    cfg = parse_spec_config("NGRAM:num_draft_tokens=16, ngram_match_type=PROB,"
                            "disable_adaptive=true,accept_threshold_single=0.5")
    assert cfg.server_args == {
        "speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 16,
        "speculative_ngram_match_type": "PROB", "speculative_disable_adaptive": True,
        "speculative_accept_threshold_single": 0.5,
    }
    assert cfg.label == ("NGRAM:num_draft_tokens=16,ngram_match_type=PROB,disable_adaptive=true,"
                         "accept_threshold_single=0.5")


def test_config_accepts_the_full_field_name_too() -> None:
    cfg = parse_spec_config("NGRAM:speculative_num_draft_tokens=4")
    assert cfg.server_args["speculative_num_draft_tokens"] == 4


@pytest.mark.parametrize("text, message", [
    ("NGRAM:draft_tokens=16", "unknown key 'draft_tokens'"),
    ("NGRAM:algorithm=EAGLE", "unknown key 'algorithm'"),
    ("NGRAM:num_draft_tokens", "is not key=value"),
    ("NGRAM:num_draft_tokens=lots", "bad value for 'num_draft_tokens'"),
    ("NGRAM:disable_adaptive=maybe", "bad value for 'disable_adaptive'"),
    ("NGRAM:num_draft_tokens=4,num_draft_tokens=8", "given twice"),
    (":num_draft_tokens=4", "no algorithm"),
    ("none", "baseline"),
])
def test_config_errors_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_spec_config(text)


def test_unknown_key_error_lists_known_keys() -> None:
    with pytest.raises(ConfigError) as exc:
        parse_spec_config("NGRAM:bogus=1")
    assert "num_draft_tokens" in str(exc.value) and "ngram_match_type" in str(exc.value)


def test_duplicate_configs_are_rejected() -> None:
    with pytest.raises(ConfigError, match="given twice"):
        parse_spec_configs(["NGRAM", "ngram"])


def test_cli_parses_concurrency_list_and_rejects_configs_with_base_url() -> None:
    args = parse_args(["--concurrency", "8,1,8", "--configs", "NGRAM", "NGRAM:num_draft_tokens=4"])
    assert args.concurrency == [1, 8]
    assert args.split == "heldout" and args.max_new_tokens == 128 and args.temperature == [0.0]
    with pytest.raises(SystemExit):
        parse_args(["--base-url", "http://x", "--configs", "NGRAM"])
    with pytest.raises(SystemExit):
        parse_args(["--concurrency", "0"])


@pytest.mark.parametrize("text, temps", [
    ("0.7", [0.7]),  # a single value, as before
    ("0", [0.0]),
    ("0.7,0, 0.70,", [0.0, 0.7]),  # sorted, duplicates and empty items dropped
    ("-0", [0.0]),
    ("1e-1,2", [0.1, 2.0]),
])
def test_cli_parses_temperature_list(text: str, temps: list[float]) -> None:
    args = parse_args(["--temperature", text])
    assert args.temperature == temps
    assert all(type(t) is float for t in args.temperature)


@pytest.mark.parametrize("text, message", [
    ("-1", "finite and >= 0"),
    ("0,-0.5", "finite and >= 0"),
    ("nan", "finite and >= 0"),
    ("0,inf", "finite and >= 0"),
    ("0,hot", "'hot' is not a number"),
    (",", "no temperature"),
])
def test_cli_rejects_bad_temperatures(text: str, message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--temperature", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--temperature" in err and message in err


def test_cli_compare_hf_needs_a_greedy_temperature(capsys) -> None:
    assert parse_args(["--compare-hf", "--temperature", "0,0.7"]).temperature == [0.0, 0.7]
    with pytest.raises(SystemExit):
        parse_args(["--compare-hf", "--temperature", "0.7"])
    assert "add 0 to --temperature, e.g. --temperature 0,0.7" in capsys.readouterr().err


# ---- metric arithmetic -----------------------------------------------------------------------
def test_counter_delta_pads_per_position_counts() -> None:
    before = SpecCounters(3, 14, 9, (2, 2, 1))
    after = SpecCounters(13, 84, 29, (8, 6, 3, 2, 1))
    assert after.minus(before) == SpecCounters(10, 70, 20, (6, 4, 2, 2, 1))
    assert after.minus(None) == after


def test_counters_from_server_info() -> None:
    info = {"spec_verify_steps": 5, "spec_decode_num_draft_tokens": 35,
            "spec_decode_num_accepted_tokens": 7,
            "spec_decode_num_accepted_tokens_per_pos": [4, 2, 1]}
    assert SpecCounters.from_server_info(info) == SpecCounters(5, 35, 7, (4, 2, 1))
    assert SpecCounters.from_server_info({"num_running_reqs": 0}) is None
    assert SpecCounters.from_server_info(None) is None


def test_spec_metrics_definitions() -> None:
    # 10 verify steps drafting 7 nodes each; 6 steps accepted >= 1, 4 >= 2, 2 >= 3, 1 >= 4
    c = SpecCounters(verify_steps=10, draft_tokens=70, accepted_tokens=13,
                     accepted_per_pos=(6, 4, 2, 1))
    m = spec_metrics(completion_tokens=24, counters=c)
    assert m["accept_length"] == pytest.approx(2.4)
    assert m["accept_rate_per_pos"] == pytest.approx([0.6, 0.4, 0.2, 0.1])
    assert m["draft_tokens_per_step"] == pytest.approx(7.0)
    assert m["accepted_per_step"] == pytest.approx(1.3)
    assert m["accept_rate"] == pytest.approx(13 / 70)


def test_spec_metrics_without_verify_steps_are_empty() -> None:
    for counters in (None, SpecCounters()):
        m = spec_metrics(100, counters)
        assert m["accept_length"] is None and m["accept_rate_per_pos"] == []


def _rec(rid: str, tokens: int, e2e: float, ids: list[int] | None = None,
         ok: bool = True, verify: int | None = None) -> SpecRecord:
    return SpecRecord(rid, "rewrite:repeat", 50, 64, success=ok, completion_tokens=tokens,
                      e2e_s=e2e, output_ids=ids or [], spec_verify_ct=verify)


def test_summarize_run_throughput_median_and_failures() -> None:
    recs = [_rec("a", 40, 2.0), _rec("b", 60, 2.0), _rec("c", 30, 3.0),
            _rec("d", 0, 0.0, ok=False)]
    m = summarize_run(recs, wall_s=5.0, counters=SpecCounters(50, 350, 80, (30, 20)))
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_output_tokens"] == 130
    assert m["output_tokens_per_s"] == pytest.approx(26.0)
    assert m["median_request_tokens_per_s"] == pytest.approx(20.0)  # of 20, 30, 10
    assert m["accept_length"] == pytest.approx(130 / 50)
    assert m["accept_rate_per_pos"] == pytest.approx([0.6, 0.4])


def test_summarize_run_falls_back_to_per_request_verify_counts() -> None:
    recs = [_rec("a", 40, 2.0, verify=10), _rec("b", 60, 2.0, verify=20)]
    m = summarize_run(recs, wall_s=4.0, counters=None)
    assert m["accept_length"] == pytest.approx(100 / 30)
    assert m["accept_rate_per_pos"] == []


def test_speedup_and_missing_values() -> None:
    assert speedup(30.0, 12.0) == pytest.approx(2.5)
    assert speedup(None, 12.0) is None and speedup(30.0, 0.0) is None


# ---- losslessness ----------------------------------------------------------------------------
def test_first_mismatch_positions() -> None:
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


def test_compare_to_baseline_counts_differing_outputs_by_id() -> None:
    base = [_rec("a", 3, 1, [1, 2, 3]), _rec("b", 3, 1, [4, 5, 6]), _rec("c", 0, 0, ok=False)]
    cand = [_rec("b", 3, 1, [4, 5, 7]), _rec("a", 3, 1, [1, 2, 3]), _rec("c", 2, 1, [9, 9])]
    assert compare_to_baseline(cand, base) == 1
    assert [r.matches_baseline for r in cand] == [False, True, None]
    assert cand[0].first_mismatch == 2


def _run(config: str, c: int, tps: float, recs: list[SpecRecord], temperature: float = 0.0,
         **metrics) -> dict:
    return {"dataset": "rewrite", "config": config, "concurrency": c,
            "temperature": temperature, "records": recs,
            "metrics": {"output_tokens_per_s": tps, "median_request_tokens_per_s": tps,
                        "completed": len(recs), "accept_length": None,
                        "draft_tokens_per_step": None, "accept_rate_per_pos": [], **metrics}}


def _fake_result(temperature: float = 0.0) -> dict:
    same = [_rec("a", 3, 1, [1, 2, 3]), _rec("b", 3, 1, [4, 5, 6])]
    other = [_rec("a", 3, 1, [1, 2, 3]), _rec("b", 3, 1, [4, 0, 6])]
    t = temperature
    runs = [
        _run("baseline", 1, 20.0, same, t),
        _run("NGRAM", 1, 50.0, other, t, accept_length=3.1, draft_tokens_per_step=7.0,
             accept_rate_per_pos=[0.7, 0.5, 0.4, 0.3]),
        _run("baseline", 8, 80.0, same, t),
        _run("NGRAM", 8, 120.0, same, t, accept_length=2.9, draft_tokens_per_step=6.5,
             accept_rate_per_pos=[0.65, 0.45, 0.3]),
    ]
    hf = {"rewrite": {
        "generate": {"output_tokens_per_s": 12.5, "median_request_tokens_per_s": 12.0,
                     "completed": 2, "records": same},
        "prompt_lookup": {"output_tokens_per_s": 25.0, "median_request_tokens_per_s": 24.0,
                          "completed": 2, "records": same},
    }}
    return {"title": "test", "baseline_label": "baseline", "runs": runs, "hf": hf}


def test_attach_comparisons_speedup_mismatches_and_hf() -> None:
    result = _fake_result()
    attach_comparisons(result["runs"], "baseline", result["hf"])
    base1, ngram1, base8, ngram8 = (r["metrics"] for r in result["runs"])
    assert base1["speedup"] == 1.0 and "mismatches" not in base1
    assert ngram1["speedup"] == pytest.approx(2.5)  # against baseline c=1, not c=8
    assert ngram8["speedup"] == pytest.approx(1.5)
    assert ngram1["mismatches"] == 1 and ngram8["mismatches"] == 0
    assert ngram1["vs_hf_prompt_lookup"] == pytest.approx(2.0)
    assert "vs_hf_prompt_lookup" not in ngram8  # HF runs batch 1 only
    assert result["hf"]["rewrite"]["generate"]["mismatches"] == 0
    table = summary_table(result)
    lines = table.splitlines()
    assert "speedup" in lines[0] and "acc@1" in lines[0]
    assert lines[0].split()[:4] == ["dataset", "conc", "T", "config"]
    assert lines[3].split()[:4] == ["rewrite", "1", "0", "NGRAM"]
    assert "2.50x" in lines[3] and "1/2" in lines[3] and "0.70" in lines[3]
    assert "HF prompt lookup" in lines[-1] and lines[-1].split()[:3] == ["rewrite", "1", "0"]


def test_sampled_runs_skip_the_lossless_and_hf_checks() -> None:
    result = _fake_result(temperature=0.7)
    attach_comparisons(result["runs"], "baseline", result["hf"])
    assert all("mismatches" not in r["metrics"] for r in result["runs"])
    assert all("vs_hf_prompt_lookup" not in r["metrics"] for r in result["runs"])
    assert result["runs"][1]["metrics"]["speedup"] == pytest.approx(2.5)  # speedup all the same
    assert all("mismatches" not in h for h in result["hf"]["rewrite"].values())  # no T=0 base


def _two_temperature_result() -> dict:
    """c = 1, T = 0 and 0.7, in engine order (per config, every temperature): the baseline is
    faster at T = 0.7, NGRAM's sampled outputs differ from the baseline's (as they may)."""
    same = [_rec("a", 3, 1, [1, 2, 3]), _rec("b", 3, 1, [4, 5, 6])]
    sampled = [_rec("a", 3, 1, [7, 8, 9]), _rec("b", 3, 1, [4, 0, 6])]
    result = _fake_result()
    result["runs"] = [
        _run("baseline", 1, 20.0, same, 0.0),
        _run("baseline", 1, 25.0, same, 0.7),
        _run("NGRAM", 1, 50.0, list(same), 0.0, accept_length=3.1,
             accept_rate_per_pos=[0.7, 0.5, 0.4]),
        _run("NGRAM", 1, 30.0, sampled, 0.7, accept_length=1.8,
             accept_rate_per_pos=[0.4, 0.2, 0.1]),
    ]
    return result


def test_baseline_matched_per_temperature() -> None:
    result = _two_temperature_result()
    attach_comparisons(result["runs"], "baseline", result["hf"])
    base0, base7, ngram0, ngram7 = (r["metrics"] for r in result["runs"])
    assert base0["speedup"] == 1.0 and base7["speedup"] == 1.0
    assert ngram0["speedup"] == pytest.approx(50 / 20)  # against the T = 0 baseline
    assert ngram7["speedup"] == pytest.approx(30 / 25)  # against the T = 0.7 baseline
    # greedy runs only: the sampled outputs differ but are not counted as mismatches
    assert ngram0["mismatches"] == 0 and "mismatches" not in ngram7
    assert all(r.matches_baseline is None for r in result["runs"][3]["records"])
    # HF (greedy) against c = 1, T = 0 only
    assert ngram0["vs_hf_prompt_lookup"] == pytest.approx(2.0)
    assert "vs_hf_prompt_lookup" not in ngram7
    assert result["hf"]["rewrite"]["prompt_lookup"]["mismatches"] == 0


def test_summary_table_has_a_row_per_temperature_baseline_first() -> None:
    result = _two_temperature_result()
    attach_comparisons(result["runs"], "baseline", result["hf"])
    rows = [line.split() for line in summary_table(result).splitlines()[2:]]
    # grouped by temperature (baseline next to its candidates), HF rows last at T = 0
    assert [r[2:4] for r in rows] == [["0", "baseline"], ["0", "NGRAM"], ["0.7", "baseline"],
                                      ["0.7", "NGRAM"], ["0", "HF"], ["0", "HF"]]
    assert "2.50x" in rows[1] and "0/2" in rows[1] and "2.00x" in rows[1]
    assert "1.20x" in rows[3] and rows[3][-2:] == ["-", "-"]  # no mismatch, no vs HF at T=0.7


@pytest.mark.parametrize("make", [_fake_result, _two_temperature_result])
def test_plot_file_written_from_fake_result(tmp_path, make) -> None:
    result = make()
    attach_comparisons(result["runs"], "baseline", result["hf"])
    path = plot_speculative(result, tmp_path / "sub" / "spec.png")
    assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_plot_labels_name_the_temperature_only_when_several(tmp_path, monkeypatch) -> None:
    import matplotlib.pyplot as plt

    legends: list[list[str]] = []
    close = plt.close

    def keep_labels(fig) -> None:
        for ax in fig.axes:
            legends.append([t.get_text() for t in ax.get_legend().get_texts()])
        close(fig)

    monkeypatch.setattr(plt, "close", keep_labels)
    for make in (_fake_result, _two_temperature_result):
        result = make()
        attach_comparisons(result["runs"], "baseline", result["hf"])
        plot_speculative(result, tmp_path / "spec.png")
    assert legends[0] == ["NGRAM"]
    assert legends[2] == ["NGRAM T=0", "NGRAM T=0.7"]
    # acceptance panel: colours per config, a line style per dataset (and temperature), a
    # marker per concurrency
    assert legends[1] == ["NGRAM", "rewrite", "c=1", "c=8"]
    assert legends[3] == ["NGRAM", "rewrite T=0", "rewrite T=0.7", "c=1"]


# ---- request plumbing with a fake target -----------------------------------------------------
class FakeTarget:
    """Echoes the prompt's last token `n` times; records the most requests in flight."""

    def __init__(self) -> None:
        self.in_flight = self.peak = 0
        self.params: list[dict] = []

    def session(self) -> _AsyncNull:
        return _AsyncNull(self)

    async def generate(self, input_ids: list[int], params: dict) -> dict:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        self.params.append(params)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        n = params["max_new_tokens"]
        return {"text": "", "output_ids": [input_ids[-1]] * n,
                "meta_info": {"completion_tokens": n, "finish_reason": {"type": "length"},
                              "spec_verify_ct": 2}}

    def server_info(self) -> dict | None:
        return None


class _AsyncNull:
    def __init__(self, value) -> None:
        self.value = value

    async def __aenter__(self):
        return self.value

    async def __aexit__(self, *exc) -> None:
        return None


@pytest.mark.parametrize("concurrency, peak", [(1, 1), (3, 3)])
def test_run_requests_respects_concurrency(concurrency: int, peak: int) -> None:
    reqs = [BenchRequest(id=f"r{i}", prompt_len=2, max_new_tokens=4, input_ids=[1, i])
            for i in range(6)]
    target = FakeTarget()
    records, wall = asyncio.run(run_requests(target, reqs, [r.input_ids for r in reqs],
                                             concurrency, 0.5, 7, "t", True))
    assert target.peak == peak
    assert wall > 0 and all(r.success and r.completion_tokens == 4 for r in records)
    assert [r.output_ids[0] for r in records] == list(range(6))
    assert [p["seed"] for p in target.params] == list(range(7, 13))  # per request when sampling


def test_greedy_sampling_params_carry_no_seed() -> None:
    req = BenchRequest(id="x", prompt_len=1, max_new_tokens=9)
    assert sampling_params(req, 0.0, 3) == {"max_new_tokens": 9, "temperature": 0.0}


def test_unseeded_sampled_requests_carry_no_seed() -> None:
    req = BenchRequest(id="x", prompt_len=1, max_new_tokens=9)
    assert sampling_params(req, 0.7, None) == {"max_new_tokens": 9, "temperature": 0.7}
    assert sampling_params(req, 0.7, 4)["seed"] == 4


def test_top_p_and_top_k_reach_sampled_requests_only() -> None:
    req = BenchRequest(id="x", prompt_len=1, max_new_tokens=9)
    filters = bench_speculative.sampling_filters(parse_args(["--top-p", "0.9", "--top-k", "50"]))
    assert filters == {"top_p": 0.9, "top_k": 50}
    assert sampling_params(req, 0.7, 4, filters) == {"max_new_tokens": 9, "temperature": 0.7,
                                                     "top_p": 0.9, "top_k": 50, "seed": 4}
    assert sampling_params(req, 0.0, 4, filters) == {"max_new_tokens": 9, "temperature": 0.0}
    assert bench_speculative.sampling_filters(parse_args([])) == {}
    with pytest.raises(SystemExit):
        parse_args(["--top-p", "0"])


def test_fill_record_marks_aborts_as_failures() -> None:
    rec = SpecRecord("x", "k", 3, 8)
    fill_record(rec, {"output_ids": [1], "meta_info": {"finish_reason": {"type": "abort"}}}, 0.1)
    assert not rec.success and "abort" in rec.error


def test_render_prompts_uses_chat_template_for_messages() -> None:
    reqs = [BenchRequest(id="m", prompt_len=0, max_new_tokens=1, messages=[{"role": "user",
                                                                          "content": "hi"}]),
            BenchRequest(id="p", prompt_len=0, max_new_tokens=1, prompt="a b"),
            BenchRequest(id="i", prompt_len=0, max_new_tokens=1, input_ids=[5, 6])]
    out = render_prompts(reqs, lambda m: [99, len(m)], lambda t: [len(w) for w in t.split()])
    assert out == [[99, 1], [1, 1], [5, 6]]


# ---- engine mode with fake engines ----------------------------------------------------------
class FakeEngine:
    """What run_engines uses of an Engine: echoes like FakeTarget, logs every call."""

    def __init__(self, label: str, log: list) -> None:
        self.label, self.log = label, log
        self.tm = type("TM", (), {"chat_ids": staticmethod(lambda m: [1, 2]),
                                  "tokenize": staticmethod(lambda t: [3])})()

    async def async_generate(self, input_ids: list[int], sampling_params: dict) -> dict:
        self.log.append((self.label, "generate", sampling_params["temperature"]))
        n = sampling_params["max_new_tokens"]
        return {"output_ids": [input_ids[-1]] * n,
                "meta_info": {"completion_tokens": n, "finish_reason": {"type": "length"}}}

    def server_info(self) -> dict:
        return {}

    def flush_cache(self) -> bool:
        self.log.append((self.label, "flush"))
        return True

    def shutdown(self) -> None:
        self.log.append((self.label, "shutdown"))


def _fake_engines(monkeypatch) -> tuple[list, list]:
    log: list = []
    started: list = []

    def start(args, cfg):
        started.append(cfg.label)
        log.append((cfg.label, "start"))
        return FakeEngine(cfg.label, log)

    monkeypatch.setattr(bench_speculative, "start_engine", start)
    return log, started


def test_run_engines_measures_every_temperature_on_one_engine(monkeypatch) -> None:
    log, started = _fake_engines(monkeypatch)
    args = parse_args(["--temperature", "0.7,0", "--concurrency", "1,2", "--disable-tqdm",
                       "--no-interleave", "--unseeded"])
    reqs = [BenchRequest(id=f"r{i}", prompt_len=2, max_new_tokens=3, input_ids=[1, i])
            for i in range(2)]
    prompts: dict = {}
    runs = bench_speculative.run_engines(args, parse_spec_configs(["NGRAM"]), {"rewrite": reqs},
                                         prompts)
    assert prompts == {"rewrite": [[1, 0], [1, 1]]}
    assert started == ["baseline", "NGRAM"] * 2  # per concurrency and config, not per T
    assert [(r["concurrency"], r["config"], r["temperature"]) for r in runs] == [
        (c, cfg, t) for c in (1, 2) for cfg in ("baseline", "NGRAM") for t in (0.0, 0.7)]
    # per engine: T = 0 requests, a flush, T = 0.7 requests, shutdown
    assert log[:6] == [("baseline", "start"), ("baseline", "generate", 0.0),
                       ("baseline", "generate", 0.0), ("baseline", "flush"),
                       ("baseline", "generate", 0.7), ("baseline", "generate", 0.7)]
    assert log[6] == ("baseline", "shutdown")
    attach_comparisons(runs, "baseline")
    # unseeded sampled outputs are not expected to match: only greedy runs are compared
    assert [r["metrics"].get("mismatches") for r in runs if r["config"] == "NGRAM"] == [
        0, None, 0, None]


def test_interleaved_engines_take_turns_request_by_request(monkeypatch) -> None:
    log, started = _fake_engines(monkeypatch)
    args = parse_args(["--temperature", "0,0.7", "--disable-tqdm"])
    assert args.interleave  # the default
    reqs = [BenchRequest(id=f"r{i}", prompt_len=2, max_new_tokens=3, input_ids=[1, i])
            for i in range(3)]
    labels = ["baseline", "NGRAM", "NGRAM:num_draft_tokens=4"]
    runs = bench_speculative.run_engines(args, parse_spec_configs(labels[1:]),
                                         {"rewrite": reqs}, {})
    assert started == labels  # all at once, once for both temperatures
    gen = [entry[0] for entry in log if entry[1] == "generate" and entry[2] == 0.0]
    # request b is served by every engine in turn, the first one rotating
    assert gen == labels + labels[1:] + labels[:1] + labels[2:] + labels[:2]
    flushes = [entry for entry in log if entry[1] == "flush"]
    assert len(flushes) == 3  # every engine before T = 0.7
    assert [(r["config"], r["temperature"]) for r in runs] == [
        (cfg, t) for t in (0.0, 0.7) for cfg in labels]
    for r in runs:
        assert [x.id for x in r["records"]] == ["r0", "r1", "r2"]
        assert r["interleaved_block"] == 1 and r["metrics"]["completed"] == 3
    assert log[-3:] == [(label, "shutdown") for label in labels]
    attach_comparisons(runs, "baseline")
    # seeded sampled runs (the default) must match the baseline too, so they are compared
    assert [r["metrics"].get("mismatches") for r in runs if r["config"] != "baseline"] == [
        0, 0, 0, 0]


# ---- --base-url mode against fake servers ----------------------------------------------------
def _fake_server_app(speculative: bool, delay_s: float):
    """/generate echoes max_new_tokens copies of the prompt's last token (the speculative server
    gets request "r1" wrong); /server_info counts 2 verify steps per request."""
    app = FastAPI()
    state = {"steps": 0, "flushes": 0}

    @app.post("/generate")
    async def generate(request: Request) -> dict:
        body = await request.json()
        await asyncio.sleep(delay_s)
        n = body["sampling_params"]["max_new_tokens"]
        ids = [body["input_ids"][-1]] * n
        if speculative and body["input_ids"][0] == 1:
            ids[-1] = 0
        meta = {"completion_tokens": n, "finish_reason": {"type": "length"}}
        if speculative:
            state["steps"] += 2
            meta["spec_verify_ct"] = 2
        return {"text": "", "output_ids": ids, "meta_info": meta}

    @app.get("/server_info")
    async def server_info() -> dict:
        if not speculative:
            return {"speculative_algorithm": None}
        s = state["steps"]
        return {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 8,
                "spec_verify_steps": s, "spec_decode_num_draft_tokens": 7 * s,
                "spec_decode_num_accepted_tokens": s,
                "spec_decode_num_accepted_tokens_per_pos": [s // 2]}

    @app.post("/flush_cache")
    async def flush_cache() -> dict:
        state["flushes"] += 1
        return {"success": True}

    return app, state


def test_base_url_mode_measures_both_servers_and_compares() -> None:
    reqs = [BenchRequest(id=f"r{i}", prompt_len=2, max_new_tokens=6, input_ids=[i, 10 + i])
            for i in range(3)]
    # the baseline answers 20x slower, so the speedups below hold however busy the cores are
    # (at 0.05 s against 0.01 s, a fresh-clone run under two test workers measured 0.75x)
    spec_app, spec_state = _fake_server_app(True, 0.01)
    base_app, _ = _fake_server_app(False, 0.2)
    with live_server(spec_app) as spec_url, live_server(base_app) as base_url:
        args = parse_args(["--base-url", spec_url, "--baseline-url", base_url,
                           "--concurrency", "1,3", "--temperature", "0,0.7", "--disable-tqdm"])
        prompts = {"rewrite": [r.input_ids for r in reqs]}
        runs, baseline = bench_speculative.run_urls(args, {"rewrite": reqs}, prompts)
    assert baseline.startswith("no-spec@") and len(runs) == 8
    assert [r["config"].split("@")[0] for r in runs] == ["no-spec", "NGRAM:num_draft_tokens=8"] * 4
    assert [(r["concurrency"], r["temperature"]) for r in runs[::2]] == [
        (1, 0.0), (1, 0.7), (3, 0.0), (3, 0.7)]
    assert spec_state["flushes"] == 4
    attach_comparisons(runs, baseline)
    cand = runs[1]["metrics"]
    assert cand["mismatches"] == 1 and cand["speedup"] > 1.5
    assert cand["accept_length"] == pytest.approx(18 / 6)  # warm-up's steps excluded
    assert cand["accept_rate_per_pos"] == pytest.approx([0.5])
    assert runs[0]["metrics"]["accept_length"] is None
    sampled = runs[3]["metrics"]  # seeded: compared like greedy
    assert sampled["mismatches"] == 1 and sampled["speedup"] > 1.5


def test_median_paired_speedup_pairs_requests_by_id() -> None:
    from benchmark.spec_metrics import median_paired_speedup

    def rec(i: str, e2e: float, ok: bool = True) -> SpecRecord:
        return SpecRecord(i, "k", 1, 1, success=ok, e2e_s=e2e)

    base = [rec("a", 2.0), rec("b", 3.0), rec("c", 4.0), rec("d", 1.0, ok=False)]
    cand = [rec("c", 1.0), rec("a", 1.0), rec("b", 3.0), rec("d", 0.5)]
    assert median_paired_speedup(cand, base) == 2.0  # ratios 4, 2, 1; d failed in the baseline
    assert median_paired_speedup([], base) is None


def test_kind_table_splits_runs_by_prompt_kind_against_the_same_baseline() -> None:
    from benchmark.spec_metrics import kind_table

    def recs(times: dict[str, float]) -> list[SpecRecord]:
        return [SpecRecord(f"{k}{i}", k, 5, 10, success=True, completion_tokens=10, e2e_s=t)
                for k, t in times.items() for i in range(2)]

    base = recs({"code": 1.0, "passage": 1.0})
    runs = [{"dataset": "custom", "config": c, "concurrency": 1, "temperature": 0.0,
             "records": r} for c, r in (("baseline", base),
                                        ("NGRAM", recs({"code": 0.8, "passage": 0.25})))]
    hf = {"custom": {m: {"records": base} for m in ("generate", "prompt_lookup")}}
    table = kind_table({"baseline_label": "baseline", "runs": runs, "hf": hf})
    rows = [line.split() for line in table.splitlines()[2:]]
    ngram = {r[-3]: (r[-2], r[-1]) for r in rows if r[3] == "NGRAM"}
    assert ngram == {"code": ("12.50", "1.25x"), "passage": ("40.00", "4.00x")}
    assert sum(r[3] == "HF" for r in rows) == 4  # two modes x two kinds
    one_kind = [{**runs[0], "records": [r for r in base if r.kind == "code"]}]
    assert kind_table({"baseline_label": "baseline", "runs": one_kind}) is None


def test_self_repeat_share_counts_tokens_that_close_an_earlier_ngram() -> None:
    from benchmark.spec_metrics import self_repeat_share

    assert self_repeat_share([]) == 0.0
    assert self_repeat_share(list(range(100))) == 0.0  # no n-gram twice
    loop = list(range(20)) * 3  # a 20-token cycle, three times; brute-force count:
    want = sum(tuple(loop[i - 16 : i]) in {tuple(loop[j - 16 : j]) for j in range(16, i)}
               for i in range(16, 61)) / 60
    assert self_repeat_share(loop) == pytest.approx(want)
    assert 0.3 < self_repeat_share(loop) < 0.6
    assert self_repeat_share([1, 2, 1, 2, 1, 2], n=2) == pytest.approx(3 / 6)


def test_repetition_table_splits_speedup_by_looping_baseline_outputs() -> None:
    from benchmark.spec_metrics import repetition_table

    looping, plain = list(range(20)) * 5, list(range(100))

    def rec(rid: str, out: list[int], t: float) -> SpecRecord:
        return SpecRecord(rid, "rewrite", 5, 100, success=True, completion_tokens=len(out),
                          e2e_s=t, output_ids=out)

    base = [rec("a", plain, 2.0), rec("b", looping, 2.0)]
    ngram = [rec("a", plain, 1.0), rec("b", looping, 0.5)]
    runs = [{"dataset": "rewrite", "config": c, "concurrency": 1, "temperature": 0.0,
             "records": r} for c, r in (("baseline", base), ("NGRAM", ngram))]
    table = repetition_table({"baseline_label": "baseline", "runs": runs})
    rows = {" ".join(p[4:-4]): p[-4:] for p in map(str.split, table.splitlines()[2:])}
    assert rows["all"] == ["2", "200", rows["all"][2], "2.67x"]  # 4 s / 1.5 s
    assert rows["repeats < 10%"] == ["1", "100", "0.0%", "2.00x"]
    assert rows["repeats >= 10%"][:2] == ["1", "100"]
    assert rows["repeats >= 10%"][3] == "4.00x"
    assert float(rows["repeats >= 10%"][2].rstrip("%")) > 50
    assert repetition_table({"baseline_label": "baseline", "runs": runs[:1]}) is None


def test_report_reprints_saved_runs(tmp_path, capsys) -> None:
    import json

    rec = {"id": "a", "kind": "rewrite", "success": True, "completion_tokens": 10, "e2e_s": 1.0,
           "output_ids": list(range(10))}
    metrics = {"output_tokens_per_s": 10.0, "median_request_tokens_per_s": 10.0,
               "completed": 1}
    runs = [{"dataset": "rewrite", "config": c, "concurrency": 1, "temperature": 0.0,
             "records": [rec], "metrics": metrics} for c in ("baseline", "NGRAM")]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"title": "t", "baseline_label": "baseline", "runs": runs}))
    assert bench_speculative.main(["--report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "self-repetition" in out and out.rstrip().splitlines()[-1].split()[3] == "NGRAM"
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    assert bench_speculative.main(["--report", str(bad)]) == 2
