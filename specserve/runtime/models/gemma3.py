"""Gemma 3 text decoder (the torch reference engine), with `LlamaForCausalLM`'s interface.

What differs from Llama: embeddings scaled by sqrt(hidden); four RMSNorms per block, each
multiplying by (1 + w) (the attention and MLP outputs are normed before their residual add);
per-head q / k norms before RoPE; a GELU-tanh MLP; attention scaled by
query_pre_attn_scalar^-0.5; and "sliding_attention" layers that see only the last
`sliding_window` positions (their own RoPE base), every sixth layer a full-attention one.
The KV of every token is kept for every layer: the full-attention layers read all of it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.runtime.forward_batch import ForwardBatch
from specserve.runtime.layers.attention.base import AttentionBackend
from specserve.runtime.layers.linear import Linear
from specserve.runtime.layers.norm import RMSNorm
from specserve.runtime.layers.rotary import RotaryEmbedding, apply_rotary
from specserve.runtime.model_loader.config import ModelConfig
from specserve.runtime.models.llama import LlamaForCausalLM, LlamaMLP, _param, reduced


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.window = cfg.layer_window(layer_id)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.reduce = None  # tensor parallel: sums o_proj's partial outputs over the ranks

    def forward(self, x, cos_sin, backend: AttentionBackend, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        if self.window is not None and max(batch.seq_lens) > self.window:
            out = backend.forward_window(q, k, v, self.layer_id, batch, self.window)
        else:  # every key is inside the window: plain causal / tree attention is the same
            out = backend.forward(q, k, v, self.layer_id, batch)
        return reduced(self.o_proj(out.reshape(t, self.q_size)), self.reduce)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = Gemma3Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = LlamaMLP(cfg, gelu_tanh)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, x, cos_sin, backend, batch) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos_sin[self.self_attn.window is not None],
                           backend, batch)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Norm weights are held as (1 + w) (`load_weights` adds the one, in float32 as HF does),
    so every norm is a plain RMSNorm."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.lm_head.weight = self.embed_tokens  # tied
        max_pos = max(cfg.max_position_embeddings, 1)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_theta, None, device, dtype)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_local_theta, None,
                                            device, dtype)

    def embed_rows(self, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.config.embed_scale, dtype=table.dtype)
        return F.embedding(input_ids, table) * scale

    def rope_tables(self, positions: torch.Tensor):
        return self.rotary.cos_sin(positions), self.rotary_local.cos_sin(positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def plus_one(items):
            for name, tensor in items:
                if name.endswith("norm.weight"):
                    tensor = 1.0 + tensor.float()  # HF's Gemma3RMSNorm: x_n * (1 + w)
                yield name, tensor

        super().load_weights(plus_one(weights))
