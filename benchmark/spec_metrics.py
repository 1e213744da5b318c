"""The pure parts of `bench_speculative`: config strings, counter deltas, per-run metrics,
losslessness against the baseline, and the summary table. No engine, no clock, no I/O.

Definitions (one run = one config × dataset × concurrency × temperature):
- output tokens/s: completion tokens of successful requests / wall time of the run;
- per-request tokens/s: completion tokens / that request's end-to-end latency (median reported);
- speedup: output tokens/s / the baseline's (no speculation) at the same dataset, concurrency
  and temperature;
- mean accept length: completion tokens / verify steps (SGLang's definition; the prefill's first
  token counts, so a run that never accepts a draft still has an accept length slightly above 1);
- acceptance rate at position k (1-based): verify steps that accepted >= k draft tokens / steps;
- draft tokens per step: draft tree nodes (root excluded) / verify steps.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, fields
from typing import Any

from benchmark.common import format_table
from specserve.launch.server_args import ServerArgs

SPEC_PREFIX = "speculative_"
BASELINE_LABEL = "baseline"
TABLE_POSITIONS = 3  # acceptance-rate columns in the printed table (the JSON has them all)


class ConfigError(ValueError):
    """A malformed `--configs` entry."""


@dataclass(frozen=True)
class SpecRunConfig:
    label: str
    server_args: dict[str, Any]  # ServerArgs overrides

    @property
    def is_baseline(self) -> bool:
        return self.label == BASELINE_LABEL


# plain decoding, constrained requests included: one token per step, not even the tokens a
# grammar forces drafted (that is the JUMP_FORWARD config)
BASELINE = SpecRunConfig(BASELINE_LABEL, {"disable_grammar_jump_forward": True})


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def config_keys() -> dict[str, Any]:
    """`key` -> value parser for every `speculative_<key>` ServerArgs field but the algorithm."""
    out: dict[str, Any] = {}
    for f in fields(ServerArgs):
        if not f.name.startswith(SPEC_PREFIX) or f.name == "speculative_algorithm":
            continue
        kind = str(f.type)
        out[f.name[len(SPEC_PREFIX):]] = (
            _parse_bool if kind == "bool" else int if kind.startswith("int")
            else float if kind.startswith("float") else str
        )
    return out


def parse_spec_config(text: str) -> SpecRunConfig:
    """`ALGO[:key=value,...]` -> ServerArgs overrides, e.g. `NGRAM:num_draft_tokens=16` ->
    {speculative_algorithm: "NGRAM", speculative_num_draft_tokens: 16}."""
    algo, _, rest = text.strip().partition(":")
    algo = algo.strip().upper()
    if not algo:
        raise ConfigError(f"config {text!r}: no algorithm before ':' (expected ALGO[:k=v,...])")
    if algo in ("NONE", BASELINE_LABEL.upper()):
        raise ConfigError(f"config {text!r}: the baseline (no speculation) always runs; "
                          "name only speculative configs")
    keys = config_keys()
    overrides: dict[str, Any] = {"speculative_algorithm": algo}
    parts = []
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        key = key.removeprefix(SPEC_PREFIX)
        if not eq or not key or not value:
            raise ConfigError(f"config {text!r}: {item!r} is not key=value")
        if key not in keys:
            raise ConfigError(f"config {text!r}: unknown key {key!r}; known keys: "
                              f"{', '.join(sorted(keys))}")
        if SPEC_PREFIX + key in overrides:
            raise ConfigError(f"config {text!r}: key {key!r} given twice")
        try:
            overrides[SPEC_PREFIX + key] = keys[key](value)
        except ValueError as exc:
            raise ConfigError(f"config {text!r}: bad value for {key!r}: {exc}") from None
        parts.append(f"{key}={value}")
    return SpecRunConfig(algo + (":" + ",".join(parts) if parts else ""), overrides)


def parse_spec_configs(texts: list[str]) -> list[SpecRunConfig]:
    configs = [parse_spec_config(t) for t in texts]
    labels = [c.label for c in configs]
    dup = {x for x in labels if labels.count(x) > 1}
    if dup:
        raise ConfigError(f"config given twice: {', '.join(sorted(dup))}")
    return configs


@dataclass(frozen=True)
class SpecCounters:
    """The scheduler's cumulative speculative counters (a snapshot, or a difference of two)."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()  # [k] = verify steps that accepted >= k + 1 drafts
    draft_s: float = 0.0  # drafting time (a step's, shared out over its requests)

    @classmethod
    def from_server_info(cls, info: dict[str, Any] | None) -> SpecCounters | None:
        """None when the server reports no counters (another server, or no speculation)."""
        if not info or "spec_verify_steps" not in info:
            return None
        return cls(
            verify_steps=int(info["spec_verify_steps"]),
            draft_tokens=int(info.get("spec_decode_num_draft_tokens", 0)),
            accepted_tokens=int(info.get("spec_decode_num_accepted_tokens", 0)),
            accepted_per_pos=tuple(int(x) for x in
                                   info.get("spec_decode_num_accepted_tokens_per_pos") or ()),
            draft_s=float(info.get("spec_draft_s", 0.0)),
        )

    def minus(self, before: SpecCounters | None) -> SpecCounters:
        if before is None:
            return self
        n = len(self.accepted_per_pos)
        prev = list(before.accepted_per_pos[:n]) + [0] * (n - len(before.accepted_per_pos))
        return SpecCounters(
            self.verify_steps - before.verify_steps, self.draft_tokens - before.draft_tokens,
            self.accepted_tokens - before.accepted_tokens,
            tuple(a - b for a, b in zip(self.accepted_per_pos, prev)),
            self.draft_s - before.draft_s,
        )


