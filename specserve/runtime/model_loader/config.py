"""`ModelConfig`: the facts about a checkpoint (Llama family, Gemma 3) that the model and runtime
need.

Read from a Hugging Face model directory (`config.json`, plus `generation_config.json` for
extra end-of-sequence ids). Both the transformers 4.x spelling (`rope_theta`, `rope_scaling`,
`torch_dtype`) and the 5.x spelling (`rope_parameters`, `dtype`) are understood.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specserve.runtime.errors import ModelLoadError

# architecture name in config.json -> model_type it must carry
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3_text",
}
GEMMA3 = "gemma3_text"

# rope_type values the model implementation knows; "default" is normalised to None.
SUPPORTED_ROPE_TYPES = ("linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    """One checkpoint's architecture. Build it with `ModelConfig.from_dir`.

    `rope_scaling` is None when positions are not rescaled; otherwise a dict with `rope_type`
    ("linear": `factor`; "llama3": `factor`, `low_freq_factor`, `high_freq_factor`,
    `original_max_position_embeddings`). `attention_bias` means q/k/v projections carry a bias
    (o_proj never does). `qk_norm` means per-head RMSNorm on q and k before RoPE (Qwen3,
    Gemma 3).

    Gemma 3 (`model_type == "gemma3_text"`): norms multiply by (1 + w) (`norm_plus_one`), each
    block has four (`sandwich_norms`: the attention and MLP outputs are normed before the
    residual add), the MLP is GELU-tanh, embeddings are scaled by `embed_scale` (sqrt(hidden)),
    attention by `attn_scale` (query_pre_attn_scalar^-0.5), and the layers named
    "sliding_attention" in `layer_types` see only the last `sliding_window` positions, with
    RoPE base `rope_local_theta` (the others: `rope_theta`).
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: str
    model_dir: str
    hidden_act: str = "silu"
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    attn_scale: float | None = None  # None: head_dim^-0.5
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None

    @property
    def is_gemma3(self) -> bool:
        return self.model_type == GEMMA3

    @property
    def attention_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    def layer_window(self, layer: int) -> int | None:
        """The positions a query of `layer` sees back from its own (itself included), or None:
        all of them."""
        sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    def layer_rope_theta(self, layer: int) -> float:
        local = self.layer_window(layer) is not None and self.rope_local_theta is not None
        return self.rope_local_theta if local else self.rope_theta

    @classmethod
    def from_dir(cls, model_dir: str | Path, context_len: int | None = None) -> ModelConfig:
        """Read `model_dir/config.json`.

        `context_len` is the longest sequence the caller will run (default: the model's
        `max_position_embeddings`). Sliding-window attention is not implemented, so a model whose
        active sliding window is shorter than that raises `ModelLoadError`; with a context no
        longer than the window, full causal attention computes exactly the same thing.
        """
        path = Path(model_dir)
        raw = _read_json(path / "config.json", required=True)
        architecture = _architecture(raw, path)
        model_type = SUPPORTED_ARCHITECTURES[architecture]
        if raw.get("model_type", model_type) != model_type:
            raise ModelLoadError(
                f"{path}: architecture {architecture} with model_type {raw.get('model_type')!r}; "
                f"expected model_type {model_type!r}"
            )
        if model_type != GEMMA3 and raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(
                f"{path}: hidden_act {raw['hidden_act']!r}, only 'silu' is supported"
            )
        if raw.get("mlp_bias", False):
            raise ModelLoadError(f"{path}: mlp_bias=true is not supported")

        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        max_pos = int(raw.get("max_position_embeddings", 2048))
        if model_type == GEMMA3:
            gemma = _gemma3(raw, path)
            rope_theta, rope_scaling = gemma.pop("rope_theta"), None
        else:
            gemma = {}
            _check_sliding_window(raw, model_type, context_len or max_pos, path)
            rope_theta, rope_scaling = _rope(raw, path)
        generation = _read_json(path / "generation_config.json", required=False)
        eos_ids = _merge_ids(raw.get("eos_token_id"), generation.get("eos_token_id"))
        bos = raw.get("bos_token_id", generation.get("bos_token_id"))
        return cls(
            architecture=architecture,
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and its config does not say so.
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", GEMMA3),
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            model_dir=str(path.resolve()),
            **gemma,
        )


