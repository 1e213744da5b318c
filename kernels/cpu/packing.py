"""Weight formats of the CPU engine and their tile layouts (see `csrc/kernels.h`).

A linear W[N, K] is stored as tiles of 16 output rows. Block formats keep GGUF's quantization
(32 weights per block, fp16 scale d, Q4_1 also an fp16 min m):

    Q8_0  w = d * q,       q int8        tile-block: 8 x 64 bytes (16 rows x 4 weights each)
    Q4_0  w = d * (q - 8), q in 0..15    tile-block: 4 x 64 bytes, low nibble = weights 0..15,
    Q4_1  w = d * q + m,   q in 0..15                high nibble = weights 16..31
    then 16 fp16 d (and 16 fp16 m for Q4_1) of the tile's rows.

Inside a 64-byte group, byte 4 * j + t is row j's weight 4 * g + t, so one int8 dot-product
instruction adds four products for each of 16 rows side by side. Block-format tiles are stored
in pairs with their blocks interleaved ([block 0 of tile 2p][block 0 of 2p+1][block 1 of 2p]...,
an odd last tile alone): a kernel multiplying a pair reads one sequential stream. Float formats
(F32, BF16, F16) are stored [K][16] per tile, tile after tile. Rows past N are zero padding.

Packing goes through a tile-major array (`tile_major`: [tiles, bytes per tile]), so fused
matrices (q/k/v, gate/up) are assembled tile by tile and laid out once (`finish`).

Everything here is numpy over whole tensors; `gguf_rows` reads GGUF's own block rows and
`quantize` makes them from float weights (the `--weight-format q8_0|q4_0|q4_1` conversions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import torch

NR = 16  # rows per tile
QK = 32  # weights per block


class Fmt(IntEnum):
    F32 = 0
    BF16 = 1
    F16 = 2
    Q8_0 = 3
    Q4_0 = 4
    Q4_1 = 5

    @property
    def is_block(self) -> bool:
        return self in (Fmt.Q8_0, Fmt.Q4_0, Fmt.Q4_1)

    @classmethod
    def parse(cls, name: str) -> Fmt:
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown weight format {name!r}; choose from "
                             f"{[f.name.lower() for f in cls]}") from None


FORMAT_NAMES = tuple(f.name.lower() for f in Fmt)  # f32 bf16 f16 q8_0 q4_0 q4_1

# GGUF block sizes in bytes (per 32 weights)
GGUF_BLOCK_BYTES = {Fmt.Q8_0: 34, Fmt.Q4_0: 18, Fmt.Q4_1: 20}
TILE_BLOCK_BYTES = {Fmt.Q8_0: 544, Fmt.Q4_0: 288, Fmt.Q4_1: 320}


def packed_bytes(fmt: Fmt, n: int, k: int) -> int:
    tiles = -(-n // NR)
    if fmt.is_block:
        return tiles * (k // QK) * TILE_BLOCK_BYTES[fmt]
    return tiles * k * NR * (4 if fmt == Fmt.F32 else 2)


class Blocks:
    """A block-format matrix as arrays: q [N, K] (int8 for Q8_0, uint8 0..15 for Q4), d and m
    [N, K/32] float16 (m only for Q4_1)."""

    def __init__(self, fmt: Fmt, q: np.ndarray, d: np.ndarray, m: np.ndarray | None = None):
        assert fmt.is_block, fmt
        assert q.ndim == 2 and q.shape[1] % QK == 0, q.shape
        assert d.shape == (q.shape[0], q.shape[1] // QK), (d.shape, q.shape)
        assert (m is not None) == (fmt == Fmt.Q4_1), "Q4_1 and only Q4_1 has mins"
        self.fmt, self.q, self.d, self.m = fmt, q, d.astype(np.float16), m

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def dequantize(self) -> np.ndarray:
        """float32 [N, K], the same float steps as gguf's dequantize."""
        n, k = self.q.shape
        d = self.d.astype(np.float32)[:, :, None]  # [N, nb, 1]
        q = self.q.reshape(n, k // QK, QK).astype(np.float32)
        if self.fmt == Fmt.Q8_0:
            w = d * q
        elif self.fmt == Fmt.Q4_0:
            w = d * (q - np.float32(8))
        else:
            w = d * q + self.m.astype(np.float32)[:, :, None]
        return w.reshape(n, k)

    def rows(self, index: np.ndarray) -> Blocks:
        return Blocks(self.fmt, self.q[index], self.d[index],
                      None if self.m is None else self.m[index])


def gguf_rows(fmt: Fmt, raw: np.ndarray) -> Blocks:
    """Blocks from GGUF's raw rows [N, K/32 * block bytes] uint8 (llama.cpp's block structs)."""
    n = raw.shape[0]
    bb = GGUF_BLOCK_BYTES[fmt]
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1, bb)  # [N, nb, bb]
    d = b[:, :, 0:2].copy().view(np.float16)[:, :, 0]
    if fmt == Fmt.Q8_0:
        q = b[:, :, 2:34].copy().view(np.int8).reshape(n, -1)
        return Blocks(fmt, q, d)
    m = None
    if fmt == Fmt.Q4_1:
        m = b[:, :, 2:4].copy().view(np.float16)[:, :, 0]
    qs = b[:, :, bb - 16:]  # [N, nb, 16]: low nibble weight i, high nibble weight i + 16
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, -1)
    return Blocks(fmt, q, d, m)


