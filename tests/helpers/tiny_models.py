"""Tiny random checkpoints for tests: HF directories (built with transformers' own model classes,
so tests can compare our model against HF) and a tiny Llama GGUF file (laid out as llama.cpp
writes one). Everything is seeded and built in code: no downloads.

    model_dir = write_tiny_model(tmp_path / "llama", "llama")
    hf = LlamaForCausalLM.from_pretrained(model_dir)   # the reference
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
BOS_ID, EOS_ID, PAD_ID = 1, 2, 2
TINY_VOCAB_SIZE = 320  # model vocab; the tokenizer uses the first ~300 ids
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "def add(a, b):\n    return a + b\n",
    "speculative decoding drafts tokens and the target model verifies them",
    "Hello, world! 1234567890 café naïve 日本語",
    "for i in range(10):\n    print(i * i)\n",
]
_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
# Gemma 3's shape in small: one KV head, head_dim != hidden / heads, an attention scale of its
# own, and a sliding window shorter than the test prompts over every layer but the last
_GEMMA3 = dict(num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
               layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True,
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                "full_attention": {"rope_type": "default", "rope_theta": 1e6}})


def make_tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer (~300 tokens) trained on a fixed in-code corpus."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    assert tokenizer.get_vocab_size() <= TINY_VOCAB_SIZE
    return tokenizer


def tiny_config(arch: str, **overrides: object):
    """A transformers config for a 2-layer model of family `arch` (GQA: 4 heads, 2 KV heads;
    Gemma 3: one KV head, a sliding window of 8 on layer 0)."""
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    if arch not in _ARCHS:
        raise ValueError(f"arch must be one of {_ARCHS}, got {arch!r}")
    common: dict[str, object] = dict(
        vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=False,
    )
    if arch == "qwen3":
        common["head_dim"] = 32  # explicit and != hidden_size / heads, as in real Qwen3
    if arch == "gemma3":
        common.update(_GEMMA3)
    common.update(overrides)
    config_class = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config,
                    "qwen3": Qwen3Config, "gemma3": Gemma3TextConfig}[arch]
    return config_class(**common)


def write_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0,
                     **config_overrides: object) -> Path:
    """Write a random tiny HF model directory (config, safetensors, tokenizer) and return it.

    Norm weights and biases are randomised too (HF initialises them to constants), so a
    comparison against HF catches a missing norm or bias. The global torch RNG is left untouched.
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    config = tiny_config(arch, **config_overrides)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.copy_(1.0 + 0.1 * torch.randn_like(param))
                elif name.endswith(".bias"):
                    param.copy_(0.02 * torch.randn_like(param))
    model.save_pretrained(out)
    write_tiny_tokenizer_files(out, max_length=config.max_position_embeddings)
    return out


