"""Tiny GGUF files of the Llama family (`llama`, `qwen2`, `qwen3`), written as llama.cpp's
converter writes them, from a random tiny model built with transformers' own class
(tests/helpers/tiny_models.py). Everything is seeded and built in code: no downloads.

    hf_dir = write_family_gguf(tmp_path / "q.gguf", "qwen2", linear_type="Q8_0")
    # tmp_path / "q.gguf": the GGUF; hf_dir: the float model it was written from

What llama.cpp does per family, and so what a reader must undo:
- llama: each head's q / k rows reordered for its adjacent-pair RoPE (`llama_cpp_permute`);
  Llama 3.1-style RoPE scaling stored as a `rope_freqs` tensor (a divisor per frequency), not
  as metadata; `rope.dimension_count` holds the head size;
- qwen2: q / k rows in HF's order (its RoPE is the rotate-half, "NEOX", one), q / k / v biases;
- qwen3: rows in HF's order, per-head q / k norms, the head size as `attention.key_length`.
Norms and biases are float32; a tied head has no `output.weight`.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

from tests.helpers.tiny_models import (
    TINY_VOCAB_SIZE,
    add_gguf_tokenizer,
    gguf_blocks,
    llama_cpp_permute,
    write_tiny_model,
)

FAMILIES = ("llama", "qwen2", "qwen3")
# llama.cpp's pre-tokenizer names for the families' real vocabularies
_PRE = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
# transformers' GGUF reader ignores qwen3's attention.key_length and takes Qwen3Config's
# default head size (128); a tiny Qwen3 uses it so that reader sees the file as we do
QWEN3_HEAD_DIM = 128


def write_family_gguf(path: str | Path, arch: str, seed: int = 0, tied: bool = False,
                      linear_type: str | dict[str, str] = "F32", embed_type: str = "F32",
                      chat_template: bool = True, rope_scaling: dict | None = None,
                      shuffle_vocab: int | None = None, **config_overrides: object) -> Path:
    """Write a random tiny model of family `arch` as the GGUF `path`; return the float HF
    directory it came from (beside `path`).

    `linear_type` is one GGUF type for every projection or one per projection
    ({"q_proj": "Q5_0", ...}, others F32); `embed_type` is the embedding's and an untied
    output's. Block formats are gguf's own quantizer's (K-quants: random blocks, K % 256 == 0).
    `rope_scaling` (llama only) is a transformers `llama3` rope dict, written as `rope_freqs`.
    `shuffle_vocab` (a seed) gives the file another vocabulary (tiny_models.add_gguf_tokenizer).
    """
    if arch not in FAMILIES:
        raise ValueError(f"arch must be one of {FAMILIES}, got {arch!r}")
    path = Path(path)
    overrides = dict(config_overrides, tie_word_embeddings=tied)
    if arch == "qwen3":
        overrides.setdefault("head_dim", QWEN3_HEAD_DIM)
    if rope_scaling:
        overrides.update(rope_scaling=dict(rope_scaling), rope_theta=500000.0)
    hf_dir = write_tiny_model(path.with_suffix(".hf"), arch, seed=seed, **overrides)
    config = _read_config(hf_dir)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    _add_hparams(writer, arch, config)
    add_gguf_tokenizer(writer, pre=_PRE[arch], chat_template=chat_template,
                       shuffle_seed=shuffle_vocab)
    if rope_scaling:
        writer.add_tensor("rope_freqs.weight", llama3_rope_divisors(config))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for name, tensor in load_file(str(hf_dir / "model.safetensors")).items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = llama_cpp_permute(tensor, heads if "q_proj" in name else kv_heads)
        array = np.ascontiguousarray(tensor.float().numpy())  # [out, in]; GGUF: dims reversed
        kind = _kind(name, linear_type, embed_type)
        if array.ndim == 2 and kind != "F32":
            raw = gguf_blocks(array, kind, seed=seed + zlib.crc32(name.encode()))
            writer.add_tensor(_gguf_name(name), raw, raw_shape=raw.shape,
                              raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf_dir


def llama3_rope_divisors(config: dict) -> np.ndarray:
    """llama.cpp's `rope_freqs` for a `llama3` rope: per frequency, what it divides by
    (1 for short wavelengths, `factor` for long ones, a blend between)."""
    rope = config.get("rope_scaling") or config["rope_parameters"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    theta = config.get("rope_theta") or rope["rope_theta"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _read_config(hf_dir: Path) -> dict:
    import json

    return json.loads((hf_dir / "config.json").read_text())


def _add_hparams(writer: gguf.GGUFWriter, arch: str, config: dict) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(float(config.get("rope_theta") or rope.get("rope_theta")))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(TINY_VOCAB_SIZE)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def _kind(name: str, linear_type: str | dict[str, str], embed_type: str) -> str:
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return embed_type
    if isinstance(linear_type, dict):
        return linear_type.get(name.split(".")[-2], "F32")
    return linear_type if name.endswith("proj.weight") else "F32"


def _gguf_name(hf_name: str) -> str:
    if hf_name in _TOP:
        return _TOP[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}"


def transformers_gguf_model(gguf_path: str | Path) -> torch.nn.Module:
    """transformers' own reading of a GGUF file, in float32 (its config, its dequantization,
    its tensor mapping). `from_pretrained(gguf_file=...)` insists on `accelerate`, which this
    project does not install; the GGUF reader it calls does not need it, so without accelerate
    the same reader fills a model built from the same config."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.utils import is_accelerate_available

    path = Path(gguf_path)
    if is_accelerate_available():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    dtype=torch.float32).eval()
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True,
                                   model_to_load=model)["tensors"]
    missing, _ = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    assert set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set()), missing
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()
