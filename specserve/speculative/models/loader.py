"""Draft heads from their public checkpoint layouts, and EAGLE-3 heads back into that layout.

A head directory holds `config.json` plus `model.safetensors` (or shards) or `pytorch_model.bin`
(read only with `torch.load(weights_only=True)`, see `specserve/runtime/model_loader/hf_dir.py`).
Keys may carry a `model.` prefix. The format is told by the keys:
- EAGLE-1/2: `fc.weight` [H, 2H] (+ `fc.bias`), `layers.0.self_attn.{q,k,v,o}_proj.weight`,
  `layers.0.mlp.{gate,up,down}_proj.weight`, `layers.0.post_attention_layernorm.weight`,
  optional `layers.0.input_layernorm.weight`, optional `embed_tokens.weight`;
- EAGLE-3: `fc.weight` [H, 3H], `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}
  .weight`, `midlayer.self_attn.{q,k,v,o}_proj.weight` (q/k/v read 2H), `midlayer.mlp.*`,
  `norm.weight`, `lm_head.weight` [draft_vocab, H], `d2t` int64 [draft_vocab], `t2d` bool
  [target_vocab], optional `embed_tokens.weight`.
Our modules fuse q/k/v and gate/up; `_public_layout` maps each public key to rows of a fused
parameter, and both loading and saving go through it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from specserve.runtime.errors import ModelLoadError
from specserve.runtime.layers.linear import Linear
from specserve.runtime.model_loader.config import ModelConfig
from specserve.runtime.model_loader.config import _rope as parse_rope
from specserve.runtime.model_loader.hf_dir import iter_safetensors_weights
from specserve.speculative.models.base import DraftHead, DraftHeadConfig, TargetRefs
from specserve.speculative.models.eagle3_head import Eagle3Head, default_capture_layers
from specserve.speculative.models.eagle_head import EagleHead

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
# our fused projection → the public projections stacked in it, in row order
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_SIDE_KEYS = ("embed_tokens.weight", "d2t", "t2d")  # handled outside the layout


def load_draft_head(
    path: str | Path, target_config: ModelConfig, target_model: nn.Module, *,
    kv_capacity: int | None = None, norm_before_lm_head: bool = False,
) -> EagleHead | Eagle3Head:
    """Load an EAGLE-1/2 or EAGLE-3 head for `target_model`, on its device and dtype.

    `kv_capacity` sizes the head's own KV pool (slots are addressed like the target's, so pass
    the target's capacity; default mirrors `ModelRunner`). `norm_before_lm_head` (EAGLE-1/2
    only) applies the target's final norm before its LM head; published heads expect it off.
    Raises `ModelLoadError` naming the mismatch when the head does not fit the target.
    """
    path = Path(path)
    raw = _read_config(path)
    weights = _read_weights(path)
    kind = detect_format(weights, raw, path)
    cfg = _head_config(kind, raw, weights, target_config, path, norm_before_lm_head)
    refs = TargetRefs.from_model(target_model)
    device, dtype = refs.device, refs.dtype
    capacity = kv_capacity or max(4 * target_config.max_position_embeddings, 8192)
    head = (EagleHead if kind == "eagle" else Eagle3Head)(cfg, refs, capacity, device, dtype)
    head.to(device=device, dtype=dtype)
    _load_layout(head, weights, path)
    _load_embedding(head, weights.get("embed_tokens.weight"), path)
    if isinstance(head, Eagle3Head):
        _load_vocab_map(head, weights.get("d2t"), weights.get("t2d"), path)
    return head.eval()


def detect_format(weights: dict[str, torch.Tensor], raw: dict[str, Any], path: Path) -> str:
    """"eagle" (EAGLE-1/2) or "eagle3", from the (prefix-stripped) checkpoint keys."""
    eagle3 = any(k.startswith("midlayer.") for k in weights) or "d2t" in weights
    eagle1 = any(k.startswith("layers.") for k in weights)
    shown = ", ".join(sorted(weights)[:8])
    if eagle3 and eagle1:
        raise ModelLoadError(f"{path}: keys mix EAGLE-1 (layers.*) and EAGLE-3 (midlayer.*)")
    if not (eagle3 or eagle1) or "fc.weight" not in weights:
        raise ModelLoadError(
            f"{path}: not an EAGLE draft head (expected fc.weight with layers.0.* or "
            f"midlayer.* keys); found: {shown}"
        )
    if EAGLE3_ARCHITECTURE in (raw.get("architectures") or []) and not eagle3:
        raise ModelLoadError(f"{path}: config says {EAGLE3_ARCHITECTURE} but keys are EAGLE-1's")
    return "eagle3" if eagle3 else "eagle"


def save_eagle3_head(head: Eagle3Head, out_dir: str | Path) -> Path:
    """Write `head` as config.json + model.safetensors in the public EAGLE-3 layout."""
    packed = [n for n, m in head.named_modules() if isinstance(m, Linear) and m.is_packed]
    if packed:
        raise ValueError(f"cannot save prepacked linears {packed[:3]}: save before pack_weights()")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    params = dict(head.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    for key, (name, start, rows) in _public_layout(head).items():
        value = params[name].detach()
        tensors[key] = (value if start is None else value[start : start + rows]).cpu().clone()
    tensors["d2t"] = head.d2t.cpu().clone()
    tensors["t2d"] = head.t2d.cpu().clone()
    if head.embed_weight is not None:
        tensors["embed_tokens.weight"] = head.embed_weight.detach().cpu().clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = head.config
    config = eagle3_config_json(cfg.layer, cfg.target_vocab_size, cfg.draft_vocab_size,
                                cfg.capture_layers, head.fc.weight.dtype,
                                cfg.layer.attention_bias)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def eagle3_config_json(
    layer: Any, target_vocab_size: int, draft_vocab_size: int, capture_layers: tuple[int, ...],
    dtype: torch.dtype, attention_bias: bool = False,
) -> dict[str, Any]:
    """config.json of an EAGLE-3 head in the public layout. `layer` has the layer's shape
    attributes (hidden_size, intermediate_size, heads, head_dim, rms_norm_eps, rope, max
    positions): a `ModelConfig` or the trainer's `HeadShape`."""
    return {
        "architectures": [EAGLE3_ARCHITECTURE], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": layer.hidden_size, "intermediate_size": layer.intermediate_size,
        "num_hidden_layers": 1, "num_attention_heads": layer.num_attention_heads,
        "num_key_value_heads": layer.num_key_value_heads, "head_dim": layer.head_dim,
        "rms_norm_eps": layer.rms_norm_eps, "rope_theta": layer.rope_theta,
        "rope_scaling": layer.rope_scaling,
        "max_position_embeddings": layer.max_position_embeddings,
        "vocab_size": target_vocab_size, "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False, "attention_bias": attention_bias,
        "torch_dtype": str(dtype).removeprefix("torch."),
        # layer-OUTPUT ids, as SGLang / vLLM / SpecForge read them (ours count layer inputs)
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [c - 1 for c in capture_layers]},
    }


