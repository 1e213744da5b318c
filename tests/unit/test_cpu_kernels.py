"""The CPU engine's kernels (specserve/kernels/cpu): each equals a float64 reference within a stated
tolerance, and each is batch-invariant: a row's output is bit-identical for every M in 1..64,
alone or in any batch, on 1, 2 or 3 threads, on every instruction set this CPU runs."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from specserve.kernels import cpu
from specserve.kernels.cpu.packing import (
    Fmt,
    finish,
    float_bits,
    gguf_rows,
    interleave_tiles,
    pack_blocks,
    pack_float,
    quantize,
    tile_major,
)

OK, WHY = cpu.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"CPU extension unavailable: {WHY}")
BLOCK_FORMATS = (Fmt.Q8_0, Fmt.Q4_0, Fmt.Q4_1)
FLOAT_FORMATS = (Fmt.F32, Fmt.BF16, Fmt.F16)
EPI_STORE, EPI_ADD, EPI_SILU_MUL = 0, 1, 2


def ext():
    return cpu.load()


def isas() -> list[str]:
    """Instruction sets this CPU runs (the wider ones drop out where unsupported)."""
    return [i for i in ("amx", "avx512", "avx2", "generic") if ext().isa_name(i) == i]


def make_linear(fmt: Fmt, n: int, k: int, seed: int = 0, bias: torch.Tensor | None = None):
    """(packed linear, dequantized float64 weight [n, k]); `bias` padded to the tiles."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
    if fmt.is_block:
        b = quantize(fmt, w)
        data, dense = pack_blocks(b), b.dequantize()
    else:
        bits = float_bits(fmt, w)
        data = pack_float(fmt, bits)
        dense = (bits.astype(np.float32) if fmt != Fmt.BF16 else
                 (bits.astype(np.uint32) << 16).view(np.float32))
    args = (torch.from_numpy(data),) if bias is None else (torch.from_numpy(data), bias)
    lin = ext().PackedLinear(int(fmt), k, n, *args)
    return lin, torch.from_numpy(dense).double()


def quantized_activations(x: torch.Tensor, digits: int) -> torch.Tensor:
    """The value the kernels multiply: each 32-block scaled by a power of two 2^e > amax / 127,
    then rounded to `digits` base-128 digits (kernels.h). float64 [M, K]."""
    m, k = x.shape
    blocks = x.double().reshape(m, k // 32, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    _, e = torch.frexp((amax / 127).float())
    d = torch.ldexp(torch.ones_like(amax), e.double())
    d = torch.where(amax >= 2.0**-100, d, torch.ones_like(d))
    v = torch.where(amax >= 2.0**-100, blocks / d, torch.zeros_like(blocks))
    q = torch.zeros_like(v)
    scale = 1.0
    for level in range(digits):
        digit = torch.round(v)
        if level == 0:
            digit = digit.clamp(-127, 127)
        q += digit * scale
        v = (v - digit) * 128
        scale /= 128
    return (q * d).reshape(m, k)


# ---- packing ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_gguf_blocks_unpack_and_pack_to_the_values_gguf_dequantizes(fmt):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((40, 96)) * 0.2).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[fmt.name]
    raw = gguf.quants.quantize(w, qtype)
    expected = gguf.quants.dequantize(raw, qtype).reshape(w.shape)
    blocks = gguf_rows(fmt, raw)
    assert np.array_equal(blocks.dequantize(), expected)
    lin = ext().PackedLinear(int(fmt), 96, 40, torch.from_numpy(pack_blocks(blocks)))
    rows = torch.stack([lin.row(r) for r in range(40)]).numpy()
    assert np.array_equal(rows, expected)  # embedding lookups read the same values


@pytest.mark.parametrize("fmt", FLOAT_FORMATS)
def test_float_formats_pack_exactly(fmt):
    lin, dense = make_linear(fmt, 21, 40)
    rows = torch.stack([lin.row(r) for r in range(21)]).double()
    assert torch.equal(rows, dense)


def test_packed_size_is_checked():
    with pytest.raises(RuntimeError, match="packed size"):
        ext().PackedLinear(int(Fmt.Q4_1), 64, 32, torch.zeros(10, dtype=torch.uint8))


# ---- activation digits -------------------------------------------------------------------

@pytest.mark.parametrize("digits", [1, 2, 3])
@pytest.mark.parametrize("k", [96, 1184])  # 3 blocks; 37 (AVX-512 sums them 16 at a time)
def test_activation_digits_are_the_same_on_every_isa_and_reconstruct_the_value(digits, k):
    nb = k // 32
    x = torch.randn(9, k) * torch.logspace(-3, 3, k)  # blocks of very different scales
    x[3] = 0.0  # an all-zero row
    x[5, 32 * (nb - 2):] = 0.0  # all-zero blocks at the end of a row
    outs = {isa: ext().quantize(x, digits, isa) for isa in isas()}
    ref = outs["generic"]
    for isa, out in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(out, ref)), isa
    q, scale, sums, fsum = ref
    value = sum(q[:, i].double() * 128.0 ** (digits - 1 - i) for i in range(digits))
    value = (value.view(9, nb, 32) * scale.double()[:, :, None]).view(9, k)
    assert torch.equal(value, quantized_activations(x, digits))
    assert torch.equal(sums, q.view(9, digits, nb, 32).sum(-1, dtype=torch.int32))
    assert torch.allclose(fsum.double(), value.view(9, nb, 32).sum(-1), rtol=1e-6)


