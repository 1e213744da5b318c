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
        # One tensor [2 (K, V), layers, capacity + 1, num_kv_heads, head_dim]; self.k[l] and
        # self.v[l] are its contiguous per-layer views, so a commit moves every layer's K and V
        # in one indexed copy instead of 2 x layers small ones (`move`).
        self._kv = torch.zeros((2, num_layers, *shape), dtype=dtype, device=self.device)
        self.k = list(self._kv[0].unbind(0))
        self.v = list(self._kv[1].unbind(0))
        self._views = (self.k, self.v)  # (tests may swap in lists of other tensors)
        self._flat = self._kv.view(2 * num_layers, capacity + 1, num_kv_heads * head_dim)
        self._commit_op = None  # the registry's commit_kv off the CPU (`move`)
        # called with every move's (src, dst) first: a tensor-parallel leader's other ranks
        # hold the other heads' KV and move theirs too
        self.mirror = None

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
        if self.mirror is not None:
            self.mirror(src, dst)
        if self.device.type != "cpu":
            if self._commit_op is None:  # looked up once, on the first commit
                from specserve.kernels import registry

                self._commit_op = registry.get("commit_kv", self.device)
            self._commit_op(self.k, self.v, src.to(self.device), dst.to(self.device))
            return
        if self.k is self._views[0] and self.v is self._views[1]:
            # a commit moves a few slots: one strided copy per slot over every layer's K and V
            # (~4 us each) where copying in order reads no slot an earlier copy wrote (then it
            # equals gathering all first); else gather and scatter (~100 us, as was the
            # per-layer loop's ~280 us for 3 slots of a 30-layer model)
            s_list, d_list = src.tolist(), dst.tolist()
            if _reads_before_writes(s_list, d_list):
                flat = self._flat
                for s, d in zip(s_list, d_list):
                    flat[:, d] = flat[:, s]
            else:
                self._flat.index_copy_(1, dst, self._flat.index_select(1, src))
            return
        for layer_id in range(self.num_layers):
            self.k[layer_id][dst] = self.k[layer_id][src]
            self.v[layer_id][dst] = self.v[layer_id][src]


def _reads_before_writes(src: list[int], dst: list[int]) -> bool:
    """Whether copying slot src[i] to dst[i] for i in order reads every source before any copy
    overwrites it (so the in-order copies equal one gather then one scatter)."""
    written: set[int] = set()
    for s, d in zip(src, dst):
        if s in written:
            return False
        written.add(d)
    return True