@dataclass(slots=True)
class SpecRecord:
    """One request of one run."""

    id: str
    kind: str
    prompt_len: int
    max_new_tokens: int
    success: bool = False
    error: str = ""
    completion_tokens: int = 0
    start_s: float = 0.0  # since the run started
    e2e_s: float = 0.0
    finish_reason: str | None = None
    output_ids: list[int] = field(default_factory=list)
    spec_verify_ct: int | None = None
    spec_accept_length: float | None = None
    spec_accept_histogram: list[int] | None = None
    matches_baseline: bool | None = None  # greedy runs only
    first_mismatch: int | None = None  # first output index that differs from the baseline

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.e2e_s if self.e2e_s > 0 else 0.0


def spec_metrics(completion_tokens: int, counters: SpecCounters | None) -> dict[str, Any]:
    """Accept length, per-position acceptance and drafts per step over one run's verify steps."""
    steps = counters.verify_steps if counters else 0
    if not steps:
        return {"verify_steps": steps, "accept_length": None, "accept_rate_per_pos": [],
                "draft_tokens_per_step": None, "accepted_per_step": None, "accept_rate": None,
                "draft_ms_per_step": None}
    assert counters is not None
    return {
        "verify_steps": steps,
        "accept_length": completion_tokens / steps,
        "accept_rate_per_pos": [a / steps for a in counters.accepted_per_pos],
        "draft_tokens_per_step": counters.draft_tokens / steps,
        "accepted_per_step": counters.accepted_tokens / steps,
        "accept_rate": counters.accepted_tokens / max(counters.draft_tokens, 1),
        # per request-step: at concurrency 1 the drafting time of each verify step
        "draft_ms_per_step": 1e3 * counters.draft_s / steps,
    }


def summarize_run(
    records: list[SpecRecord], wall_s: float, counters: SpecCounters | None
) -> dict[str, Any]:
    """Throughput and speculative metrics of one run. Without server counters the accept length
    falls back to the requests' own `spec_verify_ct` (per-position rates then stay empty)."""
    ok = [r for r in records if r.success]
    out_tokens = sum(r.completion_tokens for r in ok)
    if counters is None and any(r.spec_verify_ct for r in ok):
        counters = SpecCounters(verify_steps=sum(r.spec_verify_ct or 0 for r in ok))
    per_req = [r.tokens_per_s for r in ok if r.e2e_s > 0]
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_output_tokens": out_tokens,
        "wall_s": wall_s,
        "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "median_request_tokens_per_s": statistics.median(per_req) if per_req else 0.0,
        **spec_metrics(out_tokens, counters),
    }


def speedup(candidate: float | None, baseline: float | None) -> float | None:
    if candidate is None or not baseline:
        return None
    return candidate / baseline


