"""Linear layer with an optional CPU fast path: oneDNN prepacked fp32 weights.

Measured on the 2-core AVX2 machine (µs, fp32, hidden 576): F.linear's MKL path is slow for
small M (the tokens of one verify pass), e.g. gate_up [3072x576] M=16: 451 vs 143 prepacked,
and the 49152-row LM head M=1: 7.3 ms vs 2.8 ms. `pack()` reorders the weight once into
oneDNN's blocked layout and drops the dense copy (end to end: `python -m
benchmark.bench_one_batch --engines torch`, and `--no-pack` without it).

`pack(torch.bfloat16)` packs bf16 weights instead and multiplies in bf16 (inputs rounded to
bf16, fp32 accumulation inside oneDNN, output back in the input's dtype). Only for modules
whose outputs need not be exact, i.e. draft heads (verification stays with the fp32 target),
and only where the CPU has bf16 dot-product instructions (`cpu_has_native_bf16`): half the
weight bytes and twice the multiply rate there, an emulated and slower path elsewhere. On a CPU
where oneDNN has no bf16 path at all (AVX2 without AVX-NE-CONVERT) `pack(torch.bfloat16)` returns
False and the layer stays dense fp32.

`pack("q8_0")` / `pack("q4_0")` quantize the weight into GGUF-style blocks multiplied by the CPU
engine's kernels (`specserve/kernels/cpu`, int8 activations: one digit, llama.cpp's precision). Also
for draft heads only: a quarter (q8_0) or an eighth (q4_0) of the fp32 weight bytes, which is what a
draft step at M = 1..8 is bound by.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether oneDNN multiplies bf16 on this CPU at all: it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and refuses to pack a bf16 weight on an AVX2-only CPU."""
    if not onednn_packing_available():
        return False
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else cpu_has_native_bf16()


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool({"avx512_bf16", "amx_bf16"} & flags)
    except OSError:
        pass
    return False


BLOCK_FORMATS = ("q8_0", "q4_0")  # pack() formats that use the CPU extension's kernels
DRAFT_ACTIVATION_DIGITS = 1


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        self.compute_dtype = torch.float32  # of the packed weight
        self.blocks = None  # specserve/kernels/cpu PackedLinear, when packed in a block format

    def pack(self, compute_dtype: torch.dtype | str = torch.float32,
             threads: int | None = None) -> bool:
        """Prepack for oneDNN (CPU fp32 layers only), multiplying in `compute_dtype` (float32,
        or bfloat16 for inexact uses), or quantize into "q8_0" / "q4_0" blocks for the CPU
        extension (inexact uses; see the module docstring). Returns whether the layer is now
        packed. `threads`: the CPU kernels' threads for block formats (default: torch's)."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32:
            return False
        if isinstance(compute_dtype, str):
            return self._pack_blocks(compute_dtype, threads or torch.get_num_threads())
        if not onednn_packing_available():
            return False
        assert compute_dtype in (torch.float32, torch.bfloat16), compute_dtype
        if compute_dtype == torch.bfloat16 and not onednn_bf16_available():
            return False  # stays dense fp32: same use, fp32 precision
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.data.to(compute_dtype), None)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.data.to(compute_dtype), requires_grad=False)
        self.compute_dtype = compute_dtype
        # the dense copy is no longer read: keep the parameter (for state_dict) but empty
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        return True

    @property
    def is_packed(self) -> bool:
        """Whether the dense weight was dropped for a packed copy (oneDNN or blocks)."""
        return self.packed is not None or self.blocks is not None

    def _pack_blocks(self, fmt_name: str, threads: int) -> bool:
        from specserve.kernels import cpu
        from specserve.kernels.cpu.packing import (
            Fmt,
            Packed,
            finish,
            pad_bias,
            quantize,
            tile_major,
        )

        assert fmt_name in BLOCK_FORMATS, fmt_name
        ok, _ = cpu.available()
        if not ok or self.in_features % 32:
            return False
        fmt = Fmt.parse(fmt_name)
        blocks = quantize(fmt, self.weight.data.numpy())
        data = torch.from_numpy(finish(fmt, tile_major(fmt, blocks)))
        bias = (None if self.bias is None
                else torch.from_numpy(pad_bias(self.bias.data.float().numpy())))
        self.blocks = Packed(fmt, self.in_features, self.out_features, data, bias).to_ext(
            cpu.load())
        self._threads = threads
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            from specserve.kernels import cpu

            shape = x.shape
            y = cpu.load().linear(self.blocks, x.reshape(-1, self.in_features),
                                  DRAFT_ACTIVATION_DIGITS, self._threads)
            return y.reshape(*shape[:-1], self.out_features).to(x.dtype)
        if self.packed is not None:
            # x [M, in] → [M, out]
            cd = self.compute_dtype
            y = torch.ops.mkldnn._linear_pointwise(x.to(cd), self.packed, self.bias, "none", [],
                                                   "")
            return y.to(x.dtype)
        return F.linear(x, self.weight, self.bias)
