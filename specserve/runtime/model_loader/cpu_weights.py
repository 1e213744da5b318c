"""A model directory's linears packed for the CPU engine, in the chosen weight format.

`--weight-format auto` keeps what the checkpoint holds: a converted GGUF's own blocks (Q4_1 /
Q8_0 for the default model, read from `gguf_blocks.safetensors`, i.e. numerically the same
weights as its dequantized `model.safetensors`), or the float dtype of a Hugging Face checkpoint
(bf16 stays bf16). An explicit format converts every linear and the embedding: from float
weights, or from dequantized blocks (lossy when it quantizes; `f32` from blocks is exact).
Kept blocks may be any GGUF format the engine multiplies (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
Q5_K, Q6_K).

q/k/v and gate/up are fused per layer (gate and up tiles interleaved for the fused MLP
epilogue). A fused group whose parts differ in format (K-quant files mix them: Q5_0 q / k with
a Q8_0 v) is stored in one format that holds every part exactly (`packing.common_format`: Q8_0
for Q8_0 / Q5_0 / Q4_0, else f32).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from tqdm import tqdm

from specserve.kernels.cpu.packing import (
    FORMAT_NAMES,
    Blocks,
    Fmt,
    Packed,
    PackedModel,
    common_format,
    finish,
    float_bits,
    gguf_rows,
    interleave_bias,
    interleave_tiles,
    pad_bias,
    quantize,
    tile_major,
    to_q8_0,
)
from specserve.runtime.model_loader.config import ModelConfig
from specserve.runtime.model_loader.hf_dir import weight_files
from specserve.runtime.model_loader.shard import TpShard

logger = logging.getLogger(__name__)

BLOCKS_FILE = "gguf_blocks.safetensors"  # written by specserve/runtime/model_loader/gguf_convert.py
WEIGHT_FORMATS = ("auto", *FORMAT_NAMES)
_FLOAT_OF_DTYPE = {torch.float32: Fmt.F32, torch.bfloat16: Fmt.BF16, torch.float16: Fmt.F16}


class _Source:
    """Tensors of a model directory by HF name: raw GGUF blocks where kept, else float."""

    def __init__(self, model_dir: Path) -> None:
        self.files = {}
        for f in weight_files(model_dir):
            if f.suffix != ".safetensors":
                raise ValueError(f"{f}: the CPU engine reads safetensors checkpoints only")
            with safe_open(str(f), framework="pt") as r:
                for name in r.keys():
                    self.files[name] = f
        self.block_types: dict[str, str] = {}
        self.blocks_path = model_dir / BLOCKS_FILE
        if self.blocks_path.is_file():
            with safe_open(str(self.blocks_path), framework="pt") as r:
                self.block_types = json.loads(r.metadata()["types"])

    def has(self, name: str) -> bool:
        return name in self.files or ("model." + name) in self.files

    def float(self, name: str) -> torch.Tensor:
        key = name if name in self.files else "model." + name
        with safe_open(str(self.files[key]), framework="pt") as r:
            return r.get_tensor(key)

    def blocks(self, name: str) -> Blocks | None:
        key = name if name in self.block_types else "model." + name
        if key not in self.block_types:
            return None
        with safe_open(str(self.blocks_path), framework="pt") as r:
            raw = r.get_tensor(key).numpy()
        return gguf_rows(Fmt.parse(self.block_types[key]), raw)


@dataclass
class _Weight:
    """A weight in its source form (blocks or float) and the format it will be packed in."""

    fmt: Fmt
    blocks: Blocks | None = None
    dense: np.ndarray | None = None  # float32 [N, K]
    native: np.ndarray | None = None  # the checkpoint's own bf16 / f16 storage, when float
    native_fmt: Fmt | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape if self.blocks is not None else self.dense.shape

    def as_blocks(self) -> Blocks:
        if self.blocks is not None and self.blocks.fmt == self.fmt:
            return self.blocks
        if self.blocks is not None and self.fmt == Fmt.Q8_0 and common_format(
                {self.blocks.fmt, Fmt.Q8_0}, self.shape[1]) == Fmt.Q8_0:
            return to_q8_0(self.blocks)  # exact
        return quantize(self.fmt, self.as_float32())

    def as_float32(self) -> np.ndarray:
        if self.blocks is not None:
            return self.blocks.dequantize()
        return self.dense

    def storage(self) -> np.ndarray:
        if self.fmt == Fmt.F32:
            return self.as_float32()
        if self.native is not None and self.native_fmt == self.fmt:
            return self.native
        return float_bits(self.fmt, self.as_float32())


def _load(src: _Source, name: str, fmt_name: str) -> _Weight:
    blocks = src.blocks(name)
    if blocks is not None:
        fmt = blocks.fmt if fmt_name == "auto" else Fmt.parse(fmt_name)
        return _Weight(fmt, blocks=blocks)
    t = src.float(name)
    fmt = _FLOAT_OF_DTYPE.get(t.dtype, Fmt.F32) if fmt_name == "auto" else Fmt.parse(fmt_name)
    native = None
    if t.dtype == torch.bfloat16:
        native = t.view(torch.int16).numpy().view(np.uint16)
    elif t.dtype == torch.float16:
        native = t.numpy()
    return _Weight(fmt, dense=t.float().numpy(), native=native,
                   native_fmt=_FLOAT_OF_DTYPE.get(t.dtype))


def _rows(w: _Weight, begin: int, end: int) -> _Weight:
    """Rows [begin, end) (output features) of `w`."""
    if w.blocks is not None:
        return dataclasses.replace(w, blocks=w.blocks.rows(np.arange(begin, end)))
    return dataclasses.replace(w, dense=w.dense[begin:end],
                               native=None if w.native is None else w.native[begin:end])


def _cols(w: _Weight, begin: int, end: int) -> _Weight:
    """Columns [begin, end) (input features) of `w`, on block boundaries."""
    if w.blocks is not None:
        return dataclasses.replace(w, blocks=w.blocks.cols(begin, end))
    return dataclasses.replace(w, dense=np.ascontiguousarray(w.dense[:, begin:end]),
                               native=None if w.native is None
                               else np.ascontiguousarray(w.native[:, begin:end]))


def tp_shards(cfg: ModelConfig, world: int) -> list[TpShard]:
    """Every tensor-parallel rank's part of the model (specserve/runtime/model_loader/shard.py), its
    splits on the blocks of the checkpoint's formats (K-quant super-blocks hold 256 weights)."""
    types = set(_Source(Path(cfg.model_dir)).block_types.values())
    block = 256 if any(Fmt.parse(t).is_kquant for t in types) else 32
    return [TpShard.plan(cfg, r, world, block) for r in range(world)]


