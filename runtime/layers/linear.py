"""Linear layer with an optional CPU fast path: oneDNN prepacked fp32 weights.

Measured on the 2-core AVX2 machine (µs, fp32, hidden 576): F.linear's MKL path is slow for
small M (the tokens of one verify pass), e.g. gate_up [3072x576] M=16: 451 vs 143 prepacked,
and the 49152-row LM head M=1: 7.3 ms vs 2.8 ms. `pack()` reorders the weight once into
oneDNN's blocked layout and drops the dense copy; see docs/benchmarks.md for end-to-end numbers.

`pack(torch.bfloat16)` packs bf16 weights instead and multiplies in bf16 (inputs rounded to
bf16, fp32 accumulation inside oneDNN, output back in the input's dtype). Only for modules
whose outputs need not be exact, i.e. draft heads (verification stays with the fp32 target),
and only where the CPU has bf16 dot-product instructions (`cpu_has_native_bf16`): half the
weight bytes and twice the multiply rate there, an emulated and slower path elsewhere.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


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


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        self.compute_dtype = torch.float32  # of the packed weight

    def pack(self, compute_dtype: torch.dtype = torch.float32) -> bool:
        """Prepack for oneDNN (CPU fp32 layers only), multiplying in `compute_dtype` (float32,
        or bfloat16 for inexact uses: see the module docstring). Returns whether the layer is
        now packed."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or not onednn_packing_available():
            return False
        assert compute_dtype in (torch.float32, torch.bfloat16), compute_dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.data.to(compute_dtype), None)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.data.to(compute_dtype), requires_grad=False)
        self.compute_dtype = compute_dtype
        # the dense copy is no longer read: keep the parameter (for state_dict) but empty
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            # x [M, in] → [M, out]
            cd = self.compute_dtype
            y = torch.ops.mkldnn._linear_pointwise(x.to(cd), self.packed, self.bias, "none", [],
                                                   "")
            return y.to(x.dtype)
        return F.linear(x, self.weight, self.bias)
