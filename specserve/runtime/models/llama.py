"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm).

Written for serving: fused QKV and gate/up projections, RoPE computed once per forward, the batch
passed in as `ForwardBatch`, attention through the backend interface, logits only for the rows
the caller asks for, and optional capture of hidden states entering chosen layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specserve.runtime.forward_batch import ForwardBatch
from specserve.runtime.layers.attention.base import AttentionBackend
from specserve.runtime.layers.linear import Linear
from specserve.runtime.layers.norm import RMSNorm
from specserve.runtime.layers.rotary import RotaryEmbedding, apply_rotary
from specserve.runtime.model_loader.config import ModelConfig
from specserve.runtime.sampling.argmax import argmax_rows
from specserve.runtime.sampling.logprobs import LogitStats


class ModelOutput(NamedTuple):
    logits: torch.Tensor | None  # [num_logits, vocab] float32
    # hidden state entering layer i ([T, hidden]); key num_layers = after the last layer
    captured: dict[int, torch.Tensor]
    final_hidden: torch.Tensor | None  # [T, hidden] after the final norm, when asked for
    # [num_logits] int64, each logits row's argmax (numpy's: the first maximum), where the
    # engine finds it while the rows are in its cache (the CPU engine); else None
    argmax: torch.Tensor | None = None
    # each logits row's log-sum-exp and top entries, when the batch asked (logit_top >= 0) and
    # the engine finds them with the argmax (the CPU engine); else None
    logit_stats: LogitStats | None = None

    def row_argmax(self) -> torch.Tensor:
        """[num_logits] int64: each logits row's argmax, the engine's where it found them."""
        return self.argmax if self.argmax is not None else argmax_rows(self.logits)


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.reduce = None  # tensor parallel: sums o_proj's partial outputs over the ranks

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend, batch: ForwardBatch,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        out = backend.forward(q, k, v, self.layer_id, batch)  # [T, num_heads, head_dim]
        return reduced(self.o_proj(out.reshape(num_tokens, self.q_size)), self.reduce)


class LlamaMLP(nn.Module):
    """Gated MLP: down(act(gate) * up); `act` is SiLU for Llama, GELU-tanh for Gemma."""

    def __init__(self, cfg: ModelConfig,
                 act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.act = act
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)
        self.reduce = None  # tensor parallel: sums down_proj's partial outputs over the ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return reduced(self.down_proj(self.act(gate) * up), self.reduce)


