"""runtime/layers/linear: the oneDNN prepacked paths against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime.layers.linear import Linear, cpu_has_native_bf16, onednn_packing_available

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
    assert low.pack(torch.bfloat16) and low.compute_dtype == torch.bfloat16
    y = low(x)
    assert y.dtype == torch.float32 and y.shape == dense.shape
    rel = (y - dense).abs().max() / dense.abs().max()
    assert 0 < rel < 0.02  # bf16 inputs and weights: ~3 significant digits


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
    from kernels import cpu

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
