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
- a token map (`--speculative-token-map`, `restrict_vocab`) limits the logits to its hot ids:
  the LM-head rows are sliced once, so logits are [n, len(hot)] and draft index i is target id
  hot_ids[i].
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from specserve.runtime.forward_batch import ForwardBatch
from specserve.runtime.layers.attention import AttentionBackend
from specserve.runtime.layers.linear import Linear
from specserve.runtime.models.llama import LlamaDecoderLayer, ModelOutput
from specserve.speculative.models.base import DraftHead, DraftHeadConfig, HeadOutput, TargetRefs


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
        # [n_hot] target ids the logits cover (a token map), None = the whole vocabulary
        self.hot_ids: torch.Tensor | None = None

    def restrict_vocab(self, hot_ids: torch.Tensor, lm_head: Linear,
                       tied_weight: torch.Tensor | None = None) -> None:
        """Score only `hot_ids` (sorted target ids): slice the target's LM head once, so logits
        are [n, len(hot_ids)]. `lm_head` is the target's (possibly prepacked); `tied_weight` is
        its embedding when the two are tied (prepacking drops the head's dense copy)."""
        weight = lm_head_rows(lm_head, hot_ids, tied_weight)  # [n_hot, H]
        hot = Linear(weight.shape[1], weight.shape[0], lm_head.bias is not None)
        hot.weight = nn.Parameter(weight, requires_grad=False)
        if lm_head.bias is not None:
            hot.bias = nn.Parameter(lm_head.bias.detach()[hot_ids.to(lm_head.bias.device)],
                                    requires_grad=False)
        hot.pack()  # the CPU fp32 fast path, like the target's
        self.hot_ids = hot_ids.to(weight.device)
        # borrowed like the target's LM head: not a registered parameter of the head
        self.target = replace(self.target, compute_logits=lambda h: hot(h).float())

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


def lm_head_rows(lm_head: Linear, ids: torch.Tensor, tied_weight: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Rows `ids` of an LM head's weight: [len(ids), H]. A prepacked head (CPU fp32) keeps no
    dense weight: a tied one is read from `tied_weight` (the embedding), an untied one is
    recovered exactly by running it on identity rows (out[h, j] = W[j, h])."""
    if lm_head.packed is None:
        return lm_head.weight.detach()[ids.to(lm_head.weight.device)].clone()
    if tied_weight is not None:
        return tied_weight.detach()[ids.to(tied_weight.device)].clone()
    hidden = lm_head.in_features
    ids = ids.to(lm_head.packed.device)
    cols = []
    for start in range(0, hidden, 256):  # [c, V] at a time
        stop = min(start + 256, hidden)
        eye = torch.zeros(stop - start, hidden, dtype=torch.float32, device=ids.device)
        eye[:, start:stop].fill_diagonal_(1.0)
        out = torch.ops.mkldnn._linear_pointwise(eye, lm_head.packed, None, "none", [], "")
        cols.append(out[:, ids])  # [c, n_hot]: W[ids, start:stop].T
    return torch.cat(cols).t().contiguous()
