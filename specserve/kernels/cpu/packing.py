"""Weight formats of the CPU engine and their tile layouts (see `csrc/kernels.h`).

A linear W[N, K] is stored as tiles of 16 output rows. Block formats keep GGUF's quantization:
the integers q of each weight and its block's scales, laid out so one int8 dot-product
instruction adds four products for each of 16 rows side by side (inside a 64-byte group, byte
4 * j + t is row j's weight 4 * g + t):

    Q8_0  w = d * q,             q int8     blocks of 32, fp16 d
    Q4_0  w = d * (q - 8),       q 0..15    blocks of 32, fp16 d
    Q4_1  w = d * q + m,         q 0..15    blocks of 32, fp16 d, m
    Q5_0  w = d * (q - 16),      q 0..31    blocks of 32, fp16 d
    Q5_1  w = d * q + m,         q 0..31    blocks of 32, fp16 d, m
    Q4_K  w = d*sc * q - dmin*mn, q 0..15   super-blocks of 256 (fp16 d, dmin), 6-bit sc and
    Q5_K  w = d*sc * q - dmin*mn, q 0..31     mn per 32
    Q6_K  w = d*sc * (q - 32),   q 0..63    super-blocks of 256 (fp16 d), int8 sc per 16

A 32-weight sub-block of 16 rows is 4 x 64 bytes of nibbles (low nibbles weights 0..15, high
16..31), then for 5-bit formats a 64-byte plane of bit 4 (bit g of byte 4 * j + t: weight
4 * g + t) and for Q6_K two planes of bits 4-5 (two bits per group, plane p for weights
16 p .. 16 p + 15); Q8_0 is 8 x 64 bytes of int8. A tile-block (one block of 16 rows; for
K-quants a whole super-block, its 8 sub-blocks one after another) ends with the fp16 scales of
its rows (K-quants: the 6-bit or int8 sub-block scales as bytes, then d and dmin). Block-format
tiles are stored in pairs with their blocks interleaved ([block 0 of tile 2p][block 0 of
2p+1][block 1 of 2p]..., an odd last tile alone): a kernel multiplying a pair reads one
sequential stream. Float formats (F32, BF16, F16) are stored [K][16] per tile, tile after
tile. Rows past N are zero padding.

Packing goes through a tile-major array (`tile_major`: [tiles, bytes per tile]), so fused
matrices (q/k/v, gate/up) are assembled tile by tile and laid out once (`finish`).

Everything here is numpy over whole tensors; `gguf_rows` reads GGUF's own block rows (every
format above) and `quantize` makes blocks from float weights (the `--weight-format
q8_0|q4_0|q4_1|q5_0|q5_1` conversions; K-quants are only ever kept from a GGUF file).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import torch

NR = 16  # rows per tile
QK = 32  # weights per block (per sub-block of a K-quant)
QKK = 256  # weights per K-quant super-block


class Fmt(IntEnum):
    F32 = 0
    BF16 = 1
    F16 = 2
    Q8_0 = 3
    Q4_0 = 4
    Q4_1 = 5
    Q5_0 = 6
    Q5_1 = 7
    Q4_K = 8
    Q5_K = 9
    Q6_K = 10

    @property
    def is_block(self) -> bool:
        return self >= Fmt.Q8_0

    @property
    def is_kquant(self) -> bool:
        return self in (Fmt.Q4_K, Fmt.Q5_K, Fmt.Q6_K)

    @property
    def block_weights(self) -> int:
        """Weights along K of one tile-block: a K-quant super-block, else one block."""
        return QKK if self.is_kquant else QK

    @classmethod
    def parse(cls, name: str) -> Fmt:
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown weight format {name!r}; choose from "
                             f"{[f.name.lower() for f in cls]}") from None


# formats a float weight converts to (`--weight-format`); K-quants are kept from GGUF files only
FORMAT_NAMES = tuple(f.name.lower() for f in Fmt if not f.is_kquant)

# GGUF block sizes in bytes (per 32 weights; K-quants per 256)
GGUF_BLOCK_BYTES = {Fmt.Q8_0: 34, Fmt.Q4_0: 18, Fmt.Q4_1: 20, Fmt.Q5_0: 22, Fmt.Q5_1: 24,
                    Fmt.Q4_K: 144, Fmt.Q5_K: 176, Fmt.Q6_K: 210}
# bytes of one sub-block's integers (16 rows x 32 weights) and of one tile-block
SUB_BLOCK_BYTES = {Fmt.Q8_0: 512, Fmt.Q4_0: 256, Fmt.Q4_1: 256, Fmt.Q5_0: 320, Fmt.Q5_1: 320,
                   Fmt.Q4_K: 256, Fmt.Q5_K: 320, Fmt.Q6_K: 384}
TILE_BLOCK_BYTES = {Fmt.Q8_0: 544, Fmt.Q4_0: 288, Fmt.Q4_1: 320, Fmt.Q5_0: 352, Fmt.Q5_1: 384,
                    Fmt.Q4_K: 2368, Fmt.Q5_K: 2880, Fmt.Q6_K: 3360}


def packed_bytes(fmt: Fmt, n: int, k: int) -> int:
    tiles = -(-n // NR)
    if fmt.is_block:
        return tiles * (k // fmt.block_weights) * TILE_BLOCK_BYTES[fmt]
    return tiles * k * NR * (4 if fmt == Fmt.F32 else 2)


def _f32(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float32)


class Blocks:
    """A block-format matrix as arrays: q [N, K] (int8 for Q8_0, else the unsigned integers),
    d [N, K/32] float16 (K-quants: [N, K/256]), m [N, K/32] float16 for Q4_1 / Q5_1 (K-quants:
    dmin [N, K/256]), and for K-quants sc (uint8 [N, K/32]; Q6_K int8 [N, K/16]) and mn (uint8
    [N, K/32], Q4_K / Q5_K)."""

    def __init__(self, fmt: Fmt, q: np.ndarray, d: np.ndarray, m: np.ndarray | None = None,
                 sc: np.ndarray | None = None, mn: np.ndarray | None = None):
        assert fmt.is_block, fmt
        n, k = q.shape
        assert q.ndim == 2 and k % fmt.block_weights == 0, (fmt, q.shape)
        assert d.shape == (n, k // fmt.block_weights), (d.shape, q.shape)
        has_min = fmt in (Fmt.Q4_1, Fmt.Q5_1, Fmt.Q4_K, Fmt.Q5_K)
        assert (m is not None) == has_min, f"{fmt.name}: mins {'needed' if has_min else 'unused'}"
        assert (sc is not None) == fmt.is_kquant, "K-quants and only K-quants have sub-scales"
        self.fmt, self.q, self.d, self.m = fmt, q, d.astype(np.float16), m
        self.sc, self.mn = sc, mn

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    def dequantize(self) -> np.ndarray:
        """float32 [N, K], the same float steps as gguf's dequantize."""
        n, k = self.q.shape
        if self.fmt.is_kquant:
            return self._dequantize_kquant()
        d = _f32(self.d)[:, :, None]  # [N, nb, 1]
        q = self.q.reshape(n, k // QK, QK).astype(np.float32)
        if self.fmt == Fmt.Q8_0:
            w = d * q
        elif self.fmt in (Fmt.Q4_0, Fmt.Q5_0):
            w = d * (q - np.float32(8 if self.fmt == Fmt.Q4_0 else 16))
        else:
            w = d * q + _f32(self.m)[:, :, None]
        return w.reshape(n, k)

    def _dequantize_kquant(self) -> np.ndarray:
        n, k = self.q.shape
        per = 16 if self.fmt == Fmt.Q6_K else QK  # weights per sub-scale
        d = np.repeat(_f32(self.d), QKK // per, axis=1)  # [N, K/per]
        scale = (d * _f32(self.sc))[:, :, None]
        q = self.q.reshape(n, k // per, per).astype(np.float32)
        if self.fmt == Fmt.Q6_K:
            return (scale * (q - np.float32(32))).reshape(n, k)
        mins = (np.repeat(_f32(self.m), QKK // QK, axis=1) * _f32(self.mn))[:, :, None]
        return (scale * q - mins).reshape(n, k)

    def rows(self, index: np.ndarray) -> Blocks:
        def pick(a):
            return None if a is None else a[index]

        return Blocks(self.fmt, self.q[index], self.d[index], pick(self.m), pick(self.sc),
                      pick(self.mn))

    def cols(self, begin: int, end: int) -> Blocks:
        """Weights [begin, end) of every row; both on block boundaries (super-blocks for
        K-quants)."""
        bw = self.fmt.block_weights
        assert begin % bw == 0 and end % bw == 0, (self.fmt, begin, end)

        def part(a, per):
            return None if a is None else a[:, begin // per:end // per]

        sub = 16 if self.fmt == Fmt.Q6_K else QK  # weights per sub-scale
        return Blocks(self.fmt, self.q[:, begin:end], self.d[:, begin // bw:end // bw],
                      part(self.m, bw), part(self.sc, sub), part(self.mn, QK))


def _half(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block row: [N, nb] float16."""
    return b[:, :, at:at + 2].copy().view(np.float16)[:, :, 0]


def _bits(b: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bits of bytes [..., nbytes] -> [..., 8 * nbytes] uint8 (bit i of byte j is
    element 8 j + i)."""
    return np.unpackbits(b, axis=-1, bitorder="little")[..., :count]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 16 bytes -> 32 weights: low nibble weight i, high nibble weight i + 16."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _kquant_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 packed bytes [..., 12] -> 6-bit scales and mins [..., 8] each."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def gguf_rows(fmt: Fmt, raw: np.ndarray) -> Blocks:
    """Blocks from GGUF's raw rows [N, K / block * block bytes] uint8 (llama.cpp's block
    structs, see gguf's quants.py)."""
    n = raw.shape[0]
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1, GGUF_BLOCK_BYTES[fmt])
    if fmt.is_kquant:
        return _gguf_kquant_rows(fmt, b)
    d = _half(b, 0)
    if fmt == Fmt.Q8_0:
        return Blocks(fmt, b[:, :, 2:34].copy().view(np.int8).reshape(n, -1), d)
    m = _half(b, 2) if fmt in (Fmt.Q4_1, Fmt.Q5_1) else None
    q = _nibbles(b[:, :, -16:])  # [N, nb, 32]
    if fmt in (Fmt.Q5_0, Fmt.Q5_1):
        at = 4 if fmt == Fmt.Q5_1 else 2  # after d (and m)
        q = q | (_bits(b[:, :, at:at + 4], 32) << 4)
    return Blocks(fmt, q.reshape(n, -1), d, m)


def _gguf_kquant_rows(fmt: Fmt, b: np.ndarray) -> Blocks:
    n, nsb = b.shape[:2]
    if fmt == Fmt.Q6_K:
        ql, qh = b[:, :, :128].reshape(n, nsb, 2, 64), b[:, :, 128:192].reshape(n, nsb, 2, 32)
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)  # [.., half, 128]
        high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
        q = (low | (high << 4)).reshape(n, -1)
        sc = b[:, :, 192:208].copy().view(np.int8).reshape(n, -1)
        return Blocks(fmt, q, _half(b, 208), sc=sc)
    d, dmin = _half(b, 0), _half(b, 2)
    sc, mn = _kquant_scale_min(b[:, :, 4:16])
    qs = b[:, :, -128:].reshape(n, nsb, 4, 32)  # 64 weights per 32 bytes: sub-blocks 2c, 2c+1
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, nsb, 8, 32)
    if fmt == Fmt.Q5_K:  # bit i of byte k of qh: weight k of sub-block i
        hb = np.unpackbits(b[:, :, 16:48, None], axis=-1, bitorder="little")  # [.., k, i]
        q = q | (hb.transpose(0, 1, 3, 2) << 4)
    return Blocks(fmt, q.reshape(n, -1), d, dmin, sc.reshape(n, -1), mn.reshape(n, -1))


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
    if fmt in (Fmt.Q5_0, Fmt.Q5_1):
        return _quantize_q5(fmt, x)
    raise ValueError(f"{fmt.name} is not a format float weights convert to "
                     f"(choose from {FORMAT_NAMES})")


def _quantize_q5(fmt: Fmt, x: np.ndarray) -> Blocks:
    """Q5_0 / Q5_1 as gguf's quantize (ggml's reference): the reciprocal of the float32 scale."""
    n, nb, _ = x.shape
    if fmt == Fmt.Q5_0:
        idx = np.abs(x).argmax(axis=2)
        d = np.take_along_axis(x, idx[:, :, None], axis=2)[:, :, 0] / np.float32(-16)
        inv = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
        q = np.trunc(x * inv[:, :, None] + np.float32(16.5))
        return Blocks(fmt, np.clip(q, 0, 31).astype(np.uint8).reshape(n, -1), d)
    lo, hi = x.min(axis=2), x.max(axis=2)
    d = (hi - lo) / np.float32(31)
    inv = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
    q = np.trunc((x - lo[:, :, None]) * inv[:, :, None] + np.float32(0.5))
    return Blocks(fmt, np.clip(q, 0, 31).astype(np.uint8).reshape(n, -1), d,
                  lo.astype(np.float16))


# Block formats whose weights are d * (q - offset) with one fp16 d per 32: Q8_0 holds them
# exactly (the same d, q - offset as int8), so matrices fused with Q8_0 ones go to Q8_0
_SYMMETRIC_OFFSETS = {Fmt.Q8_0: 0, Fmt.Q4_0: 8, Fmt.Q5_0: 16}


def common_format(fmts: set[Fmt], k: int) -> Fmt:
    """The format that fused matrices of formats `fmts` (sharing K = k) are packed in: their own
    when they agree, Q8_0 for a mix of Q8_0 / Q5_0 / Q4_0 (exact, `to_q8_0`), else f32 (exact);
    f32 too for a block format K does not fit."""
    fmt = next(iter(fmts)) if len(fmts) == 1 else Fmt.F32
    if len(fmts) > 1 and fmts <= set(_SYMMETRIC_OFFSETS):
        fmt = Fmt.Q8_0
    if fmt.is_block and k % fmt.block_weights:
        fmt = Fmt.F32
    return fmt


def to_q8_0(b: Blocks) -> Blocks:
    """Q4_0 / Q5_0 blocks as Q8_0 ones with the same weights (the same d, q - offset)."""
    off = _SYMMETRIC_OFFSETS[b.fmt]
    q = b.q if b.fmt == Fmt.Q8_0 else (b.q.astype(np.int16) - off).astype(np.int8)
    return Blocks(Fmt.Q8_0, q, b.d)


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    if a.shape[0] == rows:
        return a
    pad = np.zeros((rows - a.shape[0],) + a.shape[1:], dtype=a.dtype)
    return np.concatenate([a, pad])


def _tile_rows(a: np.ndarray, tiles: int) -> np.ndarray:
    """[N, ...] -> [tiles, 16, ...], rows past N zero."""
    return _pad_rows(a, tiles * NR).reshape(tiles, NR, *a.shape[1:])


def _sub_block_integers(fmt: Fmt, q: np.ndarray) -> np.ndarray:
    """q [T, 16, nb, 32] -> each sub-block's integer bytes [T, nb, SUB_BLOCK_BYTES]."""
    t, _, nb, _ = q.shape
    if fmt == Fmt.Q8_0:
        # [T, 16 rows, nb, 8 groups, 4] -> [T, nb, group, row, 4]
        return q.reshape(t, NR, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(t, nb, 512)
    # k = 16 h + 4 c + t -> [T, nb, c, row, t, h]; byte = low nibble (h=0) | high (h=1)
    g = (q & 0x0F).reshape(t, NR, nb, 2, 4, 4).transpose(0, 2, 4, 1, 5, 3)
    parts = [(g[..., 0] | (g[..., 1] << 4)).reshape(t, nb, 256)]
    if fmt in (Fmt.Q5_0, Fmt.Q5_1, Fmt.Q5_K):  # k = 4 g + t: bit g of byte (row, t)
        h = ((q >> 4) & 1).reshape(t, NR, nb, 8, 4).transpose(0, 2, 1, 4, 3)
        parts.append((h << np.arange(8, dtype=np.uint8)).sum(-1, dtype=np.uint8).reshape(t, nb, 64))
    if fmt == Fmt.Q6_K:  # k = 16 p + 4 s + t: bits 2 s, 2 s + 1 of plane p's byte (row, t)
        h = ((q >> 4) & 3).reshape(t, NR, nb, 2, 4, 4).transpose(0, 2, 3, 1, 5, 4)
        shifts = np.arange(0, 8, 2, dtype=np.uint8)
        parts.append((h << shifts).sum(-1, dtype=np.uint8).reshape(t, nb, 128))
    return np.concatenate(parts, axis=2)


def _scales_by_tile(a: np.ndarray, tiles: int, groups: int) -> np.ndarray:
    """Per-row scales [N, blocks * groups] -> [T, blocks, groups * 16 * itemsize] bytes, each
    group's 16 rows side by side."""
    t = _tile_rows(a, tiles)  # [T, 16, blocks * groups]
    t = t.reshape(tiles, NR, -1, groups).transpose(0, 2, 3, 1)  # [T, blocks, groups, 16]
    return np.ascontiguousarray(t).view(np.uint8).reshape(tiles, t.shape[1], -1)


def tile_major_blocks(b: Blocks) -> np.ndarray:
    """A block-format matrix tile by tile: uint8 [tiles, K/block * tile-block bytes]."""
    n, k = b.shape
    tiles, nb = -(-n // NR), k // QK
    q = _tile_rows(b.q.view(np.uint8), tiles).reshape(tiles, NR, nb, QK)
    ints = _sub_block_integers(b.fmt, q)  # [T, nb, sub-block bytes]
    if b.fmt.is_kquant:
        nsb = k // QKK
        parts = [ints.reshape(tiles, nsb, -1)]
        if b.fmt == Fmt.Q6_K:
            parts.append(_scales_by_tile(b.sc.view(np.uint8), tiles, 16))
        else:
            parts += [_scales_by_tile(b.sc, tiles, 8), _scales_by_tile(b.mn, tiles, 8)]
        parts.append(_scales_by_tile(b.d, tiles, 1))
        if b.m is not None:
            parts.append(_scales_by_tile(b.m, tiles, 1))
        return np.concatenate(parts, axis=2).reshape(tiles, -1)
    parts = [ints, _scales_by_tile(b.d, tiles, 1)]
    if b.m is not None:
        parts.append(_scales_by_tile(b.m, tiles, 1))
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
    # qkv (a list of parts where q / k / v formats differ, see cpu_weights), o, gate_up, down
    layers: list[dict[str, Packed | list[Packed]]]
    norms: list[dict[str, torch.Tensor]]  # in_norm, post_norm (+ q_norm, k_norm)
    embed: Packed
    lm_head: Packed  # the same object as embed when tied
    final_norm: torch.Tensor
    formats: dict[str, int] = field(default_factory=dict)  # format name -> linears

    @property
    def nbytes(self) -> int:
        seen, total = set(), 0
        parts = [p for layer in self.layers for v in layer.values()
                 for p in (v if isinstance(v, list) else [v])]
        for p in [self.embed, self.lm_head] + parts:
            if id(p) not in seen:
                seen.add(id(p))
                total += p.data.numel()
        return total
