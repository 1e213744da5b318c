"""Per-layer KV tensors addressed by token slot.

The model runner owns these tensors; the scheduler owns which slot means what (allocator,
request table). Slot 0 is padding: gathers of padded batches read it and masks hide it.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        capacity: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.capacity = capacity
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (capacity + 1, num_kv_heads, head_dim)  # +1: slot 0 is padding
        # [capacity + 1, num_kv_heads, head_dim] per layer
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._commit_op = None  # the registry's commit_kv off the CPU (`move`)

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.tensor([], dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    def write(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots [T]; k, v [T, num_kv_heads, head_dim]
        self.k[layer_id][slots] = k.to(self.dtype)
        self.v[layer_id][slots] = v.to(self.dtype)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy KV of slots `src` into slots `dst` in every layer (speculative commit by move).
        Off the CPU, one registry op (`commit_kv`: Triton on CUDA) moves every layer."""
        if self.device.type != "cpu":
            if self._commit_op is None:  # looked up once, on the first commit
                from kernels import registry

                self._commit_op = registry.get("commit_kv", self.device)
            self._commit_op(self.k, self.v, src.to(self.device), dst.to(self.device))
            return
        for layer_id in range(self.num_layers):
            self.k[layer_id][dst] = self.k[layer_id][src]
            self.v[layer_id][dst] = self.v[layer_id][src]