def _tile_major(parts: list[_Weight]) -> tuple[Fmt, np.ndarray]:
    """The parts (sharing K) concatenated along N, tile-major, in one format that holds each
    exactly (`common_format`)."""
    fmt = common_format({p.fmt for p in parts}, parts[0].shape[1])
    for p in parts[:-1]:
        assert p.shape[0] % 16 == 0, "fused parts must be whole tiles"
    tiles = []
    for p in parts:
        p = dataclasses.replace(p, fmt=fmt)
        tiles.append(tile_major(fmt, p.as_blocks() if fmt.is_block else p.storage()))
    return fmt, np.concatenate(tiles)


def _pack(parts: list[_Weight], bias: np.ndarray | None = None) -> Packed:
    """Pack weights that share K, concatenated along N (each part's N a multiple of 16)."""
    fmt, tiles = _tile_major(parts)
    n = sum(p.shape[0] for p in parts)
    b = None if bias is None else torch.from_numpy(pad_bias(bias))
    return Packed(fmt, parts[0].shape[1], n, torch.from_numpy(finish(fmt, tiles)), b)


def _pack_qkv(parts: list[_Weight], bias: np.ndarray | None) -> Packed | list[Packed]:
    """q / k / v fused when one format holds them exactly; else (a Q4_K_M file's Q4_K q / k
    beside a Q6_K v, which only f32 would hold) one part per run of equal formats, each
    multiplied in its own format: f32 would stream ~7x the bytes."""
    fmts = {p.fmt for p in parts}
    k = parts[0].shape[1]
    if common_format(fmts, k) != Fmt.F32 or not all(f.is_block for f in fmts) \
            or any(p.shape[0] % 16 for p in parts):
        return _pack(parts, bias)
    out, begin = [], 0
    while begin < len(parts):
        end = begin + 1
        while end < len(parts) and parts[end].fmt == parts[begin].fmt:
            end += 1
        lo = sum(p.shape[0] for p in parts[:begin])
        hi = lo + sum(p.shape[0] for p in parts[begin:end])
        out.append(_pack(parts[begin:end], None if bias is None else bias[lo:hi]))
        begin = end
    return out


