"""What converting a Gemma 3 GGUF file (llama.cpp's `gemma3` architecture) takes beyond a Llama
one: its config.json, its tensor names, norm weights back to HF's convention, and its
SentencePiece tokenizer (`tokenizer.ggml.model == "llama"`), rebuilt by transformers' own GGUF
reader into a `GemmaTokenizer`.

llama.cpp's converter stores Gemma's norm weights as (1 + w), the factor its plain RMSNorm
multiplies by; HF checkpoints hold w. The conversion writes w = stored - 1 in float32 (as
transformers' GGUF loader does), and the models add the one back
(specserve/runtime/models/gemma3.py). llama.cpp does not permute Gemma's q / k rows (its RoPE for
Gemma is the rotate-half one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specserve.runtime.errors import ModelLoadError

ARCH = "gemma3"
# llama.cpp hard-codes these for Gemma 3 (they are not in the file)
SLIDING_WINDOW_PATTERN = 6  # every sixth layer attends globally
ROPE_LOCAL_BASE = 10000.0

# llama.cpp tensor name (after "blk.{i}.") -> Hugging Face name (after "model.layers.{i}.")
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def config(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """config.json (transformers' Gemma3TextConfig keys) for the gemma3.* metadata."""

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{ARCH}.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {ARCH}.{name}")
        return value

    if not tied:
        raise ModelLoadError("a Gemma 3 GGUF with an untied output.weight is not supported")
    if meta.get(f"{ARCH}.rope.scaling.type") not in (None, "none"):
        raise ModelLoadError("Gemma 3 GGUF rope scaling is not supported")
    heads = int(key("attention.head_count"))
    head_dim = int(meta.get(f"{ARCH}.attention.key_length")
                   or int(key("embedding_length")) // heads)
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "vocab_size": int(meta.get(f"{ARCH}.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
        "hidden_size": int(key("embedding_length")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,  # llama.cpp's scale for every size but 27B
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 1e6)),
        "rope_local_base_freq": ROPE_LOCAL_BASE,
        "sliding_window": int(key("attention.sliding_window")),
        "sliding_window_pattern": SLIDING_WINDOW_PATTERN,
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": True,
        "attention_bias": False,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "torch_dtype": "float32",
    }


def is_norm(hf_name: str) -> bool:
    return hf_name.endswith("norm.weight")


def save_tokenizer(src: Path, out: Path, max_length: int) -> tuple[int | None, list[int],
                                                                   int | None]:
    """transformers' tokenizer of the GGUF file saved into `out`; (bos, eos ids, pad)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name,
                                            local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"{src}: cannot read its tokenizer: {exc}") from exc
    tok.model_max_length = max_length
    tok.save_pretrained(str(out))
    eos = [i for i in (tok.eos_token_id,) if i is not None]
    return tok.bos_token_id, eos, tok.pad_token_id