@pytest.mark.parametrize("digits", [1, 3])
def test_block_exponents_hold_across_the_float_range(digits):
    """A block's power of two is read from the bits of amax / 127 (kernels.h, block_exponent):
    the same exponent as frexp at either end of the float range, at 127 * 2^k boundaries and at
    the 2^-100 cut below which a block is all zero digits."""
    amaxes = [2.0**-100, 2.0**-100 * (1 - 2.0**-20), 1e-38, 0.0, 2.0**-60, 0.5, 1.0, 126.99,
              127.0, 127.01, 2.0**100, 3.0e38]
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(6)).view(12, 32)
    x = (x / x.abs().amax(dim=1, keepdim=True)).double() * torch.tensor(amaxes).double()[:, None]
    x = x.float().view(4, 96)
    assert x.isfinite().all()
    outs = {isa: ext().quantize(x, digits, isa) for isa in isas()}
    for isa, out in outs.items():
        assert all(torch.equal(a, b) for a, b in zip(out, outs["generic"])), isa
    q, scale, _, _ = outs["generic"]
    value = sum(q[:, i].double() * 128.0 ** (digits - 1 - i) for i in range(digits))
    value = (value.view(4, 3, 32) * scale.double()[:, :, None]).view(4, 96)
    assert torch.equal(value, quantized_activations(x, digits))
    _, e = torch.frexp(torch.tensor(amaxes, dtype=torch.float32) / 127)
    live = torch.tensor(amaxes) >= 2.0**-100
    want = torch.where(live, torch.ldexp(torch.ones(12), (e - 7 * (digits - 1)).float()),
                       torch.tensor(2.0 ** (-7 * (digits - 1))))
    assert torch.equal(scale.view(12), want)


# ---- matmul -------------------------------------------------------------------------------

# stated tolerances, relative to the largest |output|: against the exact product of the
# quantized activations (the kernel's own math) and against the float32 activations (what the
# digit count costs)
KERNEL_TOL = 2e-6
DIGIT_TOL = {1: 3e-2, 2: 3e-4, 3: 3e-6}


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_a_single_tile_packs_and_multiplies(fmt):
    """N <= 16: one tile and no pair to interleave (a draft head's small projections)."""
    lin, w = make_linear(fmt, 5, 64)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    ref = quantized_activations(x, 3) @ w.T
    y = ext().linear(lin, x, levels=3).double()
    assert (y - ref).abs().max() <= KERNEL_TOL * ref.abs().max()


