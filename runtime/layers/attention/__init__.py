from __future__ import annotations

from runtime.layers.attention.base import AttentionBackend
from runtime.layers.attention.cpu import CpuAttentionBackend
from runtime.layers.attention.torch_native import TorchNativeBackend

ATTENTION_BACKENDS = {"torch_native": TorchNativeBackend, "cpu": CpuAttentionBackend}


def create_attention_backend(name: str, kv_pool, num_heads: int, scale: float) -> AttentionBackend:
    if name == "auto":
        name = "torch_native"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is not available; choose from {sorted(ATTENTION_BACKENDS)}"
        )
    return ATTENTION_BACKENDS[name](kv_pool, num_heads, scale)


__all__ = [
    "ATTENTION_BACKENDS", "AttentionBackend", "CpuAttentionBackend", "TorchNativeBackend",
    "create_attention_backend",
]