def median_paired_speedup(records: list[SpecRecord], baseline: list[SpecRecord]) -> float | None:
    """Median over requests served by both of the baseline's time over the candidate's (by
    request id, successful ones only): each prompt its own control, robust to a few outliers."""
    base = {r.id: r for r in baseline if r.success and r.e2e_s > 0}
    ratios = [base[r.id].e2e_s / r.e2e_s for r in records
              if r.success and r.e2e_s > 0 and r.id in base]
    return statistics.median(ratios) if ratios else None


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_to_baseline(records: list[SpecRecord], baseline: list[SpecRecord]) -> int:
    """Mark each record against the baseline's output for the same request id; return how many
    differ (requests that failed on either side are not compared)."""
    base = {r.id: r for r in baseline if r.success}
    mismatches = 0
    for r in records:
        ref = base.get(r.id)
        if not r.success or ref is None:
            continue
        r.first_mismatch = first_mismatch(r.output_ids, ref.output_ids)
        r.matches_baseline = r.first_mismatch is None
        mismatches += not r.matches_baseline
    return mismatches


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def fmt_temperature(t: float | None) -> str:
    """0.0 -> "0", 0.70 -> "0.7"."""
    return "-" if t is None else f"{t:g}"


def fmt_temperatures(ts: list[float]) -> str:
    return ",".join(fmt_temperature(t) for t in ts)


def run_cell(run: dict[str, Any]) -> tuple[str, int, float]:
    """What a run is compared within: (dataset, concurrency, temperature)."""
    return run["dataset"], run["concurrency"], run.get("temperature") or 0.0


def baseline_runs(runs: list[dict[str, Any]], label: str | None) -> dict[tuple, dict[str, Any]]:
    """The baseline run of every (dataset, concurrency, temperature) cell."""
    return {run_cell(r): r for r in runs if r["config"] == label}


def kind_table(result: dict[str, Any]) -> str | None:
    """Tokens/s per prompt kind (e.g. the peer prompts' `code` and `passage`) of every run and HF
    mode, with the speedup over the same run's baseline; None when no dataset mixes kinds."""
    def rate(records: list[Any], kind: str) -> float | None:
        ok = [r for r in records if _get(r, "success") and _get(r, "kind") == kind]
        t = sum(_get(r, "e2e_s") for r in ok)
        return sum(_get(r, "completion_tokens") for r in ok) / t if t > 0 else None

    base = baseline_runs(result["runs"], result.get("baseline_label"))
    named = [(run_cell(r), r["config"], r["records"], base.get(run_cell(r)))
             for r in result["runs"]]
    for dataset, modes in (result.get("hf") or {}).items():
        named += [((dataset, 1, 0.0), label, modes[name]["records"], None)
                  for name, label in (("generate", "HF generate"),
                                      ("prompt_lookup", "HF prompt lookup"))]
    rows = []
    for (dataset, conc, temp), config, records, ref in named:
        kinds = sorted({_get(r, "kind") for r in records})
        if len(kinds) < 2:
            continue
        for kind in kinds:
            mine = rate(records, kind)
            vs = speedup(mine, rate(ref["records"], kind)) if ref is not None else None
            rows.append([dataset, conc, fmt_temperature(temp), config, kind, _num(mine),
                         _num(vs, "{:.2f}x")])
    if not rows:
        return None
    return format_table(["dataset", "conc", "T", "config", "kind", "out tok/s", "speedup"], rows)


# A token "repeats the output" when the SELF_REPEAT_N tokens ending at it already occurred, in
# that order, earlier in the same output: the model looping on its own text (small models do
# under greedy decoding), as opposed to copying its prompt.
SELF_REPEAT_N = 16
SELF_REPEAT_SPLIT = 0.10  # requests whose output repeats itself at least this much are "looping"


def self_repeat_share(tokens: list[int], n: int = SELF_REPEAT_N) -> float:
    """Share of `tokens` at which the n-gram ending there occurred earlier in `tokens`."""
    if len(tokens) <= n:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    hits = 0
    for i in range(n, len(tokens) + 1):
        gram = tuple(tokens[i - n : i])
        hits += gram in seen
        seen.add(gram)
    return hits / len(tokens)


