"""EAGLE-3 draft head: fused low/mid/high target features → one decoder layer whose attention
reads `cat(embed, hidden)` → own `norm` and `lm_head` over a reduced draft vocabulary.

Conventions (SafeAILab/EAGLE `cnets.py`, SGLang `llama_eagle3.py`, SpecForge):
- capture layers: the target hidden states ENTERING layers (2, L//2, L-3) — the residual stream,
  before that layer's input norm — concatenated in that order (low, mid, high) → [T, 3H]. This is
  `ModelOutput.captured[i]` with `capture_layers=(2, L//2, L-3)`, and HF's
  `output_hidden_states[i]`. A checkpoint's `eagle_aux_hidden_state_layer_ids` count layer
  OUTPUTS (vLLM/SGLang/SpecForge), so the loader adds one to them.
- fused first step: `h = fc(cat(captured))` ([T, 3H] → [T, H], no bias in published heads).
  Later draft steps feed back the head's own pre-norm output `h` directly, skipping `fc`.
- midlayer: `residual = h; x = cat(input_layernorm(embed), hidden_norm(h))` (embedding FIRST,
  [T, 2H] into q/k/v); `h = residual + attn(x)`; `h = h + mlp(post_attention_layernorm(h))`.
- logits: `lm_head(norm(h))` over the draft vocabulary; `HeadOutput.hidden` is `h` before
  `norm`. Draft id d means target id `d + d2t[d]`; `t2d[t]` says whether target id t is in the
  draft vocabulary. The token embedding is the target's.
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.runtime.forward_batch import ForwardBatch
from specserve.runtime.layers.attention import AttentionBackend
from specserve.runtime.layers.linear import Linear
from specserve.runtime.layers.norm import RMSNorm
from specserve.runtime.model_loader.config import ModelConfig
from specserve.runtime.models.llama import LlamaAttention, LlamaMLP, ModelOutput
from specserve.speculative.models.base import DraftHead, DraftHeadConfig, HeadOutput, TargetRefs


def default_capture_layers(num_target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default: hidden states entering layers 2, L//2 and L-3 of an L-layer target."""
    n = num_target_layers
    return (2, n // 2, n - 3)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)  # on the hidden input
        self.self_attn = LlamaAttention(cfg, layer_id=0)
        attn = self.self_attn
        # q/k/v read cat(embed, hidden): 2H inputs instead of H
        attn.qkv_proj = Linear(2 * hidden, attn.q_size + 2 * attn.kv_size, cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, embeds, hidden, cos_sin, backend, batch) -> torch.Tensor:
        # embeds, hidden [T, H] → [T, H] (pre-norm residual stream)
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        h = hidden + self.self_attn(x, cos_sin, backend, batch)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(DraftHead):
    needs_final_hidden = False  # its first-step input is `target_hidden(captured layers)`

    def __init__(
        self, config: DraftHeadConfig, target: TargetRefs, kv_capacity: int,
        device: torch.device | str, dtype: torch.dtype,
    ) -> None:
        super().__init__(config, target, kv_capacity, device, dtype)
        assert config.kind == "eagle3", f"Eagle3Head given a {config.kind!r} config"
        hidden = config.hidden_size
        self.capture_layers = tuple(config.capture_layers)
        self.fc = Linear(len(self.capture_layers) * hidden, hidden, config.fc_bias)
        self.midlayer = Eagle3DecoderLayer(config.layer)
        self.norm = RMSNorm(hidden, config.layer.rms_norm_eps)
        self.lm_head = Linear(hidden, config.draft_vocab_size)
        # identity maps until the loader fills them; buffers so they follow .to(device)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(config.target_vocab_size, dtype=torch.bool))
        self.cpu_core = None  # an Eagle3CpuCore once `run_in_cpu_engine` built one

    def run_in_cpu_engine(self, fmt: str, threads: int) -> bool:
        """Run every later forward as one call of the CPU engine, weights in `fmt` ("q8_0" /
        "q4_0"): the head's whole forward without a torch op per layer step. Only for a
        Llama-family target on the CPU engine, whose packed embedding the head reads."""
        from specserve.kernels import cpu
        from specserve.speculative.models.eagle3_cpu import Eagle3CpuCore

        if self.target.packed_embed is None and self.embed_weight is None:
            return False
        if self.kv_pool.device.type != "cpu" or not cpu.available()[0]:
            return False
        self.cpu_core = Eagle3CpuCore(self, fmt, threads)
        return True

    def set_kv_pool(self, pool) -> None:
        super().set_kv_pool(pool)
        if self.cpu_core is not None:
            self.cpu_core.set_kv(pool)

    def target_hidden(self, out: ModelOutput) -> torch.Tensor:
        """Fuse a target forward's captured states (run with `capture_layers=head.
        capture_layers`) into the first-step hidden input: [T, len(capture_layers) * H]."""
        missing = [i for i in self.capture_layers if i not in out.captured]
        assert not missing, f"target forward did not capture layers {missing}"
        return torch.cat([out.captured[i] for i in self.capture_layers], dim=-1)

    def map_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids (any shape, int64) → target-vocabulary ids."""
        return draft_ids + self.d2t[draft_ids]

    def forward(
        self, batch: ForwardBatch, backend: AttentionBackend, hidden: torch.Tensor,
        hidden_is_fused: bool, topk: int = 0,
    ) -> HeadOutput:
        """hidden: [T, 3H] fused target features (`hidden_is_fused=True`, first step / draft
        extend over accepted tokens) or [T, H] the head's own previous `HeadOutput.hidden`.
        `topk` > 0: the CPU engine also returns each logits row's top-k (`HeadOutput.top_*`)."""
        width = self.fc.in_features if hidden_is_fused else self.config.hidden_size
        assert hidden.shape == (batch.num_tokens, width), (
            f"hidden {tuple(hidden.shape)} for {batch.num_tokens} tokens, "
            f"hidden_is_fused={hidden_is_fused} expects width {width}"
        )
        if self.cpu_core is not None:
            return HeadOutput(*self.cpu_core.forward(batch, hidden, topk))
        cos_sin = self._prepare(batch, backend)
        h = self.fc(hidden) if hidden_is_fused else hidden  # [T, H]
        h = self.midlayer(self.embed(batch.input_ids), h, cos_sin, backend, batch)
        logits = self.lm_head(self.norm(h[batch.logits_indices])).float()  # [n, draft_vocab]
        return HeadOutput(logits, h)
