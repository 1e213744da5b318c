"""The training PNG: loss and accept length against training tokens."""

from __future__ import annotations

import json
from pathlib import Path

from specserve.speculative.train.trainer import TRAIN_DIR, read_log


def plot_training(output: str | Path, path: str | Path | None = None) -> Path:
    """Loss (per unrolled step, smoothed) and accept length (proxy chain accept on held-out
    regen rows; worker accept length on held-out ShareGPT where evaluated) vs tokens seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(output)
    train_rows, eval_rows = read_log(out / TRAIN_DIR / "log.jsonl")
    worker_log = out / TRAIN_DIR / "eval_worker.jsonl"
    worker = [json.loads(x) for x in worker_log.read_text().splitlines() if x.strip()] \
        if worker_log.exists() else []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    steps = sorted({int(k.split("_")[1]) for r in train_rows for k in r if k.startswith("loss_")})
    for k in steps:
        xs = [r["tokens"] for r in train_rows if f"loss_{k}" in r]
        ys = _smooth([r[f"loss_{k}"] for r in train_rows if f"loss_{k}" in r])
        ax1.plot(xs, ys, label=f"train, draft step {k + 1}")
    for k in steps:
        xs = [r["tokens"] for r in eval_rows if f"val_loss_{k}" in r]
        ax1.plot(xs, [r[f"val_loss_{k}"] for r in eval_rows if f"val_loss_{k}" in r], "o--",
                 ms=3, label=f"held-out, step {k + 1}")
    ax1.set_xlabel("training tokens")
    ax1.set_ylabel("soft cross-entropy vs target")
    ax1.set_title("loss")
    ax1.legend(fontsize=7)
    xs = [r["tokens"] for r in eval_rows]
    ax2.plot(xs, [r.get("val_chain_accept", 0) for r in eval_rows], "o-", ms=3,
             label="chain proxy (held-out regen rows)")
    for k in steps:
        ax2.plot(xs, [r.get(f"val_acc_{k}", 0) + 1 for r in eval_rows], ":", lw=1,
                 label=f"1 + top-1 acc, step {k + 1}")
    if worker:
        w = sorted(worker, key=lambda r: r["train_tokens"])
        ax2.plot([r["train_tokens"] for r in w], [r["accept_length"] for r in w], "s-",
                 color="black", label="worker, held-out ShareGPT (tree)")
    ax2.set_xlabel("training tokens")
    ax2.set_ylabel("accept length (tokens / verify step)")
    ax2.set_title("accept length vs data")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    dest = Path(path) if path else out / "training.png"
    fig.savefig(dest, dpi=110)
    plt.close(fig)
    return dest


def _smooth(ys: list[float], window: int = 20) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out
