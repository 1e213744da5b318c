"""Stage 2 of training: the target's hidden states over the regenerated conversations.

One target forward (EXTEND, in-process `ModelRunner`, no server) per batch of sequences records,
for every token position t:
- `feats`: the fused EAGLE-3 input F_t, the hidden states ENTERING the capture layers,
  concatenated (float16, [N, len(capture_layers) * H]);
- `final`: the target's final hidden state after its last norm (float16, [N, H]); the trainer
  turns it into the target's next-token distribution over the draft vocabulary with the
  target's own LM-head rows, so soft labels cost 2 bytes per hidden unit, not per vocab entry;
- `tokens`: the token ids (int32, [N]).
Sequence = the last `max_prompt_tokens` tokens of the chat prompt + the target's answer; only
the answer is trained on by default, the prompt tail is the context its rows attend to.

Storage is flat little-endian binaries plus `index.jsonl` (one line per sequence: id, start,
length, prompt_len, temperature), appended batch by batch: a rerun truncates the binaries to the
last indexed sequence and continues with the ids not yet captured (resumable).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.speculative.models.eagle3_head import default_capture_layers
from specserve.speculative.train.regen import REGEN_FILE, TEACHER_FILE, read_regen

logger = logging.getLogger(__name__)

FEATURE_DIR = "features"


@dataclass
class CaptureConfig:
    target_model: str = "default"
    output: str = "."
    max_prompt_tokens: int = 256
    batch_tokens: int = 4096
    dtype: str = "float32"
    # the layers whose entering hidden states are stored (`feats`); None: EAGLE-3's three
    # (`default_capture_layers`); () for a draft model's distillation (labels only); (E,) for
    # an early-exit adapter
    capture_layers: tuple[int, ...] | None = None


class FeatureStore:
    """Read/append access to a feature directory (see module docstring)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        meta = json.loads((self.root / "meta.json").read_text())
        self.hidden: int = meta["hidden_size"]
        self.capture_layers: tuple[int, ...] = tuple(meta["capture_layers"])
        self.width = self.hidden * len(self.capture_layers)
        self.index = _read_index(self.root / "index.jsonl")
        self.num_tokens = sum(r["length"] for r in self.index)

    def arrays(self) -> tuple[np.memmap, np.memmap, np.memmap]:
        n = self.num_tokens
        if self.width == 0 or n == 0:  # nothing to map (an empty file cannot be mapped)
            feats = np.zeros((n, self.width), dtype=np.float16)
        else:
            feats = np.memmap(self.root / "feats.f16", np.float16, "r", shape=(n, self.width))
        final = np.memmap(self.root / "final.f16", np.float16, "r", shape=(n, self.hidden))
        tokens = np.memmap(self.root / "tokens.i32", np.int32, "r", shape=(n,))
        return feats, final, tokens


def _read_index(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a crash: everything after it is re-captured
    return out


def capture(cfg: CaptureConfig) -> Path:
    """Run (or resume) stage 2 over `regen.jsonl`; returns the feature directory."""
    from specserve.runtime.model_loader.default_model import resolve_model_path
    from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig

    out = Path(cfg.output)
    root = out / FEATURE_DIR
    root.mkdir(parents=True, exist_ok=True)
    records = read_regen(out / REGEN_FILE) + read_regen(out / TEACHER_FILE)
    if not records:
        raise FileNotFoundError(f"{out / REGEN_FILE}: no regenerated answers (run stage regen)")
    model_dir = resolve_model_path(None if cfg.target_model == "default" else cfg.target_model)
    runner = ModelRunner(RunnerConfig(str(model_dir), device="auto", dtype=cfg.dtype,
                                      max_total_tokens=cfg.batch_tokens + 2048))
    mc = runner.model_config
    layers = tuple(default_capture_layers(mc.num_hidden_layers)
                   if cfg.capture_layers is None else cfg.capture_layers)
    if any(not 0 <= i < mc.num_hidden_layers for i in layers):
        raise ValueError(f"capture layers {layers} outside the target's "
                         f"{mc.num_hidden_layers} layers")
    meta_path = root / "meta.json"
    meta = {"hidden_size": mc.hidden_size, "capture_layers": list(layers),
            "target_model": str(model_dir), "max_prompt_tokens": cfg.max_prompt_tokens}
    if meta_path.exists():
        old = json.loads(meta_path.read_text())
        if old != meta:
            raise ValueError(f"{root} was captured with {old}, not {meta}: use a new --output")
    meta_path.write_text(json.dumps(meta) + "\n")

    index = _read_index(root / "index.jsonl")
    end = sum(r["length"] for r in index)
    width = mc.hidden_size * len(layers)
    files = {"feats.f16": width * 2, "final.f16": mc.hidden_size * 2, "tokens.i32": 4}
    for name, row_bytes in files.items():  # drop rows written after the last indexed sequence
        p = root / name
        p.touch()
        with p.open("r+b") as fh:
            fh.truncate(end * row_bytes)
    (root / "index.jsonl").write_text("".join(json.dumps(r) + "\n" for r in index))
    done = {r["id"] for r in index}
    todo = [r for r in records if r["id"] not in done]
    logger.info("capture: %d sequences, %d already captured, %d to go", len(records),
                len(records) - len(todo), len(todo))
    if not todo:
        return root
    seqs = []
    for r in todo:
        prompt = r["prompt_ids"][-cfg.max_prompt_tokens:]
        seqs.append((r, prompt + r["output_ids"], len(prompt)))
    bar = tqdm(total=sum(len(s) for _, s, _ in seqs), desc="capture hidden states", unit="tok",
               dynamic_ncols=True)
    handles = {name: (root / name).open("ab") for name in files}
    try:
        with (root / "index.jsonl").open("a") as idx:
            i = 0
            while i < len(seqs):
                group, total = [], 0
                while i < len(seqs) and (not group or total + len(seqs[i][1]) <= cfg.batch_tokens):
                    group.append(seqs[i])
                    total += len(seqs[i][1])
                    i += 1
                feats, final = _forward(runner, [s for _, s, _ in group], layers)
                if feats is None:
                    feats = np.zeros((total, 0), dtype=np.float16)
                toks = np.array([t for _, s, _ in group for t in s], dtype=np.int32)
                handles["feats.f16"].write(feats.astype(np.float16).tobytes())
                handles["final.f16"].write(final.astype(np.float16).tobytes())
                handles["tokens.i32"].write(toks.tobytes())
                for h in handles.values():
                    h.flush()
                for r, s, plen in group:
                    idx.write(json.dumps({"id": r["id"], "start": end, "length": len(s),
                                          "prompt_len": plen,
                                          "temperature": r.get("temperature", 0.0)}) + "\n")
                    end += len(s)
                idx.flush()
                bar.update(total)
    finally:
        for h in handles.values():
            h.close()
        bar.close()
    return root


@torch.inference_mode()
def _forward(runner, seqs: list[list[int]], layers: tuple[int, ...]):
    """One EXTEND forward over `seqs` (no prefix; KV slots reused every batch)."""
    slots, start = [], 1  # slot 0 is the padding slot
    for s in seqs:
        slots.append(torch.arange(start, start + len(s)))
        start += len(s)
    batch = ForwardBatch.build(ForwardMode.EXTEND, seqs, slots, [0] * len(seqs),
                               capture_layers=layers)
    out = runner.forward(batch, return_final_hidden=True)
    final = out.final_hidden.float().cpu().numpy()
    if not layers:
        return None, final
    feats = torch.cat([out.captured[i] for i in layers], dim=-1)
    return feats.float().cpu().numpy(), final