def load_packed_model(cfg: ModelConfig, weight_format: str = "auto",
                      progress: bool = True, shard: TpShard | None = None) -> PackedModel:
    """Read and pack every weight of `cfg.model_dir` (see the module docstring); with a
    `shard`, only that tensor-parallel rank's part of each matrix."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"--weight-format must be one of {WEIGHT_FORMATS}, got {weight_format!r}")
    src = _Source(Path(cfg.model_dir))
    formats: dict[str, int] = {}

    def note(p: Packed) -> Packed:
        formats[p.fmt.name.lower()] = formats.get(p.fmt.name.lower(), 0) + 1
        return p

    layers, norms = [], []
    for i in tqdm(range(cfg.num_hidden_layers), desc="packing weights for the CPU engine",
                  unit="layer", disable=not progress):
        pre = f"layers.{i}."
        attn, mlp = pre + "self_attn.", pre + "mlp."
        qkv = [_load(src, attn + f"{p}_proj.weight", weight_format) for p in "qkv"]
        o = _load(src, attn + "o_proj.weight", weight_format)
        bias = None
        if cfg.attention_bias:
            bias = [src.float(attn + f"{p}_proj.bias").float().numpy() for p in "qkv"]
        gate = _load(src, mlp + "gate_proj.weight", weight_format)
        up = _load(src, mlp + "up_proj.weight", weight_format)
        down = _load(src, mlp + "down_proj.weight", weight_format)
        if shard is not None:
            d = cfg.head_dim
            heads = [shard.q_heads] + [shard.kv_heads] * 2
            qkv = [_rows(w, h0 * d, h1 * d) for w, (h0, h1) in zip(qkv, heads)]
            if bias is not None:
                bias = [b[h0 * d:h1 * d] for b, (h0, h1) in zip(bias, heads)]
            o = _cols(o, shard.q_heads[0] * d, shard.q_heads[1] * d)
            gate, up = (_rows(w, *shard.intermediate) for w in (gate, up))
            down = _cols(down, *shard.intermediate)
        if bias is not None:
            bias = np.concatenate(bias)
        both = common_format({gate.fmt, up.fmt}, gate.shape[1])  # mixed: one holding both
        gate, up = dataclasses.replace(gate, fmt=both), dataclasses.replace(up, fmt=both)
        (fmt_g, tg), (_, tu) = _tile_major([gate]), _tile_major([up])
        gate_up = Packed(fmt_g, gate.shape[1], 2 * gate.shape[0],
                         torch.from_numpy(finish(fmt_g, interleave_tiles(tg, tu))))
        gb, ub = (mlp + "gate_proj.bias", mlp + "up_proj.bias")
        if src.has(gb):
            gate_up.bias = torch.from_numpy(interleave_bias(src.float(gb).float().numpy(),
                                                            src.float(ub).float().numpy()))
        layers.append({
            "qkv": _note_all(note, _pack_qkv(qkv, bias)),
            "o": note(_pack([o])),
            "gate_up": note(gate_up),
            "down": note(_pack([down])),
        })
        norms.append(_layer_norms(src, cfg, pre))
    embed, lm_head = _head(src, cfg, weight_format, shard.vocab if shard else None)
    for p in {id(embed): embed, id(lm_head): lm_head}.values():
        note(p)
    final = _norm(src, cfg, "norm.weight")
    return PackedModel(layers, norms, embed, lm_head, final, formats)


def _note_all(note, packed: Packed | list[Packed]) -> Packed | list[Packed]:
    for p in packed if isinstance(packed, list) else [packed]:
        note(p)
    return packed


def load_packed_head(cfg: ModelConfig, weight_format: str = "auto") -> tuple[Packed, Packed]:
    """The whole embedding and LM head (one object when tied), packed: what a
    tensor-parallel leader's drafters read beside its vocabulary shard."""
    return _head(_Source(Path(cfg.model_dir)), cfg, weight_format, None)


def _head(src: _Source, cfg: ModelConfig, weight_format: str,
          vocab: tuple[int, int] | None) -> tuple[Packed, Packed]:
    def load(name: str) -> Packed:
        w = _load(src, name, weight_format)
        return _pack([w if vocab is None else _rows(w, *vocab)])

    embed = load("embed_tokens.weight")
    if cfg.tie_word_embeddings or not src.has("lm_head.weight"):
        return embed, embed
    return embed, load("lm_head.weight")


# the engine's norm slots -> HF names: before attention, before the MLP, and Gemma 3's norms of
# the attention and MLP outputs
_NORMS = {"in_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}
_GEMMA3_NORMS = {"in_norm": "input_layernorm", "post_norm": "pre_feedforward_layernorm",
                 "attn_out_norm": "post_attention_layernorm",
                 "mlp_out_norm": "post_feedforward_layernorm"}


def _norm(src: _Source, cfg: ModelConfig, name: str) -> torch.Tensor:
    """A norm's weight as the engine multiplies by it: Gemma's (1 + w), in float32 as HF."""
    w = src.float(name).float()
    return 1.0 + w if cfg.norm_plus_one else w


def _layer_norms(src: _Source, cfg: ModelConfig, pre: str) -> dict[str, torch.Tensor]:
    names = _GEMMA3_NORMS if cfg.sandwich_norms else _NORMS
    n = {slot: _norm(src, cfg, f"{pre}{name}.weight") for slot, name in names.items()}
    if cfg.qk_norm:
        for p in "qk":
            n[f"{p}_norm"] = _norm(src, cfg, f"{pre}self_attn.{p}_norm.weight")
    return n
