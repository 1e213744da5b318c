"""Synthetic EAGLE draft-head checkpoints, in exactly the public layouts, for a tiny target.

    target = write_tiny_model(tmp / "target", "llama", num_hidden_layers=8)
    e1 = write_eagle1_checkpoint(tmp / "e1", target, fmt="bin")        # pytorch_model.bin
    e3 = write_eagle3_checkpoint(tmp / "e3", target, draft_vocab_size=64)

EAGLE-1/2 (SafeAILab/EAGLE): config.json of a one-layer LlamaForCausalLM + `fc.{weight,bias}`,
`layers.0.*` (no input_layernorm unless asked), optional `embed_tokens.weight`. EAGLE-3:
config.json with `architectures: [LlamaForCausalLMEagle3]`, `draft_vocab_size`, + `fc.weight`,
`midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`. Random weights, seeded; the
global torch RNG is left untouched. Size overrides build self-consistent heads that do not fit
the target (for the mismatch tests).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def target_tensors(target_dir: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(target_dir) / "model.safetensors"))


def write_eagle1_checkpoint(
    out_dir: str | Path, target_dir: str | Path, *, fmt: str = "bin", seed: int = 0,
    input_layernorm: bool = False, fc_bias: bool = True, embed: str = "none",
    key_prefix: str = "", hidden_size: int | None = None, vocab_size: int | None = None,
    num_attention_heads: int = 4, num_key_value_heads: int = 2, intermediate_size: int = 96,
) -> Path:
    """`embed`: "none" (shared with the target), "target" (a stored copy of the target's) or
    "random" (the head's own)."""
    tcfg = _target_config(target_dir)
    hidden = hidden_size or tcfg["hidden_size"]
    vocab = vocab_size or tcfg["vocab_size"]
    head_dim = hidden // num_attention_heads
    gen = torch.Generator().manual_seed(seed)
    state = {"fc.weight": _linear(gen, hidden, 2 * hidden)}
    if fc_bias:
        state["fc.bias"] = 0.02 * torch.randn(hidden, generator=gen)
    state.update(_decoder_layer(
        gen, "layers.0.", hidden, hidden, num_attention_heads, num_key_value_heads, head_dim,
        intermediate_size, input_layernorm=input_layernorm, hidden_norm=False,
    ))
    state.update(_embedding(gen, embed, target_dir, vocab, hidden))
    config = _llama_config(tcfg, hidden, vocab, num_attention_heads, num_key_value_heads,
                           intermediate_size)
    config["architectures"] = ["LlamaForCausalLM"]
    return _write(out_dir, state, config, fmt, key_prefix)


def write_eagle3_checkpoint(
    out_dir: str | Path, target_dir: str | Path, *, fmt: str = "safetensors", seed: int = 0,
    draft_vocab_size: int = 64, hot_ids: torch.Tensor | None = None, embed: str = "none",
    key_prefix: str = "", aux_layer_ids: list[int] | None = None,
    hidden_size: int | None = None, vocab_size: int | None = None,
    num_attention_heads: int = 8, num_key_value_heads: int = 2, head_dim: int = 16,
    intermediate_size: int = 96,
) -> Path:
    """`hot_ids`: the sorted target ids of the draft vocabulary (default: a seeded random
    subset). `aux_layer_ids`: written as `eagle_config.eagle_aux_hidden_state_layer_ids`
    (layer-output ids), else absent (the default layers apply)."""
    tcfg = _target_config(target_dir)
    hidden = hidden_size or tcfg["hidden_size"]
    vocab = vocab_size or tcfg["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    if hot_ids is None:
        hot_ids = torch.randperm(vocab, generator=gen)[:draft_vocab_size].sort().values
    hot_ids = hot_ids.to(torch.int64)
    assert hot_ids.numel() == draft_vocab_size
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot_ids] = True
    state = {
        "fc.weight": _linear(gen, hidden, 3 * hidden),
        "norm.weight": _norm(gen, hidden),
        "lm_head.weight": _linear(gen, draft_vocab_size, hidden),
        "d2t": hot_ids - torch.arange(draft_vocab_size),  # target id = draft id + d2t[draft id]
        "t2d": t2d,
    }
    state.update(_decoder_layer(
        gen, "midlayer.", hidden, 2 * hidden, num_attention_heads, num_key_value_heads,
        head_dim, intermediate_size, input_layernorm=True, hidden_norm=True,
    ))
    state.update(_embedding(gen, embed, target_dir, vocab, hidden))
    config = _llama_config(tcfg, hidden, vocab, num_attention_heads, num_key_value_heads,
                           intermediate_size)
    config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab_size,
                  head_dim=head_dim)
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    return _write(out_dir, state, config, fmt, key_prefix)


def read_checkpoint(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by public name (`model.` prefix removed)."""
    path = Path(ckpt_dir)
    if (path / "model.safetensors").is_file():
        state = load_file(str(path / "model.safetensors"))
    else:
        state = torch.load(path / "pytorch_model.bin", weights_only=True)
    return {k.removeprefix("model."): v for k, v in state.items()}


def _target_config(target_dir: str | Path) -> dict:
    return json.loads((Path(target_dir) / "config.json").read_text())


def _linear(gen: torch.Generator, out_features: int, in_features: int) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=gen) / in_features**0.5


def _norm(gen: torch.Generator, dim: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(dim, generator=gen)


def _decoder_layer(
    gen: torch.Generator, prefix: str, hidden: int, attn_in: int, heads: int, kv_heads: int,
    head_dim: int, intermediate: int, *, input_layernorm: bool, hidden_norm: bool,
) -> dict[str, torch.Tensor]:
    p = prefix
    state = {
        p + "self_attn.q_proj.weight": _linear(gen, heads * head_dim, attn_in),
        p + "self_attn.k_proj.weight": _linear(gen, kv_heads * head_dim, attn_in),
        p + "self_attn.v_proj.weight": _linear(gen, kv_heads * head_dim, attn_in),
        p + "self_attn.o_proj.weight": _linear(gen, hidden, heads * head_dim),
        p + "post_attention_layernorm.weight": _norm(gen, hidden),
        p + "mlp.gate_proj.weight": _linear(gen, intermediate, hidden),
        p + "mlp.up_proj.weight": _linear(gen, intermediate, hidden),
        p + "mlp.down_proj.weight": _linear(gen, hidden, intermediate),
    }
    if input_layernorm:
        state[p + "input_layernorm.weight"] = _norm(gen, hidden)
    if hidden_norm:
        state[p + "hidden_norm.weight"] = _norm(gen, hidden)
    return state


def _embedding(
    gen: torch.Generator, embed: str, target_dir: str | Path, vocab: int, hidden: int
) -> dict[str, torch.Tensor]:
    if embed == "none":
        return {}
    if embed == "target":
        return {"embed_tokens.weight": target_tensors(target_dir)["model.embed_tokens.weight"]}
    assert embed == "random", f"embed must be none, target or random, got {embed!r}"
    return {"embed_tokens.weight": torch.randn(vocab, hidden, generator=gen)}


def _llama_config(tcfg: dict, hidden: int, vocab: int, heads: int, kv_heads: int,
                  intermediate: int) -> dict:
    return {
        "model_type": "llama", "hidden_act": "silu", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": 1,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        # shorter than the target's on purpose, as in published heads
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "vocab_size": vocab, "bos_token_id": tcfg.get("bos_token_id"),
        "eos_token_id": tcfg.get("eos_token_id"), "pad_token_id": 0,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }


def _write(out_dir: str | Path, state: dict[str, torch.Tensor], config: dict, fmt: str,
           key_prefix: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {key_prefix + k: v.contiguous() for k, v in state.items()}
    if fmt == "bin":
        torch.save(state, out / "pytorch_model.bin")  # a plain state dict, as EAGLE ships them
    else:
        assert fmt == "safetensors", f"fmt must be bin or safetensors, got {fmt!r}"
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
