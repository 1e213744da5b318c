"""A plain-torch EAGLE head for tests, written from the public key names alone: no KV cache, no
fused weights, no runtime modules. Rows run causally at positions 0..T-1.

EAGLE-1/2: x = fc(cat(embed, hidden)); h = x + attn(input_layernorm?(x)); h += mlp(post(h));
logits = target lm_head(h). EAGLE-3: x = fc(fused) (or the previous row's output);
h = x + attn(cat(input_layernorm(embed), hidden_norm(x))); h += mlp(post(h));
logits = lm_head(norm(h)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    # x [T, heads, d]; rotate-half pairs (i, i + d/2)
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = positions.double()[:, None] * inv_freq[None]  # [T, d/2]
    cos, sin = angles.cos().float()[:, None], angles.sin().float()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def causal_attention(x: torch.Tensor, w: dict, p: str, cfg: dict) -> torch.Tensor:
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    n = x.shape[0]
    positions = torch.arange(n)
    q = rope((x @ w[p + "q_proj.weight"].T).view(n, heads, d), positions, cfg["rope_theta"])
    k = rope((x @ w[p + "k_proj.weight"].T).view(n, kv_heads, d), positions, cfg["rope_theta"])
    v = (x @ w[p + "v_proj.weight"].T).view(n, kv_heads, d)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    return out @ w[p + "o_proj.weight"].T


def mlp(x: torch.Tensor, w: dict, p: str) -> torch.Tensor:
    gate, up = x @ w[p + "gate_proj.weight"].T, x @ w[p + "up_proj.weight"].T
    return (F.silu(gate) * up) @ w[p + "down_proj.weight"].T


def reference_head(
    kind: str, w: dict, cfg: dict, target: dict, tokens: list[int],
    hiddens: list[torch.Tensor | None], norm_before_lm_head: bool = False,
    target_eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [T, vocab or draft_vocab] and outputs [T, H] of head `w` (public keys) over rows
    (tokens[t], hiddens[t]). hiddens[t] is the target feature ([H] EAGLE-1, [3H] EAGLE-3) or
    None: the previous row's output (EAGLE-3 then skips fc). `target`: the target's tensors."""
    eps = cfg["rms_norm_eps"]
    embed = w.get("embed_tokens.weight", target["model.embed_tokens.weight"])
    p = "layers.0." if kind == "eagle" else "midlayer."
    xs: list[torch.Tensor] = []  # per row: the residual stream entering attention [H]
    outs: list[torch.Tensor] = []
    for t, (token, hidden) in enumerate(zip(tokens, hiddens)):
        e = embed[token]
        if kind == "eagle":
            h_in = hidden if hidden is not None else outs[-1]
            x = torch.cat((e, h_in)) @ w["fc.weight"].T
            xs.append(x + w["fc.bias"] if "fc.bias" in w else x)
        else:
            xs.append(hidden @ w["fc.weight"].T if hidden is not None else outs[-1])
        # no KV cache: recompute the whole causal prefix and keep row t
        x = torch.stack(xs)  # [t + 1, H]
        if kind == "eagle":
            ln = w.get(p + "input_layernorm.weight")
            attn_in = rms(x, ln, eps) if ln is not None else x
        else:
            e_rows = embed[torch.tensor(tokens[: t + 1])]
            attn_in = torch.cat(
                (rms(e_rows, w[p + "input_layernorm.weight"], eps),
                 rms(x, w[p + "hidden_norm.weight"], eps)), dim=-1,
            )
        h = x + causal_attention(attn_in, w, p + "self_attn.", cfg)
        h = h + mlp(rms(h, w[p + "post_attention_layernorm.weight"], eps), w, p + "mlp.")
        outs.append(h[t])
    out = torch.stack(outs)
    if kind == "eagle":
        final = rms(out, target["model.norm.weight"], target_eps) if norm_before_lm_head else out
        return final @ target["lm_head.weight"].T, out
    return rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T, out
