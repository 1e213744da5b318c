"""Convert a GGUF file of the Llama family (`llama`, `qwen2`, `qwen3`: gguf_llama.py) or of Gemma 3
(gguf_gemma3.py) into a Hugging Face style model directory.

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

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

from specserve.runtime.errors import ModelLoadError
from specserve.runtime.model_loader import gguf_gemma3, gguf_llama
from specserve.runtime.model_loader.tokenizer import build_gguf_tokenizer

# Written last into a converted directory; its presence proves the conversion completed.
COMPLETE_MARKER = ".specserve-converted.json"
CONVERTER_VERSION = 3  # 2: gguf_blocks.safetensors; 3: 5-bit and K-quant blocks, Gemma 3
# Block formats whose raw GGUF blocks are kept beside the dequantized weights: the CPU engine
# multiplies them as they are (`--weight-format auto`), so it runs the file's own weights.
KEPT_BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
BLOCKS_FILE = "gguf_blocks.safetensors"

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")
# general.architecture values we read
GGUF_ARCHITECTURES = (*gguf_llama.FAMILIES, gguf_gemma3.ARCH)


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


def gguf_config(meta: dict[str, Any], names: set[str],
                rope_freqs: np.ndarray | None = None) -> dict[str, Any]:
    """config.json for the metadata of a GGUF file holding the tensors `names` (and the
    `rope_freqs` divisors, taken out of them)."""
    arch = meta.get("general.architecture")
    tied = "output.weight" not in names
    if arch == gguf_gemma3.ARCH:
        return gguf_gemma3.config(meta, tied)
    if arch not in gguf_llama.FAMILIES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; the GGUF architectures we read are "
            f"{', '.join(GGUF_ARCHITECTURES)} (other families: use their Hugging Face directory)"
        )
    has_bias = any(n.endswith(".attn_q.bias") for n in names)
    return gguf_llama.config(meta, arch, tied, has_bias, rope_freqs)


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
    tensors = [t for t in reader.tensors if t.name != gguf_llama.ROPE_FREQS]
    freqs = next((t for t in reader.tensors if t.name == gguf_llama.ROPE_FREQS), None)
    freqs = None if freqs is None else dequantize(freqs.data, freqs.tensor_type).reshape(-1)
    config = gguf_config(meta, {t.name for t in tensors}, freqs)
    arch = meta["general.architecture"]
    table = _layer_tensors(arch, config)

    state: dict[str, torch.Tensor] = {}
    blocks: dict[str, torch.Tensor] = {}  # raw blocks [out_features, bytes per row], uint8
    block_types: dict[str, str] = {}
    for tensor in tqdm(tensors, desc=f"converting {src.name}", unit="tensor",
                       disable=not progress):
        hf_name = _hf_name(tensor.name, arch, table)
        weight, raw = _read_tensor(tensor, hf_name, arch, config)
        state[hf_name] = weight.to(dtype).contiguous()
        if raw is not None:
            blocks[hf_name] = raw.contiguous()
            block_types[hf_name] = tensor.tensor_type.name
    _check_complete(state, config, src, table)

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


def _read_tensor(tensor: Any, hf_name: str, arch: str,
                 config: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A tensor dequantized to float32 in HF's layout, and its raw blocks (same row order)
    when the CPU engine keeps them."""
    # gguf lists dims innermost first; numpy/torch want them outermost first.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    array = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    weight = torch.from_numpy(array.copy())  # [out_features, in_features]
    raw = None
    if tensor.tensor_type.name in KEPT_BLOCK_TYPES:
        raw = torch.from_numpy(tensor.data.reshape(shape[0], -1).copy())  # rows of blocks
    if arch == gguf_gemma3.ARCH:
        if gguf_gemma3.is_norm(hf_name):
            weight = weight - 1.0  # HF's convention: the model multiplies by (1 + w)
        return weight, raw  # llama.cpp keeps Gemma's q / k rows in HF's order
    if gguf_llama.FAMILIES[arch].permuted_qk and hf_name.endswith(("q_proj.weight",
                                                                   "k_proj.weight")):
        heads = config["num_attention_heads" if "q_proj" in hf_name else "num_key_value_heads"]
        weight = unpermute_qk(weight, heads)
        raw = None if raw is None else unpermute_qk(raw, heads)  # the same row order
    return weight, raw


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


def _layer_tensors(arch: str, config: dict[str, Any]) -> dict[str, str]:
    if arch == gguf_gemma3.ARCH:
        return gguf_gemma3.LAYER_TENSORS
    return gguf_llama.layer_tensors(arch, config["attention_bias"])


def _hf_name(gguf_name: str, arch: str, table: dict[str, str]) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.match(gguf_name)
    if match and match.group(2) in table:
        return f"model.layers.{match.group(1)}.{table[match.group(2)]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no {arch} equivalent")


def _check_complete(state: dict[str, torch.Tensor], config: dict[str, Any], src: Path,
                    table: dict[str, str]) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{name}" for i in range(config["num_hidden_layers"])
                 for name in table.values()}
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