def quantize(fmt: Fmt, w: np.ndarray) -> Blocks:
    """Round float weights [N, K] to a block format (ggml's reference quantizers' rules)."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    if k % QK:
        raise ValueError(f"block formats need in_features % 32 == 0, got {k}")
    x = w.reshape(n, k // QK, QK)
    if fmt == Fmt.Q8_0:
        amax = np.abs(x).max(axis=2)
        d = (amax / 127).astype(np.float16)
        inv = np.divide(1, d.astype(np.float32), out=np.zeros_like(amax), where=d != 0)
        q = np.clip(np.rint(x * inv[:, :, None]), -127, 127).astype(np.int8)
        return Blocks(fmt, q.reshape(n, k), d)
    if fmt == Fmt.Q4_0:
        # the value of largest magnitude maps to -8 (ggml): d = max / -8
        idx = np.abs(x).argmax(axis=2)
        mx = np.take_along_axis(x, idx[:, :, None], axis=2)[:, :, 0]
        d = (mx / -8).astype(np.float16)
        inv = np.divide(1, d.astype(np.float32), out=np.zeros_like(mx), where=d != 0)
        q = np.clip(np.floor(x * inv[:, :, None] + 8.5), 0, 15).astype(np.uint8)
        return Blocks(fmt, q.reshape(n, k), d)
    if fmt == Fmt.Q4_1:
        lo, hi = x.min(axis=2), x.max(axis=2)
        d = ((hi - lo) / 15).astype(np.float16)
        inv = np.divide(1, d.astype(np.float32), out=np.zeros_like(lo), where=d != 0)
        m = lo.astype(np.float16)
        q = np.clip(np.floor((x - m.astype(np.float32)[:, :, None]) * inv[:, :, None] + 0.5),
                    0, 15).astype(np.uint8)
        return Blocks(fmt, q.reshape(n, k), d, m)
    raise ValueError(f"{fmt.name} is not a block format")


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    if a.shape[0] == rows:
        return a
    pad = np.zeros((rows - a.shape[0],) + a.shape[1:], dtype=a.dtype)
    return np.concatenate([a, pad])


def tile_major_blocks(b: Blocks) -> np.ndarray:
    """A block-format matrix tile by tile: uint8 [tiles, K/32 * tile-block bytes]."""
    n, k = b.shape
    tiles, nb = -(-n // NR), k // QK
    q = _pad_rows(b.q, tiles * NR).view(np.uint8)
    d = _pad_rows(b.d, tiles * NR).reshape(tiles, NR, nb).transpose(0, 2, 1)  # [T, nb, 16]
    parts = []
    if b.fmt == Fmt.Q8_0:
        # [T, 16 rows, nb, 8 groups, 4] -> [T, nb, group, row, 4]
        g = q.reshape(tiles, NR, nb, 8, 4).transpose(0, 2, 3, 1, 4)
        parts.append(g.reshape(tiles, nb, 512))
    else:
        # k = 16 h + 4 c + t -> [T, nb, c, row, t, h]; byte = low nibble (h=0) | high (h=1)
        g = q.reshape(tiles, NR, nb, 2, 4, 4).transpose(0, 2, 4, 1, 5, 3)
        parts.append((g[..., 0] | (g[..., 1] << 4)).reshape(tiles, nb, 256))
    parts.append(np.ascontiguousarray(d).view(np.uint8).reshape(tiles, nb, 32))
    if b.fmt == Fmt.Q4_1:
        m = _pad_rows(b.m, tiles * NR).reshape(tiles, NR, nb).transpose(0, 2, 1)
        parts.append(np.ascontiguousarray(m).view(np.uint8).reshape(tiles, nb, 32))
    return np.concatenate(parts, axis=2).reshape(tiles, -1)


def tile_major_float(fmt: Fmt, storage: np.ndarray) -> np.ndarray:
    """Float weights (already in the format's storage dtype) tile by tile: [tiles, K*16*size]."""
    n, k = storage.shape
    tiles = -(-n // NR)
    t = _pad_rows(storage, tiles * NR).reshape(tiles, NR, k).transpose(0, 2, 1)
    return np.ascontiguousarray(t).view(np.uint8).reshape(tiles, -1)


def tile_major(fmt: Fmt, w) -> np.ndarray:
    """`w` is `Blocks` for block formats, the storage array for float formats."""
    return tile_major_blocks(w) if fmt.is_block else tile_major_float(fmt, w)


def finish(fmt: Fmt, tiles: np.ndarray) -> np.ndarray:
    """The stored layout from a tile-major array: block formats pair-interleaved."""
    if not fmt.is_block:
        return np.ascontiguousarray(tiles).reshape(-1)
    n = tiles.shape[0]
    pairs = n // 2
    tbb = TILE_BLOCK_BYTES[fmt]
    kb = tiles.shape[1] // tbb  # K blocks per tile (explicit: pairs may be 0)
    head = tiles[: 2 * pairs].reshape(pairs, 2, kb, tbb).transpose(0, 2, 1, 3)
    return np.concatenate([np.ascontiguousarray(head).reshape(-1),
                           tiles[2 * pairs:].reshape(-1)])


def pack_blocks(b: Blocks) -> np.ndarray:
    """Stored layout of a block-format matrix: uint8 [tiles * K/32 * tile-block bytes]."""
    return finish(b.fmt, tile_major_blocks(b))


def float_bits(fmt: Fmt, w: np.ndarray) -> np.ndarray:
    """Float weights [N, K] as the format's storage (float32, float16 or bf16 bits as uint16).
    Converting float32 to bf16 rounds to nearest even."""
    w = np.asarray(w, dtype=np.float32)
    if fmt == Fmt.F32:
        return w
    if fmt == Fmt.F16:
        return w.astype(np.float16)
    if fmt == Fmt.BF16:
        bits = w.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nan = np.isnan(w)
        out = rounded.astype(np.uint16)
        out[nan] = 0x7FC0
        return out
    raise ValueError(f"{fmt.name} is not a float format")


def pack_float(fmt: Fmt, storage: np.ndarray) -> np.ndarray:
    """Stored layout [tiles][K][16] of weights already in the format's storage dtype."""
    return finish(fmt, tile_major_float(fmt, storage))


def interleave_tiles(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Tile-major gate and up (same shape) as alternating tiles: gate 0, up 0, gate 1, up 1,
    ... (the fused silu(gate) * up epilogue reads a pair at a time). Tile-major in and out."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return np.stack([a, b], axis=1).reshape(2 * a.shape[0], -1)


def interleave_bias(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    tiles = -(-gate.size // NR)
    g = _pad_rows(gate.astype(np.float32), tiles * NR).reshape(tiles, NR)
    u = _pad_rows(up.astype(np.float32), tiles * NR).reshape(tiles, NR)
    return np.stack([g, u], axis=1).reshape(-1)


def pad_bias(bias: np.ndarray) -> np.ndarray:
    tiles = -(-bias.size // NR)
    return _pad_rows(bias.astype(np.float32), tiles * NR)


@dataclass
class Packed:
    """One packed linear: what `ext.PackedLinear(fmt, K, N, data, bias)` takes."""

    fmt: Fmt
    k: int
    n: int
    data: torch.Tensor  # uint8
    bias: torch.Tensor | None = None

    def to_ext(self, ext):
        return ext.PackedLinear(int(self.fmt), self.k, self.n, self.data, self.bias)


@dataclass
class PackedModel:
    layers: list[dict[str, Packed]]  # qkv, o, gate_up, down
    norms: list[dict[str, torch.Tensor]]  # in_norm, post_norm (+ q_norm, k_norm)
    embed: Packed
    lm_head: Packed  # the same object as embed when tied
    final_norm: torch.Tensor
    formats: dict[str, int] = field(default_factory=dict)  # format name -> linears

    @property
    def nbytes(self) -> int:
        seen, total = set(), 0
        for p in [self.embed, self.lm_head] + [p for layer in self.layers for p in layer.values()]:
            if id(p) not in seen:
                seen.add(id(p))
                total += p.data.numel()
        return total
