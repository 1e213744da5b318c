"""A draft model shipped without the tensors it shares with its target.

A STANDALONE draft distilled by `python -m specserve.speculative.train --algorithm STANDALONE` keeps
the target's embedding (and LM head) frozen, so most of its bytes are the target's: SmolLM2-135M's
49152 x 576 embedding is 56 MB in bfloat16, its four trained layers 28 MB (14 MB as q8_0 blocks, the
shipped form: Q8_SUFFIX below). The shipped asset (`assets/draft-*`) holds only the trained tensors
plus the config, with a `specserve_shared_with_target` block naming the tensors to take from the
target; `materialize()` writes the ordinary Hugging Face directory (every tensor, the target's
tokenizer files) into the model cache once, keyed by the asset's contents, and the runtime loads
that.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

SHARED_KEY = "specserve_shared_with_target"
# A weight [N, K] stored as q8_0 blocks (`pack_draft_asset(..., q8_0=True)`): NAME + Q8_SUFFIX
# int8 [N, K] and NAME + Q8_SCALE_SUFFIX float16 [N, K / 32]; `materialize` writes NAME = q * d
# in float32, exactly the floats that round back to the same blocks, so the CPU engine's q8_0
# draft (its default) is bit for bit the one packed from the bfloat16 weights. Other formats
# read those q8_0-rounded weights (drafts only: output is unchanged).
Q8_SUFFIX, Q8_SCALE_SUFFIX = ".q8_0", ".q8_0_scale"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")
EXTRA_FILES = ("draft_vocab.safetensors",)  # carried by the asset as they are


def is_draft_asset(path: str | Path) -> bool:
    p = Path(path) / "config.json"
    return p.is_file() and SHARED_KEY in json.loads(p.read_text())


def pack_draft_asset(draft_dir: str | Path, asset_dir: str | Path,
                     target: str = "default", q8_0: bool = False) -> Path:
    """Write `asset_dir` from a full draft directory: every tensor except the target's;
    `q8_0`: 2-D weights whose width is a multiple of 32 as q8_0 blocks (see Q8_SUFFIX)."""
    draft_dir, out = Path(draft_dir), Path(asset_dir)
    cfg = json.loads((draft_dir / "config.json").read_text())
    shared = ["model.embed_tokens.weight"]
    if not cfg.get("tie_word_embeddings", False):
        shared.append("lm_head.weight")
    state = {k: v.contiguous() for k, v in load_file(str(draft_dir / "model.safetensors")).items()
             if k not in shared}
    if q8_0:
        import torch

        from specserve.kernels.cpu.packing import QK, Fmt, quantize

        for k in [k for k, v in state.items() if v.dim() == 2 and v.shape[1] % QK == 0]:
            b = quantize(Fmt.Q8_0, state.pop(k).float().numpy())
            state[k + Q8_SUFFIX] = torch.from_numpy(b.q)
            state[k + Q8_SCALE_SUFFIX] = torch.from_numpy(b.d)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.pop("specserve_materialized_from", None)  # packed again from a materialized copy
    cfg[SHARED_KEY] = {"target": target, "tensors": shared}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in EXTRA_FILES:
        if (draft_dir / name).exists():
            shutil.copy(draft_dir / name, out / name)
    return out


def materialize(asset_dir: str | Path, cache: str | Path | None = None) -> Path:
    """The full draft directory for an asset (written on first use, then reused)."""
    from specserve.kernels.cache import cache_dir
    from specserve.runtime.model_loader.default_model import resolve_model_path
    from specserve.runtime.model_loader.hf_dir import iter_safetensors_weights

    asset = Path(asset_dir)
    cfg = json.loads((asset / "config.json").read_text())
    info = cfg[SHARED_KEY]
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors", *EXTRA_FILES):
        if (asset / name).exists():
            with (asset / name).open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
    out = Path(cache or cache_dir()) / f"{asset.name}-{h.hexdigest()[:12]}"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    target = resolve_model_path(None if info["target"] == "default" else info["target"])
    state = dict(load_file(str(asset / "model.safetensors")))
    dtype = next(v.dtype for k, v in state.items() if v.is_floating_point()
                 and not k.endswith(Q8_SCALE_SUFFIX))
    for k in [k for k in state if k.endswith(Q8_SUFFIX)]:
        q, d = state.pop(k), state.pop(k[: -len(Q8_SUFFIX)] + Q8_SCALE_SUFFIX)
        n, width = q.shape
        w = q.float().reshape(n, d.shape[1], -1) * d.float()[:, :, None]  # a scale per block
        state[k[: -len(Q8_SUFFIX)]] = w.reshape(n, width).contiguous()
    want = set(info["tensors"])
    tcfg = json.loads((Path(target) / "config.json").read_text())
    for name, w in iter_safetensors_weights(str(target)):
        if name in want:
            state[name] = w.to(dtype).contiguous()
    if "lm_head.weight" in want and "lm_head.weight" not in state and \
            tcfg.get("tie_word_embeddings", False):
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = want - set(state)
    if missing:
        raise ValueError(f"{asset}: the target {target} has no {sorted(missing)}")
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = {k: v for k, v in cfg.items() if k != SHARED_KEY}
    cfg["specserve_materialized_from"] = str(asset)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (Path(target) / name).exists():
            shutil.copy(Path(target) / name, tmp / name)
    for name in EXTRA_FILES:
        if (asset / name).exists():
            shutil.copy(asset / name, tmp / name)
    try:
        tmp.rename(out)
    except OSError:  # another process materialized it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m specserve.speculative.models.draft_asset",
                                description="Write a draft directory's shipped form: every "
                                "tensor except those it shares with its target.")
    p.add_argument("draft_dir")
    p.add_argument("asset_dir")
    p.add_argument("--target", default="default", help="the target the tensors come from")
    p.add_argument("--q8-0", action="store_true",
                   help="store the linear weights as q8_0 blocks (half the bytes of bfloat16; "
                   "the CPU engine's q8_0 draft is unchanged)")
    args = p.parse_args(argv)
    out = pack_draft_asset(args.draft_dir, args.asset_dir, args.target, args.q8_0)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