@pytest.mark.parametrize("isa", ["amx", "avx512", "avx2", "generic"])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS + FLOAT_FORMATS)
@pytest.mark.parametrize("digits", [1, 2, 3])
def test_linear_equals_float64_reference(isa, fmt, digits):
    if isa not in isas():
        pytest.skip(f"this CPU has no {isa}")
    if not fmt.is_block and digits != 3:
        pytest.skip("float formats multiply float32 activations; digits do not apply")
    n, k = 37, 128 if fmt.is_block else 72  # 3 tiles (one unpaired), a partial last one
    lin, w = make_linear(fmt, n, k, seed=digits)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2))
    y = ext().linear(lin, x, levels=digits, nthreads=2, isa=isa).double()
    xq = quantized_activations(x, digits) if fmt.is_block else x.double()
    ref = xq @ w.T
    scale = ref.abs().max()
    assert (y - ref).abs().max() <= KERNEL_TOL * scale
    exact = x.double() @ w.T
    assert (y - exact).abs().max() <= DIGIT_TOL[digits] * scale


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("digits", [1, 2, 3])
def test_avx2_block_linear_gives_the_scalar_kernels_bits(fmt, digits):
    """The AVX2 table's integer paths (Q8_0: int16 vpmaddwd streams, 32 rows at a time; Q4:
    int16 pair sums, at three digits the hand-written block sums for one to four rows) give
    the scalar table's bits: activations spread over many octaves, and rows at the digits'
    extremes; row counts on both sides of the row groups (Q8_0: pairs, Q4: fours) and of the
    32-row chunks; bias and the fused residual add. (silu * up is not compared: the two
    tables' exp differ in the last bits.)"""
    if "avx2" not in isas():
        pytest.skip("this CPU has no avx2")
    n, k = 70, 576  # 5 tiles: two pairs and a lone one
    lin, _ = make_linear(fmt, n, k, seed=digits)
    bias = torch.randn(80, generator=torch.Generator().manual_seed(9))  # padded to the tiles
    with_bias, _ = make_linear(fmt, n, k, seed=digits + 3, bias=bias)
    g = torch.Generator().manual_seed(digits)
    x = torch.randn(40, k, generator=g) * torch.exp(3 * torch.randn(40, k, generator=g))
    # block max just under 127: first digits up to +-127, halves below it, later digits +-64
    half = torch.arange(k, dtype=torch.float32) % 120 + 0.5 + 0.5 / 128
    x[33] = torch.where(torch.arange(k) % 2 == 0, half, -half)
    x[33, ::32] = 126.99
    x[34] = -x[33]
    for m in (1, 2, 3, 13, 32, 35, 40):
        rows = x[40 - m:]  # every call of more than six rows holds the extreme rows
        for packed in (lin, with_bias):
            for epi in (EPI_STORE, EPI_ADD):
                y0 = torch.randn(m, n)
                out = [ext().linear(packed, rows, levels=digits, nthreads=2, isa=isa,
                                    epilogue=epi, y=y0.clone() if epi else None)
                       for isa in ("avx2", "generic")]
                assert torch.equal(out[0], out[1]), (m, epi)


