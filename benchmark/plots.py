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
    (one bar per config), and acceptance rate by draft position (one line per run)."""
    runs = [r for r in result["runs"] if r["config"] != result.get("baseline_label", "baseline")]
    groups = list(dict.fromkeys(f"{r['dataset']}\nc={r['concurrency']}" for r in runs))
    configs = list(dict.fromkeys(r["config"] for r in runs))
    fig, (ax_bar, ax_pos) = plt.subplots(1, 2, figsize=(13, 4.8))

    width = 0.8 / max(len(configs), 1)
    for j, cfg in enumerate(configs):
        xs, ys = [], []
        for r in runs:
            s = r["metrics"].get("speedup")
            if r["config"] == cfg and s is not None:
                xs.append(groups.index(f"{r['dataset']}\nc={r['concurrency']}") + j * width)
                ys.append(s)
        bars = ax_bar.bar(xs, ys, width, label=cfg)
        ax_bar.bar_label(bars, fmt="%.2fx", fontsize=7)
    ax_bar.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax_bar.set_xticks([i + width * (len(configs) - 1) / 2 for i in range(len(groups))], groups)
    ax_bar.set_ylabel("output tokens/s vs. baseline (same run)")
    ax_bar.set_title("speedup over no speculation")
    if configs:
        ax_bar.legend(fontsize=7)

    for r in runs:
        rates = r["metrics"].get("accept_rate_per_pos") or []
        if rates:
            ax_pos.plot(range(1, len(rates) + 1), rates, marker="o", markersize=3,
                        label=f"{r['dataset']} {r['config']} c={r['concurrency']}")
    ax_pos.set_xlabel("draft position k")
    ax_pos.set_ylabel("verify steps accepting >= k drafts")
    ax_pos.set_ylim(0, 1.02)
    ax_pos.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_pos.set_title("acceptance rate by position")
    if ax_pos.lines:
        ax_pos.legend(fontsize=7)

    title = result.get("title")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
