"""A draft model initialised from its target: the target's embedding, final norm and LM head
with a subset of its decoder layers, written as an ordinary Hugging Face Llama directory (config,
safetensors, the target's tokenizer files) that any runtime loads. The STANDALONE distiller
starts from it; with no training it is already a usable (weak) draft."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from specserve.runtime.model_loader.hf_dir import iter_safetensors_weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


def spread_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers to keep: the first, the last, and evenly spaced ones between."""
    if not 1 <= num_draft_layers <= num_target_layers:
        raise ValueError(f"a draft of {num_draft_layers} layers from a {num_target_layers}-layer "
                         "target")
    if num_draft_layers == 1:
        return [0]
    step = (num_target_layers - 1) / (num_draft_layers - 1)
    return sorted({round(i * step) for i in range(num_draft_layers)})


def init_draft_from_target(target_dir: str | Path, out_dir: str | Path,
                           layers: Sequence[int], dtype: torch.dtype = torch.float32) -> Path:
    """Write the draft (target layers `layers`, renumbered 0..k-1) to `out_dir`."""
    target_dir, out = Path(target_dir), Path(out_dir)
    cfg = json.loads((target_dir / "config.json").read_text())
    n = int(cfg["num_hidden_layers"])
    if not layers or any(not 0 <= i < n for i in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"layers {list(layers)} are not distinct layers of a {n}-layer target")
    renumber = {src: dst for dst, src in enumerate(layers)}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in iter_safetensors_weights(target_dir):
        key = name.removeprefix("model.")
        if key.startswith("layers."):
            idx = int(key.split(".")[1])
            if idx not in renumber:
                continue
            key = f"layers.{renumber[idx]}." + key.split(".", 2)[2]
        if "rotary_emb" in key:
            continue
        prefix = "" if key == "lm_head.weight" else "model."
        state[prefix + key] = tensor.to(dtype).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {**cfg, "num_hidden_layers": len(layers),
           "torch_dtype": str(dtype).removeprefix("torch."),
           "draft_init": {"target": str(target_dir), "layers": list(layers)}}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copy(target_dir / name, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    from specserve.runtime.model_loader.default_model import resolve_model_path

    p = argparse.ArgumentParser(prog="python -m specserve.speculative.train.draft_init",
                                description="Write a draft model made of some of the target's "
                                "layers (untrained) as an HF directory.")
    p.add_argument("--target-model", default="default", help="target model dir, .gguf or default")
    p.add_argument("--num-layers", type=int, default=4, help="layers kept, spread evenly")
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    target = resolve_model_path(args.target_model)
    n = json.loads((Path(target) / "config.json").read_text())["num_hidden_layers"]
    layers = spread_layers(n, args.num_layers)
    out = init_draft_from_target(target, args.output, layers)
    print(f"wrote {out} (target layers {layers})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