@pytest.mark.parametrize("isa", ["amx", "avx512", "avx2", "generic"])
@pytest.mark.parametrize("fmt", BLOCK_FORMATS + FLOAT_FORMATS)
def test_rows_are_bit_identical_for_every_m_and_thread_count(isa, fmt):
    if isa not in isas():
        pytest.skip(f"this CPU has no {isa}")
    k = 96 if fmt.is_block else 40
    lin, _ = make_linear(fmt, 48, k)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(3))
    for digits in ([1, 3] if fmt.is_block else [3]):
        full = ext().linear(lin, x, levels=digits, nthreads=2, isa=isa)
        for m in range(1, 65):
            assert torch.equal(ext().linear(lin, x[:m], levels=digits, nthreads=2, isa=isa),
                               full[:m]), f"M={m}"
        for i in (0, 7, 31, 63):  # each row alone, on 1 and 3 threads
            for threads in (1, 3):
                alone = ext().linear(lin, x[i : i + 1], levels=digits, nthreads=threads, isa=isa)
                assert torch.equal(alone[0], full[i])


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_amx_tiles_give_the_vpdpbusd_kernels_bits(fmt):
    """The AMX table multiplies block formats on the tile unit from M x digits >= 30 rows (the
    vpdpbusd kernel below), three-digit Q4 calls of >= 32 rows as paired digits: the same
    integers, the same float steps, so every output equals the AVX-512 table's bit for bit, on
    every side of each switch, with bias and every epilogue."""
    if "amx" not in isas():
        pytest.skip("this CPU (or its kernel) has no AMX-INT8")
    n, k = 80, 160  # 5 tiles: two pairs and a lone one
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
    data = torch.from_numpy(pack_blocks(quantize(fmt, w)))
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    lins = [ext().PackedLinear(int(fmt), k, n, data),
            ext().PackedLinear(int(fmt), k, n, data, bias)]
    fused = ext().PackedLinear(int(fmt), k, 64, data[: data.numel() * 64 // n].clone())
    x = torch.randn(48, k, generator=torch.Generator().manual_seed(5)) * 4
    # rows at the digits' extremes (block max just under 127: first digits up to +-127, halves
    # everywhere below it, so later digits reach +-64), the paired digits' range (kernels.h)
    half = torch.arange(k, dtype=torch.float32) % 120 + 0.5 + 0.5 / 128
    x[37] = torch.where(torch.arange(k) % 2 == 0, half, -half)
    x[37, ::32] = 126.99
    x[38] = -x[37]
    for digits in (1, 2, 3):
        for m in (1, 9, 10, 11, 15, 16, 17, 29, 30, 31, 32, 33, 40, 48):
            for lin in lins:
                for epi in (EPI_STORE, EPI_ADD):
                    y0 = torch.randn(m, n)
                    out = {isa: ext().linear(lin, x[:m], levels=digits, nthreads=2, isa=isa,
                                             epilogue=epi, y=y0.clone() if epi else None)
                           for isa in ("avx512", "amx")}
                    assert torch.equal(out["avx512"], out["amx"]), (digits, m, epi)
            silu = {isa: ext().linear(fused, x[:m], levels=digits, nthreads=3, isa=isa,
                                      epilogue=EPI_SILU_MUL) for isa in ("avx512", "amx")}
            assert torch.equal(silu["avx512"], silu["amx"]), (digits, m)


@pytest.mark.parametrize("fmt", [Fmt.Q4_0, Fmt.Q4_1])
def test_amx_paired_digits_over_many_blocks(fmt):
    """Three-digit Q4 calls of >= 32 rows quantize straight into paired digits (quantize_pairs),
    summing the digits 16 blocks at a time: at 37 blocks (two full groups and a tail) the tile
    path still gives the vpdpbusd kernel's bits."""
    if "amx" not in isas():
        pytest.skip("this CPU (or its kernel) has no AMX-INT8")
    lin, _ = make_linear(fmt, 48, 1184, seed=7)
    x = torch.randn(40, 1184, generator=torch.Generator().manual_seed(8))
    x[3, 1000:] = 0.0
    x[4] *= torch.logspace(-4, 4, 1184)
    out = {isa: ext().linear(lin, x, levels=3, nthreads=2, isa=isa) for isa in ("avx512", "amx")}
    assert torch.equal(out["avx512"], out["amx"])


def test_a_row_does_not_depend_on_its_neighbours():
    lin, _ = make_linear(Fmt.Q4_1, 64, 64)
    row = torch.randn(1, 64)
    for seed in range(3):
        others = torch.randn(15, 64, generator=torch.Generator().manual_seed(seed)) * 10 ** seed
        batch = torch.cat([others[:seed * 5], row, others[seed * 5:]])
        y = ext().linear(lin, batch, levels=3, nthreads=2)
        assert torch.equal(y[seed * 5], ext().linear(lin, row, levels=3, nthreads=1)[0])


@pytest.mark.parametrize("fmt", [Fmt.Q4_1, Fmt.Q8_0, Fmt.F32])
def test_residual_and_silu_mul_epilogues(fmt):
    n, k = 32, 64
    gate, wg = make_linear(fmt, n, k, seed=1)
    up, wu = make_linear(fmt, n, k, seed=2)
    def tiles(seed):
        rng = np.random.default_rng(seed)
        w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
        return tile_major(fmt, quantize(fmt, w) if fmt.is_block else float_bits(fmt, w))

    fused = ext().PackedLinear(int(fmt), k, 2 * n, torch.from_numpy(
        finish(fmt, interleave_tiles(tiles(1), tiles(2)))))
    x = torch.randn(5, k)
    h = ext().linear(fused, x, levels=3, nthreads=2, epilogue=EPI_SILU_MUL).double()
    xd = quantized_activations(x, 3) if fmt.is_block else x.double()
    g, u = xd @ wg.T, xd @ wu.T
    ref = torch.nn.functional.silu(g) * u
    assert (h - ref).abs().max() <= 1e-5 * ref.abs().max()
    base = torch.randn(5, n)
    y = ext().linear(gate, x, levels=3, nthreads=2, epilogue=EPI_ADD, y=base.clone())
    plain = ext().linear(gate, x, levels=3, nthreads=2)
    assert torch.equal(y, base + plain)  # y += xW^T: the same float add, fused


def test_rmsnorm_matches_torch_and_is_row_invariant():
    x = torch.randn(7, 64) * 3
    w = torch.randn(64)
    y = ext().rmsnorm(x, w, 1e-5)
    ref = torch.nn.functional.rms_norm(x.double(), (64,), w.double(), 1e-5)
    assert torch.allclose(y.double(), ref, rtol=1e-6, atol=1e-6)
    for i in range(7):
        assert torch.equal(ext().rmsnorm(x[i : i + 1], w, 1e-5)[0], y[i])


# ---- attention -----------------------------------------------------------------------------

def random_tree(n: int, rng: np.random.Generator) -> torch.Tensor:
    """[n, n] ancestor-or-self mask of a random tree, nodes in topological order."""
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[int(rng.integers(0, i))]
    return mask


def attention_call(q, kc, vc, heads, reqs, masks=None, isa="", threads=2):
    """reqs: list of (kv slot list, prefix_len, extend_len); one query row per new token."""
    kv_indices = torch.cat([torch.tensor(s, dtype=torch.int64) for s, _, _ in reqs])
    kv_indptr = torch.tensor(np.cumsum([0] + [len(s) for s, _, _ in reqs]), dtype=torch.int64)
    tok_req = torch.cat([torch.full((e,), b, dtype=torch.int32) for b, (_, _, e) in
                         enumerate(reqs)])
    tok_local = torch.cat([torch.arange(e, dtype=torch.int32) for _, _, e in reqs])
    pre = torch.tensor([p for _, p, _ in reqs], dtype=torch.int32)
    ext_len = torch.tensor([e for _, _, e in reqs], dtype=torch.int32)
    if masks is None:
        flat, indptr = torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.int64)
    else:
        flat = torch.cat([m.reshape(-1) for m in masks]).to(torch.uint8)
        indptr = torch.tensor(np.cumsum([0] + [m.numel() for m in masks]), dtype=torch.int64)
    return ext().attention(q, kc, vc, heads, tok_req, tok_local, kv_indptr, kv_indices, pre,
                           ext_len, flat, indptr, 0.25, threads, isa)


def dense_attention(q, kc, vc, heads, slots_per_row):
    """float64 reference: each query row over exactly its visible slots."""
    kvh, d = kc.shape[1], kc.shape[2]
    out = torch.zeros(q.shape[0], heads * d, dtype=torch.float64)
    for t, slots in enumerate(slots_per_row):
        idx = torch.tensor(slots)
        for h in range(heads):
            g = h // (heads // kvh)
            k, v = kc[idx, g].double(), vc[idx, g].double()
            p = torch.softmax(q[t, h * d:(h + 1) * d].double() @ k.T * 0.25, dim=0)
            out[t, h * d:(h + 1) * d] = p @ v
    return out


def test_the_engines_half_conversion_is_ieee_round_to_nearest_even():
    """fp16 KV is written by F16C's conversion where the CPU has it, else by the scalar
    float_to_half: both must give torch's (IEEE round-to-nearest-even) bits for normals,
    subnormals, ties, overflow and infinities."""
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(20000, generator=gen) * 10.0 ** e for e in range(-9, 6)]
    halves = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    finite = halves[torch.isfinite(halves)].float()
    ties = (finite[:-1].double() + finite[1:].double()) / 2  # exact midpoints (in float32)
    parts += [finite, ties.float(), finite.nextafter(torch.tensor(float("inf"))),
              finite.nextafter(torch.tensor(float("-inf"))),
              torch.tensor([65504.0, 65519.99, 65520.0, 1e6, -1e6, float("inf"), float("-inf"),
                            0.0, -0.0, 2.0 ** -25, 2.0 ** -26, 2.0 ** -24 * 1.5])]
    x = torch.cat([p.float() for p in parts])
    for scalar in (True, False):  # the scalar conversion and the one the engine runs here
        assert torch.equal(ext().to_half(x, scalar).view(torch.int16),
                           x.half().view(torch.int16)), scalar