def _read_config(path: Path) -> dict[str, Any]:
    file = path / "config.json"
    if not file.is_file():
        raise ModelLoadError(f"{path}: no config.json; expected an EAGLE draft-head directory")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{file}: cannot read JSON: {exc}") from exc


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in iter_safetensors_weights(path):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        key = name.removeprefix("model.")
        if key in weights:
            raise ModelLoadError(f"{path}: {key!r} appears twice (with and without 'model.')")
        weights[key] = tensor
    return weights


def _head_config(
    kind: str, raw: dict[str, Any], weights: dict[str, torch.Tensor], target: ModelConfig,
    path: Path, norm_before_lm_head: bool,
) -> DraftHeadConfig:
    hidden = int(raw.get("hidden_size") or weights["fc.weight"].shape[0])
    # the head adds its output to token embeddings and reads the target's hidden states
    sizes = {"hidden_size": hidden, "target_hidden_size": raw.get("target_hidden_size", hidden)}
    for key, size in sizes.items():
        if int(size) != target.hidden_size:
            raise ModelLoadError(
                f"{path}: draft head {key} {size} does not match the target's hidden_size "
                f"{target.hidden_size}"
            )
    vocab = int(raw.get("vocab_size") or target.vocab_size)
    if vocab != target.vocab_size:
        raise ModelLoadError(
            f"{path}: draft head was built for a vocabulary of {vocab} tokens; the target's "
            f"vocab_size is {target.vocab_size}"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: hidden_act {raw['hidden_act']!r}, only 'silu' is supported")
    for key in ("num_attention_heads", "intermediate_size"):
        if key not in raw:
            raise ModelLoadError(f"{path}: config.json lacks {key}")
    heads = int(raw["num_attention_heads"])
    rope_theta, rope_scaling = parse_rope(raw, path)
    prefix = "layers.0." if kind == "eagle" else "midlayer."
    layer = dataclasses.replace(
        target, architecture=(raw.get("architectures") or [kind])[0], model_type="llama",
        hidden_size=hidden, intermediate_size=int(raw["intermediate_size"]), num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta,
        rope_scaling=rope_scaling, tie_word_embeddings=False, qk_norm=False,
        max_position_embeddings=max(int(raw.get("max_position_embeddings", 0)),
                                    target.max_position_embeddings),
        attention_bias=f"{prefix}self_attn.q_proj.bias" in weights, model_dir=str(path.resolve()),
    )
    if layer.head_dim % 2:
        raise ModelLoadError(f"{path}: head_dim {layer.head_dim} is odd; RoPE needs it even")
    common = dict(kind=kind, layer=layer, target_vocab_size=vocab,
                  fc_bias="fc.bias" in weights)
    if kind == "eagle":
        return DraftHeadConfig(
            **common, draft_vocab_size=vocab, norm_before_lm_head=norm_before_lm_head,
            input_layernorm="layers.0.input_layernorm.weight" in weights,
        )
    lm_rows = weights["lm_head.weight"].shape[0] if "lm_head.weight" in weights else vocab
    return DraftHeadConfig(
        **common, draft_vocab_size=int(raw.get("draft_vocab_size") or lm_rows),
        capture_layers=_capture_layers(raw, target, path),
    )


def _capture_layers(raw: dict[str, Any], target: ModelConfig, path: Path) -> tuple[int, ...]:
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    num_layers = target.num_hidden_layers
    # checkpoint ids count layer outputs; ours count the hidden state entering a layer
    layers = tuple(int(i) + 1 for i in ids) if ids else default_capture_layers(num_layers)
    bad = [i for i in layers if not 0 <= i <= num_layers]
    if bad:
        raise ModelLoadError(
            f"{path}: EAGLE-3 capture layers {layers} fall outside the target's {num_layers} "
            f"layers (entering-layer indices must be in 0..{num_layers})"
        )
    return layers


def _public_layout(head: DraftHead) -> dict[str, tuple[str, int | None, int]]:
    """Public key → (our parameter name, first row or None for all of it, row count)."""
    layout: dict[str, tuple[str, int | None, int]] = {}
    for name, param in head.named_parameters():
        if name == "embed_weight":
            continue
        parts = name.rsplit(".", 2)  # e.g. ["midlayer.self_attn", "qkv_proj", "weight"]
        blocks = _FUSED.get(parts[1], ()) if len(parts) == 3 else ()
        if not blocks:
            layout[name] = (name, None, param.shape[0])
            continue
        attn = head.config.layer
        q = attn.num_attention_heads * attn.head_dim
        kv = attn.num_key_value_heads * attn.head_dim
        sizes = [q, kv, kv] if parts[1] == "qkv_proj" else [attn.intermediate_size] * 2
        start = 0
        for public, size in zip(blocks, sizes):
            layout[f"{parts[0]}.{public}.{parts[2]}"] = (name, start, size)
            start += size
    return layout


def _load_layout(head: DraftHead, weights: dict[str, torch.Tensor], path: Path) -> None:
    layout = _public_layout(head)
    kind = head.config.kind
    side = _SIDE_KEYS if kind == "eagle3" else ("embed_tokens.weight",)
    unexpected = sorted(set(weights) - set(layout) - set(side))
    if unexpected:
        raise ModelLoadError(
            f"{path}: keys this {kind} head does not have: {unexpected[:8]} (one decoder layer, "
            f"no q/k norm, no o_proj/mlp bias are supported)"
        )
    missing = sorted(set(layout) - set(weights))
    if missing:
        raise ModelLoadError(f"{path}: {kind} checkpoint is missing {missing[:8]}")
    params = dict(head.named_parameters())
    lc = head.config.layer
    for key, (name, start, rows) in layout.items():
        dst = params[name].data
        dst = dst if start is None else dst[start : start + rows]
        tensor = weights[key]
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ModelLoadError(
                f"{path}: {key} has shape {tuple(tensor.shape)}, this head needs "
                f"{tuple(dst.shape)} (hidden_size {lc.hidden_size}, {lc.num_attention_heads} "
                f"heads / {lc.num_key_value_heads} KV heads of head_dim {lc.head_dim}, "
                f"intermediate_size {lc.intermediate_size}, draft_vocab_size "
                f"{head.config.draft_vocab_size})"
            )
        dst.copy_(tensor)


def _load_embedding(head: DraftHead, embed: torch.Tensor | None, path: Path) -> None:
    if embed is None:
        return
    shared = head.target.dense_embed()  # [vocab, H]
    if tuple(embed.shape) != tuple(shared.shape):
        raise ModelLoadError(
            f"{path}: embed_tokens.weight has shape {tuple(embed.shape)}; the target's "
            f"embedding is {tuple(shared.shape)} (vocab_size, hidden_size)"
        )
    embed = embed.to(device=shared.device, dtype=shared.dtype)
    # most heads store a copy of the target's (frozen) embedding: share it instead
    if not torch.equal(embed, shared):
        head.embed_weight = nn.Parameter(embed, requires_grad=False)


def _load_vocab_map(
    head: Eagle3Head, d2t: torch.Tensor | None, t2d: torch.Tensor | None, path: Path
) -> None:
    draft_vocab, vocab = head.config.draft_vocab_size, head.config.target_vocab_size
    if d2t is None and t2d is None:
        if draft_vocab != vocab:
            raise ModelLoadError(
                f"{path}: draft vocabulary of {draft_vocab} < target's {vocab} but no d2t/t2d"
            )
        return  # full vocabulary: the identity maps set at construction
    if d2t is None or t2d is None:
        raise ModelLoadError(f"{path}: EAGLE-3 checkpoint has only one of d2t / t2d")
    if tuple(d2t.shape) != (draft_vocab,) or tuple(t2d.shape) != (vocab,):
        raise ModelLoadError(
            f"{path}: d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not fit a draft "
            f"vocabulary of {draft_vocab} over the target's vocab_size {vocab}"
        )
    d2t, t2d = d2t.to(torch.int64), t2d.to(torch.bool)
    target_ids = torch.arange(draft_vocab) + d2t  # [draft_vocab]
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab:
        raise ModelLoadError(f"{path}: d2t maps draft ids outside the target's {vocab} tokens")
    if target_ids.unique().numel() != draft_vocab:
        raise ModelLoadError(f"{path}: d2t maps two draft ids to the same target id")
    if int(t2d.sum()) != draft_vocab or not bool(t2d[target_ids].all()):
        raise ModelLoadError(f"{path}: t2d does not mark exactly the target ids d2t maps to")
    head.d2t.copy_(d2t)
    head.t2d.copy_(t2d)