def reduced(partial: torch.Tensor, reduce) -> torch.Tensor:
    """A row-parallel projection's output: summed over the tensor-parallel ranks, if any."""
    if reduce is not None:
        partial = partial.contiguous()
        reduce(partial)
    return partial


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos_sin, backend, batch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, backend, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens  # one tensor; packing later makes its own copy
        max_pos = max(cfg.max_position_embeddings, 1)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling, device, dtype
        )

    tp = None  # specserve/runtime/distributed.py TpGroup, with `enable_tensor_parallel`

    def pack_weights(self) -> int:
        """Prepack every linear for the CPU fast path; returns how many were packed."""
        packed = sum(m.pack() for m in self.modules() if isinstance(m, Linear))
        if self.tp is not None and self._full_lm_head is not None:
            packed += self._full_lm_head.pack()
        return packed

    def enable_tensor_parallel(self, tp, vocab: list[tuple[int, int]],
                               full_embed: torch.Tensor | None,
                               full_lm_head: torch.Tensor | None) -> None:
        """This model holds rank `tp.rank`'s shard (specserve/runtime/model_loader/shard.py): sum
        the row-parallel projections and the embedding over the ranks, gather the logits (rank 0
        gets them, the others None). Rank 0's own `embed` / `compute_logits` (its drafters) read the
        whole `full_embed` / `full_lm_head` [vocab, hidden]."""
        self.tp = tp
        self._vocab = vocab
        for layer in self.layers:
            layer.self_attn.reduce = tp.reduce
            layer.mlp.reduce = tp.reduce
        self._full_embed, self._full_lm_head = full_embed, None
        if full_lm_head is not None:
            head = Linear(full_lm_head.shape[1], full_lm_head.shape[0])
            head.weight = nn.Parameter(full_lm_head, requires_grad=False)
            # not a submodule: it is no checkpoint weight (load_weights' check) and no shard
            object.__setattr__(self, "_full_lm_head", head)

    def embed_rows(self, input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, table)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self._full_embed if self.tp is not None else self.embed_tokens
        return self.embed_rows(input_ids, table)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] (already normed) → logits [n, vocab] float32."""
        if self.tp is not None:
            return self._full_lm_head(hidden).float()
        return self.lm_head(hidden).float()

    def _forward_embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.embed(input_ids)
        begin, end = self._vocab[self.tp.rank]
        local = input_ids - begin
        mine = (local >= 0) & (local < end - begin)
        x = self.embed_rows(local.clamp(0, end - begin - 1), self.embed_tokens)
        x = (x * mine.unsqueeze(-1).to(x.dtype)).contiguous()  # others' rows: theirs to add
        self.tp.reduce(x)
        return x

    def _forward_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.tp is None:
            return self.compute_logits(hidden)
        return self.tp.gather_vocab(self.lm_head(hidden).float().contiguous(), self._vocab)

    def rope_tables(self, positions: torch.Tensor):
        """What each layer's attention rotates q and k with (Gemma 3: a global and a local)."""
        return self.rotary.cos_sin(positions)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, backend: AttentionBackend, return_final_hidden: bool = False,
        layers: tuple[int, int] | None = None, hidden_in: torch.Tensor | None = None,
    ) -> ModelOutput:
        """`layers` = (begin, end) runs only layers [begin, end), then the final norm and LM
        head (an early exit); begin > 0 starts from `hidden_in` [T, hidden], the hidden state
        entering layer begin. `batch.capture_layers` may then include end."""
        begin, end = layers if layers is not None else (0, len(self.layers))
        end = len(self.layers) if end < 0 else end
        assert 0 <= begin <= end <= len(self.layers), f"bad layer range {layers}"
        assert begin == 0 or hidden_in is not None, "layer_begin > 0 needs hidden_in"
        x = self._forward_embed(batch.input_ids) if hidden_in is None else hidden_in
        cos_sin = self.rope_tables(batch.positions)
        captured: dict[int, torch.Tensor] = {}
        for i in range(begin, end):
            if i in batch.capture_layers:
                captured[i] = x
            x = self.layers[i](x, cos_sin, backend, batch)
        if end in batch.capture_layers:
            captured[end] = x
        if return_final_hidden:
            final = self.norm(x)
            logits = self._forward_logits(final[batch.logits_indices])
            return ModelOutput(logits, captured, final)
        logits = self._forward_logits(self.norm(x[batch.logits_indices]))
        return ModelOutput(logits, captured, None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up into their packed parameters."""
        cfg = self.config
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        fused = {
            "q_proj": ("qkv", 0, q_size), "k_proj": ("qkv", q_size, kv_size),
            "v_proj": ("qkv", q_size + kv_size, kv_size),
            "gate_proj": ("gate_up", 0, cfg.intermediate_size),
            "up_proj": ("gate_up", cfg.intermediate_size, cfg.intermediate_size),
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # tied: some checkpoints still store a copy
            parts = name.split(".")
            if parts[0] == "mtp_layers" or (parts[0] == "layers" and len(parts) > 1
                                            and int(parts[1]) >= cfg.num_hidden_layers):
                # MTP modules the checkpoint ships (specserve/speculative/models/mtp_head.py)
                continue
            target = name
            if len(parts) >= 4 and parts[0] == "layers" and parts[3] in fused:
                kind, offset, size = fused[parts[3]]
                attr = {"qkv": "self_attn.qkv_proj", "gate_up": "mlp.gate_up_proj"}[kind]
                target = f"layers.{parts[1]}.{attr}.{parts[4]}"
                param = self.get_parameter(target)
                param.data[offset : offset + size].copy_(tensor)
            else:
                target = target.replace("embed_tokens.weight", "embed_tokens")
                param = self.get_parameter(target)
                assert param.shape == tensor.shape, (
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}"
                )
                param.data.copy_(tensor)
            loaded.add(target)
        expected = {n for n, _ in self.named_parameters()}
        missing = expected - loaded
        assert not missing, f"checkpoint is missing weights: {sorted(missing)[:8]}"