def plan_attention(reqs, heads, kv_heads, threads, masks=None):
    """reqs: (prefix_len, extend_len) per request. Returns items [n][4], bounds, and each
    item's work as the split counts it: heads x sum over its rows of (visible keys + 16), plus
    8 per key of its longest row."""
    tok_req = torch.cat([torch.full((e,), b, dtype=torch.int32) for b, (_, e) in
                         enumerate(reqs)])
    tok_local = torch.cat([torch.arange(e, dtype=torch.int32) for _, e in reqs])
    pre = torch.tensor([p for p, _ in reqs], dtype=torch.int32)
    ext_len = torch.tensor([e for _, e in reqs], dtype=torch.int32)
    if masks is None:
        flat, indptr = torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.int64)
    else:
        flat = torch.cat([m.reshape(-1) for m in masks]).to(torch.uint8)
        indptr = torch.tensor(np.cumsum([0] + [m.numel() for m in masks]), dtype=torch.int64)
    items, bounds = ext().attention_plan(heads, kv_heads, tok_req, tok_local, pre, ext_len,
                                         flat, indptr, threads)
    work = []
    for t0, t1, h0, h1 in items.tolist():
        keys, longest = 0, 0
        for t in range(t0, t1):
            b, local = int(tok_req[t]), int(tok_local[t])
            seen = int(pre[b]) + (int(masks[b][local].sum()) if masks is not None else local + 1)
            keys += seen + 16
            longest = max(longest, seen)
        work.append(keys * (h1 - h0) + 8 * longest)
    return items, bounds.tolist(), work


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("case", ["prefill", "mixed", "decode", "tree"])
def test_attention_split_gives_each_thread_about_equal_work(threads, case):
    """Threads take contiguous runs of items of about equal work, not of equal count: a causal
    prefill's later rows see more keys (an even split by count gave one of 2 threads 3/4)."""
    masks = None
    if case == "prefill":
        reqs = [(0, 280)]
    elif case == "mixed":  # a prompt chunk beside decode rows of long and short requests
        reqs = [(24, 256)] + [(40 + 37 * i, 1) for i in range(32)]
    elif case == "decode":
        reqs = [(10 + 150 * (i % 4), 1) for i in range(32)]
    else:  # verify trees of 12 nodes, random ancestors
        gen = torch.Generator().manual_seed(threads)
        reqs, masks = [], []
        for b in range(4):
            n = 12
            parents = [-1] + [int(torch.randint(0, u, (1,), generator=gen)) for u in range(1, n)]
            m = torch.zeros(n, n, dtype=torch.bool)
            for u in range(n):
                v = u
                while v >= 0:
                    m[u, v] = True
                    v = parents[v]
            reqs.append((100 * (b + 1), n))
            masks.append(m)
    items, bounds, work = plan_attention(reqs, 9, 3, threads, masks)
    n = items.shape[0]
    assert len(bounds) == threads + 1 and bounds[0] == 0 and bounds[-1] == n
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))
    shares = [sum(work[bounds[k]:bounds[k + 1]]) for k in range(threads)]
    assert sum(shares) == sum(work)
    # no thread holds more than an even share plus one item
    assert max(shares) <= sum(work) / threads + max(work), (shares, max(work))
    if case == "prefill" and threads == 2:
        assert max(shares) / sum(work) < 0.55, shares


