"""What converting a GGUF file of the Llama family takes: llama.cpp's architectures `llama`
(Llama 2 / 3.x, SmolLM, Mistral), `qwen2` (Qwen2, Qwen2.5) and `qwen3` (dense Qwen3).

Per architecture (llama.cpp's converter, read for the facts):
- llama: each head's q / k rows are reordered for llama.cpp's adjacent-pair RoPE; we put them
  back (`permuted_qk`). Llama 3.1-style RoPE scaling is not in the metadata but in a
  `rope_freqs` tensor, one divisor per frequency; `llama3_rope_scaling` recovers the
  parameters of transformers' `llama3` rope from it, and checks they reproduce every divisor.
- qwen2: q / k / v biases; RoPE is the rotate-half ("NEOX") one, so rows keep HF's order; a
  sliding window is never active in llama.cpp, nor here.
- qwen3: per-head q / k RMSNorm, no biases; the head size is `attention.key_length`.
Each may have a tied head (no `output.weight`) and fewer KV heads than query heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from specserve.runtime.errors import ModelLoadError
from specserve.runtime.layers.rotary import rope_inv_freq


@dataclass(frozen=True)
class Family:
    hf_architecture: str
    model_type: str
    permuted_qk: bool  # llama.cpp reordered q / k rows (pair RoPE) and we must undo it
    qkv_bias: bool  # every layer's q / k / v carry a bias
    qk_norm: bool  # per-head RMSNorm on q and k


FAMILIES = {
    "llama": Family("LlamaForCausalLM", "llama", True, False, False),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", False, True, False),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", False, False, True),
}

# llama.cpp tensor name (after "blk.{i}.") -> Hugging Face name (after "model.layers.{i}.")
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
BIAS_TENSORS = {f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"}
QK_NORM_TENSORS = {f"attn_{p}_norm.weight": f"self_attn.{p}_norm.weight" for p in "qk"}
ROPE_FREQS = "rope_freqs.weight"


def layer_tensors(arch: str, has_bias: bool = False) -> dict[str, str]:
    """The per-layer tensors a file of `arch` holds (biases: qwen2's, or any file's that has
    them)."""
    fam = FAMILIES[arch]
    table = dict(LAYER_TENSORS)
    if fam.qkv_bias or has_bias:
        table.update(BIAS_TENSORS)
    if fam.qk_norm:
        table.update(QK_NORM_TENSORS)
    return table


def config(meta: dict[str, Any], arch: str, tied: bool, has_bias: bool,
           rope_freqs: np.ndarray | None) -> dict[str, Any]:
    """config.json (transformers' keys) for the `{arch}.*` metadata of a Llama-family file."""
    fam = FAMILIES[arch]

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length")
                   or meta.get(f"{arch}.rope.dimension_count") or hidden // heads)
    theta = float(key("rope.freq_base", 10000.0))
    out: dict[str, Any] = {
        "architectures": [fam.hf_architecture],
        "model_type": fam.model_type,
        "hidden_act": "silu",
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": tied,
        "attention_bias": fam.qkv_bias or has_bias,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    if fam.model_type.startswith("qwen"):
        out.update(use_sliding_window=False, sliding_window=None)
    scaling = _rope_scaling(meta, arch, head_dim, theta, rope_freqs)
    if scaling is not None:
        out["rope_scaling"] = scaling
    return out


def _rope_scaling(meta: dict[str, Any], arch: str, head_dim: int, theta: float,
                  rope_freqs: np.ndarray | None) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if rope_freqs is not None:
        if kind not in (None, "none"):
            raise ModelLoadError(f"GGUF rope scaling {kind!r} together with rope_freqs is not "
                                 f"supported")
        return llama3_rope_scaling(rope_freqs, head_dim, theta)
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    if kind not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported; supported: linear, "
                             f"and Llama 3's (a rope_freqs tensor)")
    return None


def llama3_rope_scaling(divisors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any] | None:
    """transformers' `llama3` rope parameters that give llama.cpp's per-frequency `divisors`.

    llama3 divides frequency i by 1 (wavelength below old_len / high), by `factor` (above
    old_len / low), or between them by 1 / ((1 - s) / factor + s) with s linear in
    1 / wavelength. Only old_len / low and old_len / high are fixed by the divisors, so
    low_freq_factor is taken as 1 (Llama 3's), and high_freq_factor as 4 (Llama 3's) too when
    fewer than two frequencies are blended. None when every divisor is 1.
    """
    div = np.asarray(divisors, dtype=np.float64)
    base = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if div.shape != base.shape:
        raise ModelLoadError(f"GGUF rope_freqs has {div.size} entries; the head size "
                             f"{head_dim} needs {base.size}")
    if np.allclose(div, 1.0, rtol=0, atol=1e-6):
        return None
    factor = float(div.max())
    wavelen = 2 * math.pi / base
    kept, slowed = div <= 1 + 1e-6, div >= factor * (1 - 1e-6)
    blended = ~(kept | slowed)
    params = (_fit_blend(1 / div[blended], wavelen[blended], factor) if blended.sum() >= 2
              else _place_band(wavelen, kept, slowed, div, factor))
    scaling = {"rope_type": "llama3", "factor": factor, **params}
    _check_reproduces(scaling, div, head_dim, theta, base)
    return scaling


def _fit_blend(inv_div: np.ndarray, wavelen: np.ndarray, factor: float) -> dict[str, float]:
    # 1/div = (1 - s)/factor + s  =>  s = (1/div - 1/factor) / (1 - 1/factor) = a/wavelen - b
    s = (inv_div - 1 / factor) / (1 - 1 / factor)
    a, minus_b = np.polyfit(1 / wavelen, s, 1)
    b = -minus_b
    if a <= 0 or b <= 0:
        raise ModelLoadError("GGUF rope_freqs do not follow Llama 3's RoPE scaling")
    # a = old / (high - low), b = low / (high - low); with low = 1:
    old = a / b
    return {"low_freq_factor": 1.0, "high_freq_factor": _round_if_close(1 + 1 / b),
            "original_max_position_embeddings": _context(old)}


def _place_band(wavelen: np.ndarray, kept: np.ndarray, slowed: np.ndarray, div: np.ndarray,
                factor: float) -> dict[str, float]:
    # Llama 3's low / high factors (1, 4); old_len is where the one blended frequency (if
    # any) lands, else anywhere with every kept wavelength below old / 4 and slowed above old.
    low, high = 1.0, 4.0
    blended = ~(kept | slowed)
    if blended.any():
        s = (1 / div[blended][0] - 1 / factor) / (1 - 1 / factor)
        old = float(wavelen[blended][0] * (s * (high - low) + low))
    else:
        lo = high * (wavelen[kept].max() if kept.any() else 0.0)
        hi = wavelen[slowed].min()
        old = math.sqrt(max(lo, 1.0) * hi)
    return {"low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": _context(old)}


def _round_if_close(x: float) -> float:
    # the divisors are float32: a fitted 8192.0004 is Llama 3's 8192
    return float(round(x)) if abs(x - round(x)) < 1e-4 * max(1.0, abs(x)) else float(x)


def _context(x: float) -> int | float:
    x = _round_if_close(x)
    return int(x) if x.is_integer() else x


def _check_reproduces(scaling: dict[str, Any], div: np.ndarray, head_dim: int,
                      theta: float, base: np.ndarray) -> None:
    ours = rope_inv_freq(head_dim, theta, scaling).double().numpy()
    want = base / div
    if not np.allclose(ours, want, rtol=1e-5, atol=0):
        worst = float(np.max(np.abs(ours / want - 1)))
        raise ModelLoadError(f"GGUF rope_freqs do not follow Llama 3's RoPE scaling (the "
                             f"closest parameters {scaling} miss by {worst:.1e})")