def check_architecture(model_dir: str | Path) -> str:
    """The supported architecture named by `model_dir/config.json`; `ModelLoadError` otherwise."""
    path = Path(model_dir)
    return _architecture(_read_json(path / "config.json", required=True), path)


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelLoadError(
                f"{path.parent}: no config.json; expected a Hugging Face model directory of a "
                f"supported architecture ({', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON: {exc}") from exc


def _architecture(raw: dict[str, Any], path: Path) -> str:
    found = raw.get("architectures") or []
    for name in found:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    shown = ", ".join(found) if found else f"none (model_type {raw.get('model_type')!r})"
    raise ModelLoadError(
        f"{path}: unsupported architecture {shown}; supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(raw: dict[str, Any], path: Path) -> tuple[float, dict | None]:
    # transformers 5 folds rope_theta into rope_parameters; 4.x keeps them apart.
    params = dict(raw.get("rope_parameters") or {})
    params.update(raw.get("rope_scaling") or {})
    theta = float(raw.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{path}: rope_type {rope_type!r} is not supported; supported: default, "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return theta, {"rope_type": rope_type, **params}


def _gemma3(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """Gemma 3's own fields (transformers 4.x keys: rope_theta, rope_local_base_freq,
    sliding_window_pattern; 5.x: rope_parameters per layer type, layer_types)."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(key) is not None:
            raise ModelLoadError(f"{path}: {key} is not supported")
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{path}: bidirectional attention is not supported")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"{path}: hidden activation {act!r}; Gemma 3 needs GELU-tanh")
    layers = int(raw["num_hidden_layers"])
    pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
    types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    params = raw.get("rope_parameters") or {}
    for kind in params.values():
        if isinstance(kind, dict) and kind.get("rope_type", "default") != "default":
            raise ModelLoadError(f"{path}: Gemma 3 rope scaling {kind} is not supported")
    if (raw.get("rope_scaling") or {}).get("rope_type", "default") != "default":
        raise ModelLoadError(f"{path}: Gemma 3 rope scaling {raw['rope_scaling']} is not supported")
    theta = (params.get("full_attention") or {}).get("rope_theta") or raw.get("rope_theta") or 1e6
    local = ((params.get("sliding_attention") or {}).get("rope_theta")
             or raw.get("rope_local_base_freq") or 1e4)
    hidden = int(raw["hidden_size"])
    return {
        "hidden_act": "gelu_pytorch_tanh", "norm_plus_one": True, "sandwich_norms": True,
        "embed_scale": float(np.float32(hidden**0.5)),  # as HF: a float32 tensor
        "attn_scale": float(raw.get("query_pre_attn_scalar") or 256) ** -0.5,
        "sliding_window": int(raw.get("sliding_window") or 4096),
        "layer_types": tuple(types), "rope_theta": float(theta), "rope_local_theta": float(local),
    }


def _check_sliding_window(raw: dict[str, Any], model_type: str, context_len: int, path: Path):
    window = raw.get("sliding_window")
    # Qwen2/3 configs carry a window that is only active with use_sliding_window=true.
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None
    if window is not None and int(window) < context_len:
        raise ModelLoadError(
            f"{path}: this model uses sliding-window attention (window {window}), which specserve "
            f"does not implement; run it with a context length of at most {window} "
            f"(requested {context_len})"
        )


def _merge_ids(*values: int | list[int] | None) -> list[int]:
    ids: list[int] = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            if item is not None and int(item) not in ids:
                ids.append(int(item))
    return ids