@pytest.mark.parametrize("isa", ["amx", "avx512", "avx2", "generic"])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("kv", ["float32", "float16"])
def test_tree_attention_rows_equal_decode_rows_bit_for_bit(isa, head_dim, kv):
    if isa not in isas():
        pytest.skip(f"this CPU has no {isa}")
    rng = np.random.default_rng(head_dim)
    heads, kvh, slots = 6, 2, 400
    kc = torch.randn(slots, kvh, head_dim).to(getattr(torch, kv))
    vc = torch.randn(slots, kvh, head_dim).to(getattr(torch, kv))
    free = iter(rng.permutation(np.arange(1, slots)).tolist())
    reqs, masks, visible = [], [], []
    for prefix, n in ((37, 9), (5, 1), (120, 16)):  # batch of trees, different prefixes
        s = [next(free) for _ in range(prefix + n)]
        m = random_tree(n, rng)
        reqs.append((s, prefix, n))
        masks.append(m)
        for i in range(n):
            visible.append(s[:prefix] + [s[prefix + j] for j in range(n) if m[i, j]])
    q = torch.randn(sum(n for _, _, n in reqs), heads * head_dim)
    out = attention_call(q, kc, vc, heads, reqs, masks, isa=isa)
    ref = dense_attention(q, kc.float(), vc.float(), heads, visible)  # fp16: the stored values
    assert torch.allclose(out.double(), ref, atol=1e-5)
    for t, vis in enumerate(visible):
        # the same token as a decode step: its visible keys as prefix + itself, in order
        dec = attention_call(q[t : t + 1], kc, vc, heads, [(vis, len(vis) - 1, 1)], isa=isa,
                             threads=1)
        assert torch.equal(dec[0], out[t]), f"row {t}"


