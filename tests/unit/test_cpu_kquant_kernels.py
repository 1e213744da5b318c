"""The CPU engine's 5- and 6-bit and K-quant block formats (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), kept
as GGUF stores them: blocks built in code unpack to exactly what the `gguf` package dequantizes;
every kernel table equals float64 (the gguf package's dequantization times the activations)
within a stated tolerance, every table gives the scalar kernel's bits, and a row's output is
bit-identical for every M (1..64 and a 256-row prefill chunk) and thread count."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from specserve.kernels import cpu
from specserve.kernels.cpu.packing import (
    Fmt,
    finish,
    gguf_rows,
    interleave_tiles,
    pack_blocks,
    quantize,
)
from specserve.kernels.cpu.packing import tile_major as tile_major_of
from tests.helpers.tiny_models import gguf_blocks
from tests.unit.test_cpu_kernels import (
    DIGIT_TOL,
    EPI_ADD,
    EPI_SILU_MUL,
    EPI_STORE,
    KERNEL_TOL,
    ext,
    isas,
    quantized_activations,
)

OK, WHY = cpu.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"CPU extension unavailable: {WHY}")
FORMATS = (Fmt.Q5_0, Fmt.Q5_1, Fmt.Q4_K, Fmt.Q5_K, Fmt.Q6_K)


def gguf_raw(fmt: Fmt, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF rows [n, bytes] of a random matrix: Q5_0 / Q5_1 quantized by the gguf package,
    K-quants random blocks (tests/helpers/tiny_models.py)."""
    w = (np.random.default_rng(seed).standard_normal((n, k)) * 0.1).astype(np.float32)
    return gguf_blocks(w, fmt.name, seed)


def dequantized(fmt: Fmt, raw: np.ndarray, k: int) -> np.ndarray:
    # float64 whatever the gguf version returns (some give float32 for the legacy formats)
    out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt.name])
    return out.astype(np.float64).reshape(-1, k)


def make_linear(fmt: Fmt, n: int, k: int, seed: int = 0, bias: torch.Tensor | None = None):
    """(packed linear, the gguf package's dequantization as float64 [n, k])."""
    raw = gguf_raw(fmt, n, k, seed)
    data = torch.from_numpy(pack_blocks(gguf_rows(fmt, raw)))
    args = (data,) if bias is None else (data, bias)
    return ext().PackedLinear(int(fmt), k, n, *args), torch.from_numpy(dequantized(fmt, raw, k))


def shape_of(fmt: Fmt) -> tuple[int, int]:
    """N with a tile pair, a lone tile and a partial one; K of two super-blocks (or 8 blocks)."""
    return 37, 512 if fmt.is_kquant else 256


def extreme_rows(k: int) -> torch.Tensor:
    """Two rows at the digits' extremes: block maxima just under 127 (first digits up to +-127,
    halves everywhere below, so later digits reach +-64), one the other's negation."""
    half = torch.arange(k, dtype=torch.float32) % 120 + 0.5 + 0.5 / 128
    x = torch.where(torch.arange(k) % 2 == 0, half, -half)
    x[::32] = 126.99
    return torch.stack([x, -x])


@pytest.mark.parametrize("fmt", FORMATS)
def test_gguf_blocks_unpack_and_pack_to_the_values_gguf_dequantizes(fmt):
    n, k = 40, 512
    raw = gguf_raw(fmt, n, k, seed=1)
    expected = dequantized(fmt, raw, k)
    blocks = gguf_rows(fmt, raw)
    assert np.array_equal(blocks.dequantize(), expected)
    lin = ext().PackedLinear(int(fmt), k, n, torch.from_numpy(pack_blocks(blocks)))
    assert np.array_equal(lin.dense().numpy(), expected)  # embedding lookups read the same


@pytest.mark.parametrize("fmt", [Fmt.Q5_0, Fmt.Q5_1])
def test_q5_quantization_is_ggmls(fmt):
    w = (np.random.default_rng(2).standard_normal((24, 128)) * 0.3).astype(np.float32)
    ours = quantize(fmt, w)
    theirs = gguf_rows(fmt, gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt.name]))
    assert np.array_equal(ours.q, theirs.q) and np.array_equal(ours.d, theirs.d)
    assert ours.m is None or np.array_equal(ours.m, theirs.m)


def test_kquants_need_whole_super_blocks():
    with pytest.raises(RuntimeError, match="% 256"):
        ext().PackedLinear(int(Fmt.Q4_K), 128, 16, torch.zeros(10, dtype=torch.uint8))


