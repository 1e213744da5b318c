"""Linear layer with an optional CPU fast path: oneDNN prepacked fp32 weights.

Measured on the 2-core AVX2 machine (µs, fp32, hidden 576): F.linear's MKL path is slow for
small M (the tokens of one verify pass), e.g. gate_up [3072x576] M=16: 451 vs 143 prepacked,
and the 49152-row LM head M=1: 7.3 ms vs 2.8 ms. `pack()` reorders the weight once into
oneDNN's blocked layout and drops the dense copy; see docs/benchmarks.md for end-to-end numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def onednn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None

    def pack(self) -> bool:
        """Prepack for oneDNN (CPU fp32 only). Returns whether the layer is now packed."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or not onednn_packing_available():
            return False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.data, None)
        # the dense copy is no longer read: keep the parameter (for state_dict) but empty
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            # x [M, in] → [M, out]
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
