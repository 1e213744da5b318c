"""Benchmark plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first
from matplotlib.ticker import MaxNLocator  # noqa: E402


def plot_speculative(result: dict[str, Any], path: str | Path) -> Path:
    """bench_speculative's figure: speedup over the same-run baseline per dataset × concurrency
    (one bar per config and temperature), and acceptance rate by draft position (one line per
    run: its config's colour, its dataset's (and temperature's) line style, its concurrency's
    marker)."""
    runs = [r for r in result["runs"] if r["config"] != result.get("baseline_label", "baseline")]
    temps = sorted({r.get("temperature", 0.0) for r in runs})
    multi_t = len(temps) > 1

    def with_t(label: str, t: float) -> str:
        return f"{label} T={t:g}" if multi_t else label

    def group(r: dict[str, Any]) -> str:
        return f"{r['dataset']}\nc={r['concurrency']}"

    groups = list(dict.fromkeys(group(r) for r in runs))
    configs = list(dict.fromkeys(r["config"] for r in runs))
    # temperature-major: each config keeps its colour, the hatching marks the temperature
    series = [(cfg, t) for t in temps for cfg in configs]
    hatches = ["", "//", "..", "xx", "\\\\", "oo"]
    styles = ["-", "--", ":", "-."]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, (ax_bar, ax_pos) = plt.subplots(1, 2, figsize=(14.5 + 2 * multi_t, 4.8))

    width = 0.8 / max(len(series), 1)
    for j, (cfg, t) in enumerate(series):
        xs, ys = [], []
        for r in runs:
            s = r["metrics"].get("speedup")
            if r["config"] == cfg and r.get("temperature", 0.0) == t and s is not None:
                xs.append(groups.index(group(r)) + j * width)
                ys.append(s)
        if not xs:
            continue
        bars = ax_bar.bar(xs, ys, width, label=with_t(cfg, t),
                          color=colours[configs.index(cfg) % len(colours)],
                          hatch=hatches[temps.index(t) % len(hatches)], edgecolor="white")
        ax_bar.bar_label(bars, fmt="%.2fx", fontsize=7 if len(series) <= 4 else 6)
    ax_bar.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax_bar.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(groups))], groups)
    ax_bar.set_ylabel("output tokens/s vs. baseline (same run, same T)")
    ax_bar.set_title("speedup over no speculation")
    if ax_bar.containers:
        ax_bar.legend(fontsize=7)

    # colour = config (as in the bars), line style = dataset (and temperature), marker =
    # concurrency: a compact legend of three keys however many runs there are
    markers = ["o", "s", "^", "D", "v", "P"]
    datasets = list(dict.fromkeys((r["dataset"], r.get("temperature", 0.0)) for r in runs))
    concs = list(dict.fromkeys(r["concurrency"] for r in runs))
    for r in runs:
        rates = r["metrics"].get("accept_rate_per_pos") or []
        if rates:
            key = (r["dataset"], r.get("temperature", 0.0))
            ax_pos.plot(range(1, len(rates) + 1), rates, markersize=3.5,
                        marker=markers[concs.index(r["concurrency"]) % len(markers)],
                        color=colours[configs.index(r["config"]) % len(colours)],
                        linestyle=styles[datasets.index(key) % len(styles)], linewidth=1)
    ax_pos.set_xlabel("draft position k")
    ax_pos.set_ylabel("verify steps accepting >= k drafts")
    ax_pos.set_ylim(0, 1.02)
    ax_pos.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_pos.set_title("acceptance rate by position")
    if ax_pos.lines:
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color=colours[i % len(colours)], label=c)
                   for i, c in enumerate(configs)]
        handles += [Line2D([], [], color="black", linestyle=styles[i % len(styles)],
                           label=with_t(d, t)) for i, (d, t) in enumerate(datasets)]
        handles += [Line2D([], [], color="black", linestyle="", label=f"c={c}",
                           marker=markers[i % len(markers)]) for i, c in enumerate(concs)]
        ax_pos.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                      handlelength=3, borderaxespad=0)

    title = result.get("title")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_verify_curve(result: dict[str, Any], path: str | Path) -> Path:
    """bench_one_batch's verify-cost curve: T(n)/T(1) against n per engine, with the line
    T(n) = T(1) (rows for free) and T(n) = n T(1) (no sharing) for reference."""
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ns_all: list[int] = []
    for eng in result["engines"]:
        curve = eng["verify_curve"]
        ns = [c["n"] for c in curve]
        ns_all += ns
        ax.plot(ns, [c["ratio_to_n1"] for c in curve], marker="o", label=eng["engine"])
    if ns_all:
        top = max(ns_all)
        ax.plot([1, top], [1, 1], color="grey", linestyle=":", label="rows for free")
        ax.plot([1, top], [1, top], color="grey", linestyle="--", label="no sharing (n x T(1))")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("verify rows n (chain nodes, one request)")
    ax.set_ylabel("T(n) / T(1)")
    prefix = result.get("args", {}).get("verify_prefix")
    ax.set_title(f"verify cost on a {prefix}-token prefix" if prefix else "verify cost")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
