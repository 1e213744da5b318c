"""specserve/runtime/layers/linear: the oneDNN prepacked paths against F.linear."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specserve.runtime.layers import linear
from specserve.runtime.layers.linear import (
    Linear,
    cpu_has_native_bf16,
    onednn_bf16_available,
    onednn_packing_available,
)

pytestmark = pytest.mark.skipif(not onednn_packing_available(), reason="no oneDNN on this torch")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_packed_fp32_equals_dense_and_bf16_is_close(bias, rows):
    gen = torch.Generator().manual_seed(rows)
    lin = Linear(64, 96, bias=bias)
    lin.weight.data = torch.randn(96, 64, generator=gen)
    if bias:
        lin.bias.data = torch.randn(96, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    dense = F.linear(x, lin.weight.data.clone(), None if lin.bias is None else lin.bias.data)
    low = Linear(64, 96, bias=bias)
    low.load_state_dict(lin.state_dict())
    assert lin.pack() and lin.compute_dtype == torch.float32
    torch.testing.assert_close(lin(x), dense, atol=1e-4, rtol=1e-4)
    if not onednn_bf16_available():  # AVX2-only: oneDNN has no bf16 path; stays dense fp32
        assert not low.pack(torch.bfloat16) and not low.is_packed
        torch.testing.assert_close(low(x), dense, atol=1e-4, rtol=1e-4)
        return
    assert low.pack(torch.bfloat16) and low.compute_dtype == torch.bfloat16
    y = low(x)
    assert y.dtype == torch.float32 and y.shape == dense.shape
    rel = (y - dense).abs().max() / dense.abs().max()
    assert 0 < rel < 0.02  # bf16 inputs and weights: ~3 significant digits


def test_bf16_pack_without_a_onednn_bf16_path_keeps_the_dense_fp32_layer(monkeypatch):
    """An AVX2-only CPU: oneDNN refuses to reorder a bf16 weight, so pack() says no and the
    layer keeps computing in fp32 (and a draft asked for bfloat16 falls back to float32)."""
    from specserve.speculative.drafters.eagle import draft_matmul_dtype

    monkeypatch.setattr(linear, "onednn_bf16_available", lambda: False)
    monkeypatch.setattr("specserve.speculative.drafters.eagle.onednn_bf16_available", lambda: False)
    gen = torch.Generator().manual_seed(7)
    lin = Linear(64, 32, bias=True)
    lin.weight.data = torch.randn(32, 64, generator=gen)
    x = torch.randn(4, 64, generator=gen)
    dense = F.linear(x, lin.weight.data.clone(), lin.bias.data)
    assert not lin.pack(torch.bfloat16)
    assert not lin.is_packed and lin.compute_dtype == torch.float32 and lin.weight.numel() > 0
    torch.testing.assert_close(lin(x), dense)
    assert draft_matmul_dtype("bfloat16", torch.device("cpu")) == torch.float32


def test_onednn_bf16_detection_agrees_with_the_cpu_flags():
    """oneDNN's bf16 path needs AVX-512 BW + VL + DQ or AVX-NE-CONVERT (its own error message
    on an AVX2-only CPU); read from /proc/cpuinfo, independently of torch's check."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    capable = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    assert onednn_bf16_available() == capable
    if cpu_has_native_bf16():  # bf16 dot products imply oneDNN's bf16 path
        assert onednn_bf16_available()


def test_native_bf16_detection_reads_the_cpu_flags():
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    assert cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


@pytest.mark.parametrize("fmt,tol", [("q8_0", 0.03), ("q4_0", 0.25)])
@pytest.mark.parametrize("rows", [1, 5])
def test_block_formats_on_the_cpu_kernels_are_close(fmt, tol, rows):
    """Draft heads' q8_0 / q4_0 path (the CPU extension's kernels, int8 activations)."""
    from specserve.kernels import cpu

    if not cpu.available()[0]:
        pytest.skip("CPU extension unavailable")
    gen = torch.Generator().manual_seed(rows)
    lin = Linear(64, 40, bias=True)
    lin.weight.data = torch.randn(40, 64, generator=gen)
    lin.bias.data = torch.randn(40, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    dense = F.linear(x, lin.weight.data.clone(), lin.bias.data)
    assert lin.pack(fmt) and lin.is_packed and lin.weight.numel() == 0
    y = lin(x)
    assert y.shape == dense.shape and y.dtype == torch.float32
    rel = (y - dense).abs().max() / dense.abs().max()
    assert 0 < rel < tol
    assert torch.equal(lin(x.view(rows, 1, 64)).view(rows, 40), y)  # leading dims kept
    odd = Linear(48, 8)  # K not a multiple of the 32-wide blocks: stays dense
    assert not odd.pack(fmt) and not odd.is_packed