def write_tiny_tokenizer_files(out_dir: Path, max_length: int = 256) -> None:
    """tokenizer.json + tokenizer_config.json (ChatML template) into `out_dir`."""
    make_tiny_tokenizer().save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID], "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID], "unk_token": SPECIAL_TOKENS[0],
        "add_bos_token": False, "model_max_length": max_length,
        "clean_up_tokenization_spaces": False, "chat_template": CHATML_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order: per head, halves [x.., y..] become interleaved [x0, y0, ...]."""
    head_dim = weight.shape[0] // num_heads
    # [heads, 2 (half), head_dim/2, in] -> [heads, head_dim/2, 2, in]
    return weight.reshape(num_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(weight.shape)


def _llama_cpp_unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def _fp16_bytes(rng: np.random.Generator, n: int, lo: float, hi: float) -> np.ndarray:
    return rng.uniform(lo, hi, n).astype(np.float16).view(np.uint8).reshape(n, 2)


def random_kquant_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF rows [n, bytes] of a random Q4_K / Q5_K / Q6_K matrix (gguf has no K-quant
    quantizer): random integers and 6-bit / int8 sub-scales (any bytes are valid ones), super-
    block scales of a trained model's size, so weights come out ~1e-2."""
    rng = np.random.default_rng(seed)
    nsb = n * (k // 256)
    if kind == "Q6_K":
        parts = [rng.integers(0, 256, (nsb, 208), dtype=np.uint8),
                 _fp16_bytes(rng, nsb, 1e-5, 1e-4)]
    else:
        rest = 12 + 128 + (32 if kind == "Q5_K" else 0)
        lo = 1e-4 if kind == "Q5_K" else 2e-4
        parts = [_fp16_bytes(rng, nsb, lo, 10 * lo), _fp16_bytes(rng, nsb, 1e-4, 1e-3),
                 rng.integers(0, 256, (nsb, rest), dtype=np.uint8)]
    return np.concatenate(parts, axis=1).reshape(n, -1)


def gguf_blocks(array: np.ndarray, kind: str, seed: int = 0) -> np.ndarray:
    """`array` [n, k] as GGUF's raw rows of block type `kind`: gguf's own quantizer, or for
    K-quants (which it cannot make) random blocks of the same shape."""
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        return random_kquant_blocks(kind, *array.shape, seed=seed)
    return gguf.quants.quantize(array, gguf.GGMLQuantizationType[kind])


def write_tiny_gguf(path: str | Path, seed: int = 0, tie_word_embeddings: bool = False,
                    num_layers: int = 2, linear_type: str | dict[str, str] = "F32",
                    embed_type: str = "F32", hidden: int = 64,
                    inter: int = 128) -> dict[str, torch.Tensor]:
    """Write a random tiny Llama GGUF (byte-level BPE tokenizer, ChatML template). Linear weights
    are stored as `linear_type` (one type, or one per projection: {"q_proj": "Q5_0", ...}), the
    embedding (and untied output) as `embed_type`: F32, or a block format quantized by gguf's
    own quantizer, as llama.cpp files are (K-quants: random blocks; they need K % 256 == 0).

    Returns the HF-layout weights it encodes (before llama.cpp's q/k permutation), by HF name;
    for quantized tensors, their dequantized values (what a loader must reproduce).
    """
    heads, kv_heads = 4, 2
    head_dim = hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    hf: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(TINY_VOCAB_SIZE, hidden)}
    if not tie_word_embeddings:
        hf["lm_head.weight"] = rand(TINY_VOCAB_SIZE, hidden)
    hf["model.norm.weight"] = 1 + 0.1 * rand(hidden)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        hf[p + "input_layernorm.weight"] = 1 + 0.1 * rand(hidden)
        hf[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rand(hidden)
        hf[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        hf[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        hf[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        hf[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        hf[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        hf[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        hf[p + "mlp.down_proj.weight"] = rand(hidden, inter)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(TINY_VOCAB_SIZE)
    add_gguf_tokenizer(writer)
    for name, tensor in hf.items():
        array = _llama_cpp_layout(name, tensor, heads, kv_heads)
        kind = embed_type if "embed" in name or name == "lm_head.weight" else linear_type
        if isinstance(kind, dict):
            kind = kind.get(name.split(".")[-2], "F32")
        if array.ndim == 2 and kind != "F32":
            qtype = gguf.GGMLQuantizationType[kind]
            raw = gguf_blocks(array, kind, seed=seed + zlib.crc32(name.encode()))
            writer.add_tensor(_gguf_name(name), raw, raw_shape=raw.shape, raw_dtype=qtype)
            deq = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(array.shape).copy())
            if name.endswith("q_proj.weight"):  # back to HF row order
                deq = _llama_cpp_unpermute(deq, heads)
            elif name.endswith("k_proj.weight"):
                deq = _llama_cpp_unpermute(deq, kv_heads)
            hf[name] = deq
        else:
            writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def add_gguf_tokenizer(writer: gguf.GGUFWriter, pre: str = "gpt2", chat_template: bool = True,
                       shuffle_seed: int | None = None) -> None:
    """The tiny tokenizer as GGUF metadata (llama.cpp's byte-level BPE keys), with the ChatML
    template unless `chat_template` is False. `shuffle_seed`: its ordinary tokens trade ids
    (the special ones keep theirs), another vocabulary of the same size and specials."""
    tokenizer = make_tiny_tokenizer()
    spec = json.loads(tokenizer.to_str())
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    if shuffle_seed is not None:
        ids = sorted(i for i, t in by_id.items() if t not in SPECIAL_TOKENS)
        moved = np.random.default_rng(shuffle_seed).permutation(ids).tolist()
        by_id = {**by_id, **{new: by_id[old] for old, new in zip(ids, moved)}}
    # Pad the vocabulary to the model's size with unused placeholder tokens, as real files do.
    tokens = [by_id.get(i, f"<unused{i}>") for i in range(TINY_VOCAB_SIZE)]
    types = [3 if t in SPECIAL_TOKENS else 5 if i not in by_id else 1
             for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    if chat_template:
        writer.add_chat_template(CHATML_TEMPLATE)


_GGUF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[rest]}"


def _llama_cpp_layout(name: str, tensor: torch.Tensor, heads: int, kv_heads: int) -> np.ndarray:
    if name.endswith("q_proj.weight"):
        tensor = llama_cpp_permute(tensor, heads)
    elif name.endswith("k_proj.weight"):
        tensor = llama_cpp_permute(tensor, kv_heads)
    return np.ascontiguousarray(tensor.numpy())  # [out, in]; GGUF stores dims reversed