def test_causal_extend_rows_equal_decode_rows():
    heads, kvh, d = 4, 2, 64
    kc, vc = torch.randn(100, kvh, d), torch.randn(100, kvh, d)
    slots = list(range(3, 60))
    q = torch.randn(17, heads * d)
    ext_rows = attention_call(q, kc, vc, heads, [(slots[:40 + 17], 40, 17)])
    for i in range(17):
        dec = attention_call(q[i : i + 1], kc, vc, heads, [(slots[:41 + i], 40 + i, 1)])
        assert torch.equal(dec[0], ext_rows[i])


@pytest.mark.parametrize("isa", ["amx", "avx512", "avx2", "generic"])
def test_row_argmax_is_numpys_on_every_isa_and_thread_count(isa):
    """The argmax a forward returns with its logits (each thread's columns, then merged): the
    first maximum, a NaN counting as the maximum, -0 tying +0; every row length around the
    vector widths, maxima at the ends, ties inside one thread's columns and across them."""
    if isa not in isas():
        pytest.skip(f"{isa} not on this CPU")
    rng = np.random.default_rng(5)
    rows = []
    for n in (1, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1000, 4099):
        x = rng.standard_normal((6, n)).astype(np.float32)
        x[0, -1] = 9.0  # the last element
        x[1, 0] = 9.0  # the first
        if n > 2:
            x[2, [n // 3, n - 1]] = 9.0  # a tie: the first wins
            x[3, n // 2] = np.nan
            x[3, n - 1] = np.nan  # two NaNs: the first
            x[4, :] = -np.inf
            x[5, :] = 0.0
            x[5, n // 2] = -0.0
        rows.append(x)
    for x in rows:
        want = np.argmax(x, axis=-1)
        for threads in (1, 2, 3):
            got = ext().argmax(torch.from_numpy(x), threads, isa).numpy()
            assert np.array_equal(got, want), (x.shape, threads)


@pytest.mark.parametrize("isa", ["amx", "avx512", "avx2", "generic"])
def test_logit_stats_are_logsumexp_and_a_stable_top_k_on_every_isa(isa):
    """Each row's log-sum-exp and k largest entries (logprobs), split over the threads' columns
    and merged as the argmax is: within float rounding of float64's logsumexp; the top list
    exact, ties in id order; a row's numbers the same bits alone or among other rows; NaN for
    a row holding a NaN or whose maximum is infinite."""
    if isa not in isas():
        pytest.skip(f"{isa} not on this CPU")
    rng = np.random.default_rng(11)
    for n in (1, 7, 8, 9, 16, 17, 33, 100, 4099):
        x = (rng.standard_normal((7, n)) * 4).astype(np.float32)
        x[1, n // 2:] = 9.0  # ties across threads' columns: lower ids first
        x[2, :] = -np.inf
        x[2, 0] = 1.0  # -inf entries: exp 0, last in the list
        x[3, n // 3] = np.nan
        x[4, :] = -np.inf
        x[5, -1] = np.inf
        for threads in (1, 2, 3):
            for k in (0, 1, 5, 21):
                am, lse, vals, ids = (t.numpy() for t in ext().logit_stats(
                    torch.from_numpy(x), k, threads, isa))
                assert np.array_equal(am, np.argmax(x, axis=-1))
                kk = min(k, n)
                assert vals.shape == ids.shape == (7, kk)
                for r in (0, 1, 2, 6):
                    ref = np.logaddexp.reduce(x[r].astype(np.float64))
                    assert abs(lse[r] - ref) <= 2e-6 * max(1.0, abs(ref)), (n, r, threads)
                    order = sorted(range(n), key=lambda j: (-x[r, j], j))[:kk]
                    assert ids[r].tolist() == order, (n, r, k, threads)
                    assert np.array_equal(vals[r], x[r, order])
                assert np.isnan(lse[3:6]).all()
                for r in range(7):  # alone: the same bits
                    one = [t.numpy() for t in ext().logit_stats(
                        torch.from_numpy(x[r:r + 1]), k, threads, isa)]
                    assert np.array_equal(one[1], lse[r:r + 1], equal_nan=True)
                    if r < 3 or r == 6:
                        assert np.array_equal(one[2], vals[r:r + 1])
                        assert np.array_equal(one[3], ids[r:r + 1])