@pytest.mark.parametrize("isa", ["amx", "avx512", "avx2", "generic"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("digits", [1, 2, 3])
def test_linear_equals_float64_reference(isa, fmt, digits):
    if isa not in isas():
        pytest.skip(f"this CPU has no {isa}")
    n, k = shape_of(fmt)
    lin, w = make_linear(fmt, n, k, seed=digits)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2))
    y = ext().linear(lin, x, levels=digits, nthreads=2, isa=isa).double()
    ref = quantized_activations(x, digits) @ w.T
    scale = ref.abs().max()
    assert (y - ref).abs().max() <= KERNEL_TOL * scale
    assert (y - x.double() @ w.T).abs().max() <= DIGIT_TOL[digits] * scale


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("digits", [1, 2, 3])
def test_every_table_gives_the_scalar_kernels_bits(fmt, digits):
    """The AVX2 (int16 pair sums widened in time), AVX-512 (vpdpbusd) and AMX (the AVX-512
    kernel for these formats) tables compute the scalar kernel's integers and float steps:
    the same bits, for activations over many octaves and rows at the digits' extremes, row
    counts on both sides of every row grouping, with bias and the fused residual add."""
    n, k = 70, 512 if fmt.is_kquant else 576  # 5 tiles: two pairs and a lone one
    lin, _ = make_linear(fmt, n, k, seed=digits)
    bias = torch.randn(80, generator=torch.Generator().manual_seed(9))  # padded to the tiles
    with_bias, _ = make_linear(fmt, n, k, seed=digits + 3, bias=bias)
    g = torch.Generator().manual_seed(digits)
    x = torch.randn(40, k, generator=g) * torch.exp(3 * torch.randn(40, k, generator=g))
    x[33:35] = extreme_rows(k)
    for m in (1, 2, 3, 5, 8, 9, 13, 32, 35, 40):
        rows = x[40 - m:]  # every call of more than six rows holds the extreme rows
        for packed in (lin, with_bias):
            for epi in (EPI_STORE, EPI_ADD):
                y0 = torch.randn(m, n)
                out = {isa: ext().linear(packed, rows, levels=digits, nthreads=2, isa=isa,
                                         epilogue=epi, y=y0.clone() if epi else None)
                       for isa in isas()}
                for isa, y in out.items():
                    assert torch.equal(y, out["generic"]), (isa, m, epi)


@pytest.mark.parametrize("isa", ["amx", "avx512", "avx2", "generic"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_are_bit_identical_for_every_m_and_thread_count(isa, fmt):
    if isa not in isas():
        pytest.skip(f"this CPU has no {isa}")
    n, k = 48, 512 if fmt.is_kquant else 96
    lin, _ = make_linear(fmt, n, k)
    x = torch.randn(256, k, generator=torch.Generator().manual_seed(3))
    for digits in (1, 3):
        full = ext().linear(lin, x, levels=digits, nthreads=2, isa=isa)  # a prefill chunk
        for m in range(1, 65):
            assert torch.equal(ext().linear(lin, x[:m], levels=digits, nthreads=2, isa=isa),
                               full[:m]), f"M={m}"
        for i in (0, 7, 31, 63, 255):  # each row alone, on 1 and 2 threads
            for threads in (1, 2):
                alone = ext().linear(lin, x[i:i + 1], levels=digits, nthreads=threads, isa=isa)
                assert torch.equal(alone[0], full[i])


@pytest.mark.parametrize("fmt", FORMATS)
def test_silu_mul_epilogue(fmt):
    """gate / up tiles interleaved (a fused MLP's first matmul): silu(gate) * up within float
    rounding of float64, and the same bits on the AMX table as on the AVX-512 one."""
    n, k = 32, 512 if fmt.is_kquant else 128
    tiles, dense = [], []
    for seed in (1, 2):
        raw = gguf_raw(fmt, n, k, seed)
        tiles.append(tile_major_of(fmt, gguf_rows(fmt, raw)))
        dense.append(torch.from_numpy(dequantized(fmt, raw, k)))
    fused = ext().PackedLinear(int(fmt), k, 2 * n, torch.from_numpy(
        finish(fmt, interleave_tiles(*tiles))))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    h = {isa: ext().linear(fused, x, levels=3, nthreads=2, isa=isa, epilogue=EPI_SILU_MUL)
         for isa in isas()}
    xd = quantized_activations(x, 3)
    ref = torch.nn.functional.silu(xd @ dense[0].T) * (xd @ dense[1].T)
    for y in h.values():
        assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    if "amx" in h:
        assert torch.equal(h["amx"], h["avx512"])
