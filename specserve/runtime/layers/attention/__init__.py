from __future__ import annotations

import torch

from specserve.runtime.layers.attention.base import AttentionBackend
from specserve.runtime.layers.attention.cpu import CpuAttentionBackend
from specserve.runtime.layers.attention.torch_native import TorchNativeBackend


def _flashinfer(kv_pool, num_heads: int, scale: float) -> AttentionBackend:
    # imported on use: the module needs neither flashinfer nor CUDA until a backend is built
    from specserve.runtime.layers.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(kv_pool, num_heads, scale)


def _triton(kv_pool, num_heads: int, scale: float) -> AttentionBackend:
    # imported on use: the kernel is compiled, or interpreted under TRITON_INTERPRET=1, as the
    # environment says when the module is first imported
    from specserve.runtime.layers.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(kv_pool, num_heads, scale)


ATTENTION_BACKENDS = {"torch_native": TorchNativeBackend, "cpu": CpuAttentionBackend,
                      "flashinfer": _flashinfer, "triton": _triton}


def auto_backend(device_type: str) -> str:
    """auto: on CUDA flashinfer where it imports, then triton; torch_native elsewhere."""
    if device_type == "cuda":
        from specserve.runtime.layers.attention.flashinfer_backend import flashinfer_available

        if flashinfer_available():
            return "flashinfer"
        from specserve.runtime.layers.attention.triton_backend import triton_available

        if triton_available():
            return "triton"
    return "torch_native"


def create_attention_backend(name: str, kv_pool, num_heads: int, scale: float) -> AttentionBackend:
    if name == "auto":
        name = auto_backend(torch.device(kv_pool.device).type)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is not available; choose from {sorted(ATTENTION_BACKENDS)}"
        )
    return ATTENTION_BACKENDS[name](kv_pool, num_heads, scale)


__all__ = [
    "ATTENTION_BACKENDS", "AttentionBackend", "CpuAttentionBackend", "TorchNativeBackend",
    "auto_backend",
    "create_attention_backend",
]