def repetition_table(result: dict[str, Any]) -> str | None:
    """Speedup of every candidate run split by how much the baseline's output repeats itself.

    Long greedy answers of a small model can fall into loops, which n-gram drafting accepts
    wholesale; this shows how much of a speedup comes from them. Rows: all requests, those whose
    baseline output repeats itself < SELF_REPEAT_SPLIT, and the rest; each with its share of the
    baseline's tokens that repeat the output. None when there is no baseline to pair with.
    """
    label = result.get("baseline_label")
    base = baseline_runs(result["runs"], label)
    rows = []
    for run in result["runs"]:
        ref = base.get(run_cell(run))
        if run["config"] == label or ref is None:
            continue
        mine = {_get(r, "id"): r for r in run["records"] if _get(r, "success")}
        pairs = [(b, mine[_get(b, "id")]) for b in ref["records"]
                 if _get(b, "success") and _get(b, "id") in mine]
        if not pairs:
            continue
        shares = {_get(b, "id"): self_repeat_share(list(_get(b, "output_ids") or []))
                  for b, _ in pairs}
        groups = [("all", pairs),
                  (f"repeats < {SELF_REPEAT_SPLIT:.0%}",
                   [p for p in pairs if shares[_get(p[0], "id")] < SELF_REPEAT_SPLIT]),
                  (f"repeats >= {SELF_REPEAT_SPLIT:.0%}",
                   [p for p in pairs if shares[_get(p[0], "id")] >= SELF_REPEAT_SPLIT])]
        dataset, conc, temp = run_cell(run)
        for name, group in groups:
            if not group:
                continue
            tokens = sum(_get(b, "completion_tokens") for b, _ in group)
            repeated = sum(shares[_get(b, "id")] * _get(b, "completion_tokens") for b, _ in group)
            t_base = sum(_get(b, "e2e_s") for b, _ in group)
            t_mine = sum(_get(c, "e2e_s") for _, c in group)
            rows.append([dataset, conc, fmt_temperature(temp), run["config"], name, len(group),
                         tokens, f"{repeated / tokens:.1%}" if tokens else "-",
                         _num(speedup(t_base, t_mine), "{:.2f}x")])
    if not rows:
        return None
    return format_table(["dataset", "conc", "T", "config", "requests", "n", "tokens",
                         "output repeats itself", "speedup"], rows)


def _get(record: Any, name: str) -> Any:
    return record[name] if isinstance(record, dict) else getattr(record, name)


def summary_table(result: dict[str, Any]) -> str:
    """Baseline and candidates side by side, per dataset, concurrency and temperature (T); HF
    rows (greedy, T = 0) last."""
    headers = ["dataset", "conc", "T", "config", "out tok/s", "req tok/s (med)", "speedup",
               "req speedup (med)", "accept len", "draft/step", "draft ms/step",
               *(f"acc@{k + 1}" for k in range(TABLE_POSITIONS)), "mismatch", "vs HF PLD"]
    rows = []
    datasets = list(dict.fromkeys(r["dataset"] for r in result["runs"]))
    # baseline next to its candidates: engine runs come per config, every temperature each
    runs = sorted(result["runs"], key=lambda r: (datasets.index(r["dataset"]), r["concurrency"],
                                                 r.get("temperature") or 0.0))
    for run in runs:
        m = run["metrics"]
        rates = m.get("accept_rate_per_pos") or []
        mism = m.get("mismatches")
        rows.append([
            run["dataset"], run["concurrency"], fmt_temperature(run.get("temperature")),
            run["config"], _num(m["output_tokens_per_s"]),
            _num(m["median_request_tokens_per_s"]), _num(m.get("speedup"), "{:.2f}x"),
            _num(m.get("median_request_speedup"), "{:.2f}x"),
            _num(m.get("accept_length")), _num(m.get("draft_tokens_per_step")),
            _num(m.get("draft_ms_per_step")),
            *(_num(rates[k] if k < len(rates) else None) for k in range(TABLE_POSITIONS)),
            "-" if mism is None else f"{mism}/{m['completed']}",
            _num(m.get("vs_hf_prompt_lookup"), "{:.2f}x"),
        ])
    for dataset, hf in (result.get("hf") or {}).items():
        for name, label in (("generate", "HF generate"), ("prompt_lookup", "HF prompt lookup")):
            h = hf[name]
            mism = h.get("mismatches")
            rows.append([
                dataset, 1, fmt_temperature(0.0), label, _num(h["output_tokens_per_s"]),
                _num(h["median_request_tokens_per_s"]), _num(h.get("speedup"), "{:.2f}x"),
                "-", "-", "-", "-", *(["-"] * TABLE_POSITIONS),
                "-" if mism is None else f"{mism}/{h['completed']}", "-",
            ])
    return format_table(headers, rows)
