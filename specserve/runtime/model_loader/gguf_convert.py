"""Convert a Llama- or Gemma 3-architecture GGUF file into a Hugging Face style model directory.

Output: config.json, generation_config.json, model.safetensors (dequantized, fp32 by default),
gguf_blocks.safetensors (the quantized tensors' own blocks, for the CPU engine, see
`specserve/runtime/model_loader/cpu_weights.py`), tokenizer.json and tokenizer_config.json (with the
chat template), and a completion marker. Everything is written into a temporary sibling directory
that is renamed into place at the end, so an interrupted conversion never leaves a directory that
looks finished.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

from specserve.runtime.errors import ModelLoadError
from specserve.runtime.model_loader import gguf_gemma3
from specserve.runtime.model_loader.tokenizer import build_gguf_tokenizer

# Written last into a converted directory; its presence proves the conversion completed.
COMPLETE_MARKER = ".specserve-converted.json"
CONVERTER_VERSION = 3  # 2: gguf_blocks.safetensors; 3: 5-bit and K-quant blocks, Gemma 3
# Block formats whose raw GGUF blocks are kept beside the dequantized weights: the CPU engine
# multiplies them as they are (`--weight-format auto`), so it runs the file's own weights.
KEPT_BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
BLOCKS_FILE = "gguf_blocks.safetensors"

# llama.cpp tensor name (after "blk.{i}.") -> Hugging Face name (after "model.layers.{i}.")
_LAYER_TENSORS = {
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
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a q_proj / k_proj weight.

    HF RoPE rotates the two halves of each head (`rotate_half`); llama.cpp rotates adjacent
    pairs. Its converter therefore reorders each head's output rows from
    [x0..x_{d/2-1}, y0..y_{d/2-1}] to [x0, y0, x1, y1, ...]. We put them back.
    `num_heads` is the attention head count for q and the KV head count for k.
    """
    out_features = weight.shape[0]
    head_dim = out_features // num_heads
    assert head_dim * num_heads == out_features and head_dim % 2 == 0, (weight.shape, num_heads)
    # [heads, head_dim/2, 2, in] -> [heads, 2, head_dim/2, in]: pairs back to halves
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key/value field of the file as Python values (arrays become lists)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def gguf_config(meta: dict[str, Any], tied: bool) -> dict[str, Any]:
    """config.json for the llama.* (or gemma3.*) metadata of a GGUF file."""
    arch = meta.get("general.architecture")
    if arch == gguf_gemma3.ARCH:
        return gguf_gemma3.config(meta, tied)
    if arch != "llama":
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; only 'llama' and 'gemma3' GGUF files "
            f"convert (other families: use their Hugging Face directory)"
        )

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks llama.{name}")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length") or meta.get("llama.rope.dimension_count")
                   or hidden // heads)
    vocab = int(meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    scaling = meta.get("llama.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear",
                                  "factor": float(meta["llama.rope.scaling.factor"])}
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {scaling!r} is not supported")
    return config


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> Path:
    """Convert `gguf_path` into the HF-style directory `out_dir` and return `out_dir`.

    If `out_dir` already holds a completed conversion it is returned untouched. Quantized
    tensors are dequantized with the `gguf` package; q/k weights are un-permuted back to the HF
    RoPE layout.
    """
    src, out = Path(gguf_path), Path(out_dir)
    if (out / COMPLETE_MARKER).is_file():
        return out
    if out.exists():
        raise ModelLoadError(f"{out} exists but is not a completed conversion; remove it first")
    if not src.is_file():
        raise ModelLoadError(f"GGUF file not found: {src}")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _convert_into(src, tmp, dtype, progress)
        try:
            os.rename(tmp, out)
        except OSError:
            if (out / COMPLETE_MARKER).is_file():  # another process finished first
                return out
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert_into(src: Path, tmp: Path, dtype: torch.dtype, progress: bool) -> None:
    try:
        reader = GGUFReader(src)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{src}: not a readable GGUF file: {exc}") from exc
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    config = gguf_config(meta, tied="output.weight" not in names)
    if "rope_freqs.weight" in names:
        raise ModelLoadError(
            f"{src}: carries rope_freqs (Llama 3.1-style RoPE scaling), whose parameters GGUF "
            f"does not record; load this model from its Hugging Face directory instead"
        )

    arch = meta.get("general.architecture")
    gemma = arch == gguf_gemma3.ARCH
    state: dict[str, torch.Tensor] = {}
    blocks: dict[str, torch.Tensor] = {}  # raw blocks [out_features, bytes per row], uint8
    block_types: dict[str, str] = {}
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for tensor in tqdm(reader.tensors, desc=f"converting {src.name}", unit="tensor",
                       disable=not progress):
        hf_name = _hf_name(tensor.name, arch)
        # gguf lists dims innermost first; numpy/torch want them outermost first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        weight = torch.from_numpy(array.copy()).to(dtype)  # [out_features, in_features]
        raw = None
        if tensor.tensor_type.name in KEPT_BLOCK_TYPES:
            raw = torch.from_numpy(tensor.data.reshape(shape[0], -1).copy())  # rows of blocks
        if gemma and gguf_gemma3.is_norm(hf_name):
            weight = weight - 1.0  # HF's convention: the model multiplies by (1 + w)
        elif gemma:
            pass  # llama.cpp keeps Gemma's q / k rows in HF's order
        elif hf_name.endswith("q_proj.weight"):
            weight = unpermute_qk(weight, heads)
            raw = None if raw is None else unpermute_qk(raw, heads)  # the same row order
        elif hf_name.endswith("k_proj.weight"):
            weight = unpermute_qk(weight, kv_heads)
            raw = None if raw is None else unpermute_qk(raw, kv_heads)
        state[hf_name] = weight.contiguous()
        if raw is not None:
            blocks[hf_name] = raw.contiguous()
            block_types[hf_name] = tensor.tensor_type.name
    _check_complete(state, config, src, arch)

    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    bos, eos_ids, pad = _save_tokenizer(src, meta, tmp, config["max_position_embeddings"])
    config["bos_token_id"] = bos
    config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    generation = {"bos_token_id": bos, "eos_token_id": eos_ids, "pad_token_id": pad}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if blocks:
        save_file(blocks, str(tmp / BLOCKS_FILE),
                  metadata={"format": "gguf-blocks", "types": json.dumps(block_types)})
    _write_json(tmp / "config.json", config)
    _write_json(tmp / "generation_config.json", generation)
    stat = src.stat()
    _write_json(tmp / COMPLETE_MARKER, {"source": str(src.resolve()), "size": stat.st_size,
                                        "mtime": stat.st_mtime, "version": CONVERTER_VERSION})


def _save_tokenizer(src: Path, meta: dict[str, Any], out: Path,
                    max_length: int) -> tuple[int | None, list[int], int | None]:
    """tokenizer.json and tokenizer_config.json into `out`; (bos, eos ids, pad)."""
    if meta.get("tokenizer.ggml.model") == "llama":  # SentencePiece (Gemma): transformers'
        return gguf_gemma3.save_tokenizer(src, out, max_length)
    tok = build_gguf_tokenizer(meta)
    tok.tokenizer.save(str(out / "tokenizer.json"))
    tok.tokenizer_config["model_max_length"] = max_length
    _write_json(out / "tokenizer_config.json", tok.tokenizer_config)
    return tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id


def _layer_tensors(arch: str) -> dict[str, str]:
    return gguf_gemma3.LAYER_TENSORS if arch == gguf_gemma3.ARCH else _LAYER_TENSORS


def _hf_name(gguf_name: str, arch: str = "llama") -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.match(gguf_name)
    table = _layer_tensors(arch)
    if match and match.group(2) in table:
        return f"model.layers.{match.group(1)}.{table[match.group(2)]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no {arch} equivalent")


def _check_complete(state: dict[str, torch.Tensor], config: dict[str, Any], src: Path,
                    arch: str) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{name}" for i in range(config["num_hidden_layers"])
                 for name in _layer_tensors(arch).values()}
    missing = sorted(expected - state.keys())
    if missing:
        raise ModelLoadError(f"{src}: missing tensors {missing[:5]} ({len(missing)} in all)")


def _remove_stale_temp_dirs(out: Path) -> None:
    # A crashed conversion leaves ".name.tmp-PID-TOKEN"; remove those whose process is gone.
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        pid = stale.name.rsplit(".tmp-", 1)[-1].split("-")[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
