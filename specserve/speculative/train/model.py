"""A trainable EAGLE-3 head with training-time test (TTT), exported in the public EAGLE-3 layout.

The serving head (`specserve/speculative/models/eagle3_head.py`) runs through the attention backend
on a KV pool; this module computes exactly the same function with plain autograd-friendly torch ops
over whole padded sequences, and `export()` writes weights that `load_draft_head` reads back
(tested: the two give the same logits).

Rows (EAGLE's convention). For a sequence x_0..x_{T-1} with fused target features F_t
(hidden states entering the capture layers, concatenated) the step-0 row t takes
(x_{t+1}, F_t) at position t and predicts x_{t+2}. Training-time test unrolls the draft:
step k >= 1 row t takes (x_{t+1+k}, h_{k-1}[t]) — the true next token and the head's OWN previous
output — at position t+k and predicts x_{t+2+k}. Its attention sees the step-0 rows at positions
<= t (the committed prefix, computed from target features) plus its own chain's rows of steps
1..k (the ancestors in a draft tree) — exactly what a depth-(k+1) tree node sees when serving.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specserve.runtime.layers.rotary import apply_rotary, rope_inv_freq
from specserve.runtime.model_loader.config import ModelConfig
from specserve.speculative.models.eagle3_head import default_capture_layers
from specserve.speculative.models.loader import eagle3_config_json


@dataclass
class HeadShape:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    target_vocab_size: int
    draft_vocab_size: int
    capture_layers: tuple[int, ...]

    @classmethod
    def for_target(cls, target: ModelConfig, draft_vocab_size: int) -> HeadShape:
        """The head EAGLE-3 trainers build for a target: one layer shaped like the target's."""
        return cls(
            hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            max_position_embeddings=target.max_position_embeddings,
            target_vocab_size=target.vocab_size, draft_vocab_size=draft_vocab_size,
            capture_layers=tuple(default_capture_layers(target.num_hidden_layers)),
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["capture_layers"] = list(self.capture_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> HeadShape:
        return cls(**{**d, "capture_layers": tuple(d["capture_layers"])})


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


class TrainableEagle3(nn.Module):
    """Parameters carry the public EAGLE-3 names (minus `.weight`), so export is a rename."""

    def __init__(self, shape: HeadShape, embed_tokens: torch.Tensor,
                 draft_ids: torch.Tensor) -> None:
        super().__init__()
        s = shape
        self.shape = s
        h, nh, nkv, hd = s.hidden_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim
        self.fc = nn.Linear(len(s.capture_layers) * h, h, bias=False)
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)
        self.gate_proj = nn.Linear(h, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, h, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, s.draft_vocab_size, bias=False)
        # the target's embedding is borrowed, frozen: a buffer that is never exported
        self.register_buffer("embed_tokens", embed_tokens.detach().float(), persistent=False)
        draft_ids = draft_ids.long()
        assert draft_ids.numel() == s.draft_vocab_size
        self.register_buffer("draft_ids", draft_ids)  # draft id d -> target id draft_ids[d]
        self.register_buffer("inv_freq", rope_inv_freq(hd, s.rope_theta, s.rope_scaling),
                             persistent=False)

    # ---- init -------------------------------------------------------------------------------
    def init_from_target(self, lm_head_weight: torch.Tensor, final_norm: torch.Tensor) -> None:
        """Start the output side as the target's: LM-head rows of the draft vocabulary and the
        target's final norm, so the layer only has to learn to produce a final-layer-like
        hidden state; and zero the residual branches' outputs so training starts from
        h = fc(features)."""
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_weight[self.draft_ids].float())
            self.norm.copy_(final_norm.float())
            std = 0.02
            for lin in (self.fc, self.q_proj, self.k_proj, self.v_proj, self.gate_proj,
                        self.up_proj):
                nn.init.normal_(lin.weight, std=std)
            nn.init.normal_(self.o_proj.weight, std=std / math.sqrt(2))
            nn.init.normal_(self.down_proj.weight, std=std / math.sqrt(2))

    # ---- forward ------------------------------------------------------------------------------
    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, hd/2]
        return freqs.cos()[:, :, None], freqs.sin()[:, :, None]  # [B, T, 1, hd/2]

    def _qkv(self, embeds, hidden, positions):
        s = self.shape
        b, t, _ = hidden.shape
        x = torch.cat((_rms(embeds, self.input_layernorm, s.rms_norm_eps),
                       _rms(hidden, self.hidden_norm, s.rms_norm_eps)), dim=-1)
        q = self.q_proj(x).view(b, t, s.num_attention_heads, s.head_dim)
        k = self.k_proj(x).view(b, t, s.num_key_value_heads, s.head_dim)
        v = self.v_proj(x).view(b, t, s.num_key_value_heads, s.head_dim)
        cos, sin = self._cos_sin(positions)
        q = apply_rotary(q.reshape(b * t, -1, s.head_dim), cos.reshape(b * t, 1, -1),
                         sin.reshape(b * t, 1, -1)).view_as(q)
        k = apply_rotary(k.reshape(b * t, -1, s.head_dim), cos.reshape(b * t, 1, -1),
                         sin.reshape(b * t, 1, -1)).view_as(k)
        # [B, heads, T, hd]
        rep = s.num_attention_heads // s.num_key_value_heads
        k = k.transpose(1, 2).repeat_interleave(rep, dim=1)
        v = v.transpose(1, 2).repeat_interleave(rep, dim=1)
        return q.transpose(1, 2), k, v

    def _finish(self, hidden, attn):
        s = self.shape
        b, t, _ = hidden.shape
        h = hidden + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        x = _rms(h, self.post_attention_layernorm, s.rms_norm_eps)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(_rms(h, self.norm, self.shape.rms_norm_eps))

    def forward(
        self, features: torch.Tensor, tokens: torch.Tensor, attn_mask: torch.Tensor,
        steps: int,
    ) -> list[torch.Tensor]:
        """features [B, T, 3H] (F_t), tokens [B, T] (x_t), attn_mask [B, T] bool (real rows).

        Returns `steps` hidden tensors h_k [B, T, H]: row t of h_k predicts x_{t+2+k}
        (`logits(h_k)`); rows past a sequence's end are garbage and must be masked by the loss.
        Step k reads tokens x_{t+1+k}: rows whose token falls off the end read padding.
        """
        b, t, _ = features.shape
        scale = self.shape.head_dim ** -0.5
        pos = torch.arange(t, device=features.device).expand(b, t)
        # step 0: causal over real rows
        h_prev = self.fc(features)
        emb = F.embedding(_shift(tokens, 1), self.embed_tokens)
        q, k0, v0 = self._qkv(emb, h_prev, pos)
        causal = torch.ones(t, t, dtype=torch.bool, device=features.device).tril()
        mask0 = causal[None, None] & attn_mask[:, None, None, :]  # [B, 1, T, T]
        s0 = torch.matmul(q, k0.transpose(-1, -2)) * scale  # [B, heads, T, T]
        s0 = s0.masked_fill(~mask0, float("-inf"))
        out = [self._finish(h_prev, torch.matmul(torch.softmax(s0, -1), v0))]
        ks, vs = [], []  # own-chain keys/values of steps 1..k: [B, heads, T, hd] each
        for step in range(1, steps):
            h_prev = out[-1]
            emb = F.embedding(_shift(tokens, 1 + step), self.embed_tokens)
            q, kk, vv = self._qkv(emb, h_prev, pos + step)
            ks.append(kk)
            vs.append(vv)
            s_prefix = torch.matmul(q, k0.transpose(-1, -2)) * scale
            s_prefix = s_prefix.masked_fill(~mask0, float("-inf"))  # [B, heads, T, T]
            s_diag = torch.stack([(q * kj).sum(-1) * scale for kj in ks], dim=-1)  # [B,h,T,k]
            p = torch.softmax(torch.cat((s_prefix, s_diag), dim=-1), dim=-1)
            attn = torch.matmul(p[..., :t], v0) + sum(
                p[..., t + j, None] * vj for j, vj in enumerate(vs))
            out.append(self._finish(h_prev, attn))
        return out

    # ---- export ------------------------------------------------------------------------------
    def public_state(self, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
        """The public EAGLE-3 tensors (SpecForge / SGLang key names)."""
        w = {
            "fc.weight": self.fc.weight,
            "midlayer.input_layernorm.weight": self.input_layernorm,
            "midlayer.hidden_norm.weight": self.hidden_norm,
            "midlayer.post_attention_layernorm.weight": self.post_attention_layernorm,
            "norm.weight": self.norm, "lm_head.weight": self.lm_head.weight,
        }
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w[f"midlayer.self_attn.{name}.weight"] = getattr(self, name).weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            w[f"midlayer.mlp.{name}.weight"] = getattr(self, name).weight
        out = {k: v.detach().to(dtype).cpu().contiguous() for k, v in w.items()}
        d = torch.arange(self.shape.draft_vocab_size)
        out["d2t"] = (self.draft_ids.cpu() - d).contiguous()
        t2d = torch.zeros(self.shape.target_vocab_size, dtype=torch.bool)
        t2d[self.draft_ids.cpu()] = True
        out["t2d"] = t2d
        return out

    def export(self, out_dir: str | Path, dtype: torch.dtype = torch.float16,
               extra_config: dict | None = None) -> Path:
        """config.json + model.safetensors that `load_draft_head` (and SGLang) read."""
        s = self.shape
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(self.public_state(dtype), str(out / "model.safetensors"),
                  metadata={"format": "pt"})
        config = {**eagle3_config_json(s, s.target_vocab_size, s.draft_vocab_size,
                                       s.capture_layers, dtype), **(extra_config or {})}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return out


def _shift(tokens: torch.Tensor, n: int) -> torch.Tensor:
    """tokens[:, t + n] at column t; columns past the end read token 0 (masked by the loss)."""
    return torch.cat((tokens[:, n:], tokens.new_zeros(tokens.shape[0], n)), dim=1)
