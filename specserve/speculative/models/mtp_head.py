"""MTP modules shipped inside a target checkpoint (multi-token prediction; SGLang serves them as
NEXTN, vLLM as `*_mtp`), run as an EAGLE-style one-layer draft head.

One module: `fc(cat(norm_e(embed(token_{t+1})), norm_h(hidden_t)))` (the order is the layout's)
→ one decoder layer of the target's shape → `final_norm` → the target's LM head. The first step's
hidden is the target's final (normed) hidden state, later steps feed back the module's own
output before `final_norm` (as the reference implementations chain MTP steps). Layouts read
from the target's own safetensors (`load_mtp_head`):

- MiMo (`model.mtp_layers.0.*`, Qwen2 blocks): `token_layernorm`, `hidden_layernorm`,
  `input_proj` [H, 2H] over cat(hidden, embedding) — hidden FIRST —, the decoder layer's
  `input_layernorm`, `self_attn.{q,k,v,o}_proj`, `post_attention_layernorm`, `mlp.*`, and
  `final_layernorm`;
- DeepSeek-V3 style (`model.layers.{num_hidden_layers}.*`): `enorm`, `hnorm`, `eh_proj` over
  cat(embedding, hidden), the decoder layer, `shared_head.norm` (its `shared_head.head` and
  `embed_tokens` copies of the target's are not needed: the target's are used).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from specserve.runtime.errors import ModelLoadError
from specserve.runtime.forward_batch import ForwardBatch
from specserve.runtime.layers.attention import AttentionBackend
from specserve.runtime.layers.linear import Linear
from specserve.runtime.layers.norm import RMSNorm
from specserve.runtime.model_loader.config import ModelConfig
from specserve.runtime.model_loader.hf_dir import iter_safetensors_weights
from specserve.runtime.models.llama import LlamaDecoderLayer
from specserve.speculative.models.base import DraftHead, DraftHeadConfig, HeadOutput, TargetRefs

# layout -> (key prefix template, {public name: our name}, hidden first in the concat)
_MIMO = {"token_layernorm.weight": "enorm.weight", "hidden_layernorm.weight": "hnorm.weight",
         "input_proj.weight": "fc.weight", "final_layernorm.weight": "final_norm.weight"}
_DEEPSEEK = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
             "eh_proj.weight": "fc.weight", "shared_head.norm.weight": "final_norm.weight"}
_IGNORED = ("shared_head.head.weight", "embed_tokens.weight")  # copies of the target's


class MtpHead(DraftHead):
    capture_layers: tuple[int, ...] = ()
    needs_final_hidden = True

    def __init__(self, config: DraftHeadConfig, target: TargetRefs, kv_capacity: int,
                 device: torch.device | str, dtype: torch.dtype, hidden_first: bool) -> None:
        super().__init__(config, target, kv_capacity, device, dtype)
        h, eps = config.hidden_size, config.layer.rms_norm_eps
        self.hidden_first = hidden_first
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.fc = Linear(2 * h, h, False)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config.layer, 0)])
        self.final_norm = RMSNorm(h, eps)

    def target_hidden(self, out) -> torch.Tensor:
        assert out.final_hidden is not None, "run the target with return_final_hidden=True"
        return out.final_hidden

    def forward(self, batch: ForwardBatch, backend: AttentionBackend,
                hidden: torch.Tensor) -> HeadOutput:
        """hidden [T, H]: the target's final hidden (first step) or this module's previous
        output; `batch.input_ids` are the tokens one position ahead of it."""
        cos_sin = self._prepare(batch, backend)
        e, h = self.enorm(self.embed(batch.input_ids)), self.hnorm(hidden)
        x = self.fc(torch.cat((h, e) if self.hidden_first else (e, h), dim=-1))
        out = self.layers[0](x, cos_sin, backend, batch)  # [T, H]
        rows = out[batch.logits_indices]
        return HeadOutput(self.target.compute_logits(self.final_norm(rows)), out)


def find_mtp_weights(model_dir: str | Path, num_hidden_layers: int
                     ) -> tuple[str, dict[str, torch.Tensor]]:
    """("mimo" | "deepseek", {our public key: tensor}) of the first MTP module in a checkpoint;
    `ModelLoadError` when it holds none."""
    mimo_prefix = "model.mtp_layers.0."
    ds_prefix = f"model.layers.{num_hidden_layers}."
    mimo, ds = {}, {}
    for name, tensor in iter_safetensors_weights(model_dir):
        if name.startswith(mimo_prefix):
            mimo[name[len(mimo_prefix):]] = tensor
        elif name.startswith(ds_prefix):
            ds[name[len(ds_prefix):]] = tensor
    if mimo:
        kind, raw, rename = "mimo", mimo, _MIMO
    elif "eh_proj.weight" in ds:
        kind, raw, rename = "deepseek", ds, _DEEPSEEK
    else:
        raise ModelLoadError(
            f"{model_dir}: no MTP layers in this checkpoint (looked for MiMo's "
            f"{mimo_prefix}* and DeepSeek-style {ds_prefix}eh_proj); MTP needs a model that "
            "ships them")
    out = {}
    for key, tensor in raw.items():
        if key in _IGNORED or key.endswith("rotary_emb.inv_freq"):
            continue
        out[rename.get(key, f"layers.0.{key}")] = tensor
    return kind, out


def load_mtp_head(model_dir: str | Path, target_config: ModelConfig, target_model: nn.Module, *,
                  kv_capacity: int) -> MtpHead:
    """The first MTP module of the target's own checkpoint as a draft head on its device."""
    from specserve.speculative.models.loader import _load_layout

    path = Path(model_dir)
    kind, weights = find_mtp_weights(path, target_config.num_hidden_layers)
    layer = replace(target_config, num_hidden_layers=1,
                    attention_bias="layers.0.self_attn.q_proj.bias" in weights)
    cfg = DraftHeadConfig(kind="mtp", layer=layer, target_vocab_size=target_config.vocab_size,
                          draft_vocab_size=target_config.vocab_size, fc_bias=False,
                          input_layernorm=True)
    refs = TargetRefs.from_model(target_model)
    head = MtpHead(cfg, refs, kv_capacity, refs.device, refs.dtype, hidden_first=kind == "mimo")
    head.to(device=refs.device, dtype=refs.dtype)
    _load_layout(head, weights, path)
    return head.eval()
