"""EAGLE-1/2 draft head: `fc(cat(embed(token_{t+1}), hidden_t))` → one Llama decoder layer →
the TARGET's LM head.

Conventions, as the public EAGLE code runs its checkpoints (SafeAILab/EAGLE `cnets1.py`, SGLang
`llama_eagle.py`):
- concat order is (token embedding, hidden state): `fc.weight[:, :H]` multiplies the embedding;
- the first step's hidden is the target's LAST hidden state AFTER its final norm (what HF's
  `LlamaModel` returns, our `ModelOutput.final_hidden`); later draft steps feed back the head's
  own output, through `fc` again;
- layer 0 has no `input_layernorm` in the EAGLE repo's checkpoints (the fc output goes straight
  into attention); one that has it is used;
- logits are `target.lm_head(head_hidden)` WITHOUT the target's final norm: the head was trained
  to regress the normed target feature, so its output already lives after the norm. The
  `norm_before_lm_head` option exists for heads trained otherwise; no published head needs it.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.layers.attention import AttentionBackend
from runtime.layers.linear import Linear
from runtime.model_runner.forward_batch import ForwardBatch
from runtime.models.llama import LlamaDecoderLayer, ModelOutput
from speculative.models.base import DraftHead, DraftHeadConfig, HeadOutput, TargetRefs


class EagleHead(DraftHead):
    # first-step input: the target's final (normed) hidden state; no layer capture needed
    capture_layers: tuple[int, ...] = ()
    needs_final_hidden = True

    def __init__(
        self, config: DraftHeadConfig, target: TargetRefs, kv_capacity: int,
        device: torch.device | str, dtype: torch.dtype,
    ) -> None:
        super().__init__(config, target, kv_capacity, device, dtype)
        assert config.kind == "eagle", f"EagleHead given a {config.kind!r} config"
        hidden = config.hidden_size
        self.fc = Linear(2 * hidden, hidden, config.fc_bias)
        # ModuleList so parameter names match the checkpoint's `layers.0.*`
        self.layers = nn.ModuleList([LlamaDecoderLayer(config.layer, 0)])
        if not config.input_layernorm:
            self.layers[0].input_layernorm = nn.Identity()

    def target_hidden(self, out: ModelOutput) -> torch.Tensor:
        """The head's first-step hidden input from a target forward run with
        `return_final_hidden=True`: [T, H]."""
        assert out.final_hidden is not None, "run the target with return_final_hidden=True"
        return out.final_hidden

    def forward(
        self, batch: ForwardBatch, backend: AttentionBackend, hidden: torch.Tensor
    ) -> HeadOutput:
        """hidden [T, H]: per row, the target's final hidden (first step) or the head's own
        previous output; `batch.input_ids` are the tokens one position ahead of it."""
        assert hidden.shape == (batch.num_tokens, self.config.hidden_size), (
            f"hidden {tuple(hidden.shape)} for {batch.num_tokens} tokens"
        )
        cos_sin = self._prepare(batch, backend)
        x = self.fc(torch.cat((self.embed(batch.input_ids), hidden), dim=-1))  # [T, 2H] → [T, H]
        out = self.layers[0](x, cos_sin, backend, batch)  # [T, H]
        rows = out[batch.logits_indices]
        if self.config.norm_before_lm_head:
            rows = self.target.final_norm(rows)
        return HeadOutput(self.target.compute_logits(rows), out)
