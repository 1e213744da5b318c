"""What every EAGLE-family draft head shares: its config, its output, what it borrows from the
target, and its own KV cache.

A head is a one-layer model that runs through the same attention-backend interface as the
target, on a one-layer `KVPool` it owns. Slot indices come from outside (the worker / scheduler),
exactly like the target's, so a head supports EXTEND / DRAFT_EXTEND (catch up on accepted
tokens, causal), DECODE and DRAFT_DECODE / TARGET_VERIFY-style custom tree masks.

Row convention (EAGLE's): the head's row t pairs the target's hidden state of position t with the
token at position t + 1 and sits at position t; its output predicts the token at t + 2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specserve.runtime.forward_batch import ForwardBatch
from specserve.runtime.layers.attention import AttentionBackend, create_attention_backend
from specserve.runtime.layers.linear import Linear
from specserve.runtime.layers.rotary import RotaryEmbedding
from specserve.runtime.mem_cache.kv_pool import KVPool
from specserve.runtime.model_loader.config import ModelConfig


class HeadOutput(NamedTuple):
    # [num_logits, vocab (EAGLE-1/2), hot ids (EAGLE-1/2 with a token map) or draft_vocab
    # (EAGLE-3)] float32
    logits: torch.Tensor
    # [T, H]: what the next draft step feeds back as its hidden input (EAGLE-3: before `norm`)
    hidden: torch.Tensor
    # when the forward was asked for them: each logits row's k best head ids [num_logits, k]
    # and their log q, best first
    top_logq: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None


@dataclass(frozen=True)
class DraftHeadConfig:
    """One head checkpoint's shape, read by `specserve.speculative.models.loader`.

    `layer` describes the head's single decoder layer with the target's `ModelConfig` type (the
    head's own heads / head_dim / intermediate size / rope; `vocab_size` is the target's), so the
    target's attention and MLP modules are reused as they are.
    """

    kind: str  # "eagle" (EAGLE-1/2) or "eagle3"
    layer: ModelConfig
    target_vocab_size: int
    draft_vocab_size: int  # == target_vocab_size for EAGLE-1/2
    fc_bias: bool
    # EAGLE-1/2: whether layer 0 has an input_layernorm (the EAGLE repo's heads have none)
    input_layernorm: bool = False
    # EAGLE-3: target layers whose ENTERING hidden states are fused, in fc input order
    capture_layers: tuple[int, ...] = ()
    # EAGLE-1/2: apply the target's final norm before its LM head (published heads: no)
    norm_before_lm_head: bool = False

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


@dataclass(frozen=True)
class TargetRefs:
    """What a head borrows from its target, by reference: never copied, never registered as the
    head's parameters (so `head.state_dict()` and `head.to()` leave the target alone). The
    embedding is borrowed as a lookup: the CPU engine keeps it quantized, and a dense copy is
    made (`dense_embed`) only for a head whose checkpoint carries its own embedding."""

    embed: Callable[[torch.Tensor], torch.Tensor]  # ids [T] -> [T, H]
    dense_embed: Callable[[], torch.Tensor]  # [vocab, H]
    compute_logits: Callable[[torch.Tensor], torch.Tensor]  # [n, H] → [n, vocab] float32
    final_norm: Callable[[torch.Tensor], torch.Tensor]  # [n, H] → [n, H]
    device: torch.device
    dtype: torch.dtype
    # the CPU engine's packed embedding (an extension `PackedLinear`), when the target runs there
    packed_embed: Any = None

    @classmethod
    def from_model(cls, target) -> TargetRefs:
        """From a `LlamaForCausalLM` or a `CpuLlamaForCausalLM` (`embed`, `embed_tokens`,
        `compute_logits`, `norm`)."""
        if isinstance(target, nn.Module):
            device, dtype = target.embed_tokens.device, target.embed_tokens.dtype
        else:
            device, dtype = target.device, target.dtype
        return cls(target.embed, lambda: target.embed_tokens.detach(), target.compute_logits,
                   target.norm, device, dtype, getattr(target, "packed_embed", None))


class DraftHead(nn.Module):
    """Base of `EagleHead` and `Eagle3Head`: rotary table, own KV pool, embedding lookup."""

    def __init__(
        self, config: DraftHeadConfig, target: TargetRefs, kv_capacity: int,
        device: torch.device | str, dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.config = config
        self.target = target
        lc = config.layer
        # the loader raises max_position_embeddings to the target's: checkpoints often state a
        # shorter one (EAGLE-3 for Llama-3.1 says 2048) than the context they draft for
        max_pos = max(lc.max_position_embeddings, 1)
        self.rotary = RotaryEmbedding(
            lc.head_dim, max_pos, lc.rope_theta, lc.rope_scaling, torch.device(device), dtype
        )
        self.kv_pool = KVPool(kv_capacity, 1, lc.num_key_value_heads, lc.head_dim, dtype, device)
        # [vocab, H] when the checkpoint carries its own (different) embedding, else None
        self.embed_weight: nn.Parameter | None = None

    def set_kv_pool(self, pool: KVPool) -> None:
        """A new KV pool (the drafter grows its scratch region)."""
        self.kv_pool = pool

    def create_backend(self, name: str = "auto") -> AttentionBackend:
        """An attention backend over this head's own KV pool."""
        lc = self.config.layer
        scale = lc.head_dim**-0.5
        return create_attention_backend(name, self.kv_pool, lc.num_attention_heads, scale)

    def pack_weights(self, compute_dtype: torch.dtype | str = torch.float32,
                     threads: int | None = None) -> int:
        """Prepack the head's linears for the CPU fast path (do it after any save), multiplying
        in `compute_dtype` (bfloat16, or "q8_0" / "q4_0" blocks on the CPU extension, are
        fine here: a head only drafts)."""
        return sum(m.pack(compute_dtype, threads) for m in self.modules()
                   if isinstance(m, Linear))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_weight is None:
            return self.target.embed(input_ids)  # [T, H]
        return F.embedding(input_ids, self.embed_weight)  # [T, H]

    def _prepare(
        self, batch: ForwardBatch, backend: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Plan the batch on the head's backend if the caller has not; returns RoPE cos/sin."""
        assert backend.kv_pool is self.kv_pool, "pass the backend from head.create_backend()"
        if batch.attn_metadata is None:
            batch.check()
            backend.init_forward_metadata(batch)
        return self.rotary.cos_sin(batch.positions)
