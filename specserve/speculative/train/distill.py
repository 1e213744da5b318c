"""Stage 3 for draft models: distil a STANDALONE draft model or an EARLY_EXIT exit adapter from
the target, on the same data, loop, checkpoints and exports as the EAGLE-3 head
(`trainer.Trainer`, whose hooks these subclass).

Both fit the target's next-token distribution at every answer position: soft cross-entropy
between the draft's distribution over the draft vocabulary and the target's (its stored final
hidden state through its own LM-head rows, renormalised over them), i.e. KL(target || draft).

STANDALONE (`DraftModelTrainer`): the draft is `draft_layers` of the target's decoder layers
(spread evenly: the first, the last and between; `draft_init.spread_layers`), its final norm
and its embedding / LM head (tied or not, frozen: the draft speaks the target's vocabulary with
the target's own output rows). Every decoder layer and the final norm train, causally over the
whole sequence (teacher forcing). Export: an ordinary Hugging Face Llama directory (`draft/`:
config, bfloat16 safetensors with every tensor, the target's tokenizer files) that any runtime
loads as a model.

EARLY_EXIT (`ExitAdapterTrainer`): the features are the hidden states leaving the target's first
E layers (captured at layer E); the adapter (`specserve/speculative/models/exit_adapter.py`) is a
residual SwiGLU MLP plus the target's final norm and LM-head rows of the draft vocabulary;
gate/up/down and the adapter's norm train (down starts at zero: the plain early exit). Export:
`adapter/`.

Metrics: `kl_0` (KL(target || draft) over the draft vocabulary), `acc_0` (draft top-1 equals the
target's top-1) and `chain_accept`: the mean accept length a `steps`-deep greedy chain would
reach if every drafted token were the target's top-1 (1 + the run of consecutive agreements
from each position) — exact on greedy-regenerated answers, a proxy on teacher-forced ones.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specserve.runtime.layers.rotary import apply_rotary, rope_inv_freq
from specserve.speculative.models.exit_adapter import AdapterShape, export_exit_adapter
from specserve.speculative.models.vocab_head import write_draft_vocab
from specserve.speculative.train.draft_init import TOKENIZER_FILES, spread_layers
from specserve.speculative.train.trainer import SoftCrossEntropy, TrainConfig, Trainer


@dataclass
class DistillConfig(TrainConfig):
    draft_layers: int = 4  # STANDALONE: target layers kept in the draft
    draft_layer_pick: str = "spread"  # STANDALONE: "spread" (first, last, between) or "first"
    exit_layer: int | None = None  # EARLY_EXIT: the layer the adapter reads (captured)
    adapter_size: int = 1024  # EARLY_EXIT: the adapter MLP's intermediate size
    medusa_heads: int = 3  # MEDUSA: heads (draft depth)
    medusa_layers: int = 1  # MEDUSA: ResBlocks per head
    mlp_stages: int = 3  # MLP_SPECULATOR: stages (n_predict, the draft depth)
    mlp_inner_dim: int = 256  # MLP_SPECULATOR: the stages' width


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


# ---- the shared loss ------------------------------------------------------------------------
def distill_losses(draft_z: torch.Tensor, target_final: torch.Tensor, target_w: torch.Tensor,
                   need: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """draft_z [M, Vd] draft logits of the rows `need` [B, T] selects; target_final [M, H] the
    target's final hidden states of the same rows. Returns (mean soft CE, metrics with the
    agreement matrix `_hits` [B, T])."""
    with torch.no_grad():
        tz = target_final @ target_w.T
        lse = torch.logsumexp(tz, dim=-1)
        p = torch.exp(tz - lse[:, None])
        ent = lse - torch.bmm(p.unsqueeze(1), tz.unsqueeze(2)).view(-1)
    ce = SoftCrossEntropy.apply(draft_z, p)
    loss = ce.mean() if ce.numel() else draft_z.sum() * 0
    with torch.no_grad():
        hit = draft_z.argmax(-1) == tz.argmax(-1)
        hits = torch.zeros_like(need)
        hits[need] = hit
        m = {"loss_0": float(loss), "kl_0": float((ce - ent).mean()) if ce.numel() else 0.0,
             "acc_0": float(hit.float().mean()) if hit.numel() else 0.0,
             "_hits": hits, "_need": need}
    return loss, m


def chain_accept_from_hits(m: dict, steps: int) -> tuple[float, int]:
    """Mean 1 + run of consecutive agreements (at most `steps`) over the rows whose next
    `steps` rows are all scored."""
    hits, need = m["_hits"], m["_need"]
    t = hits.shape[1]
    if t < steps:
        return 0.0, 0
    r = t - steps + 1
    ok = torch.ones_like(need[:, :r])
    run = torch.ones(hits.shape[0], r, device=hits.device)
    length = torch.ones_like(run)
    for j in range(steps):
        ok &= need[:, j: j + r]
        run = run * hits[:, j: j + r].float()
        length = length + run
    n = int(ok.sum())
    return (float(length[ok].sum()) / n if n else 0.0), n


def _answer_rows(batch: dict) -> torch.Tensor:
    """[B, T] rows whose next token is an answer token (row u's distribution is of token u+1)."""
    t = batch["tokens"].shape[1]
    pos = torch.arange(t, device=batch["tokens"].device)
    real = pos[None] < batch["lengths"][:, None]
    return real & (pos[None] + 1 >= batch["prompt"][:, None])


# ---- STANDALONE: a draft model made of target layers ------------------------------------------
class _Layer(nn.Module):
    """One Llama decoder layer (HF parameter names under `self_attn` / `mlp`)."""

    def __init__(self, h: int, inter: int, nh: int, nkv: int, hd: int) -> None:
        super().__init__()
        def lin(i: int, o: int) -> nn.Linear:
            return nn.Linear(i, o, bias=False)

        self.self_attn = nn.ModuleDict({
            "q_proj": lin(h, nh * hd), "k_proj": lin(h, nkv * hd), "v_proj": lin(h, nkv * hd),
            "o_proj": lin(nh * hd, h),
        })
        self.mlp = nn.ModuleDict({
            "gate_proj": lin(h, inter), "up_proj": lin(h, inter), "down_proj": lin(inter, h),
        })
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))


class TrainableDraftLlama(nn.Module):
    """A causal Llama over whole padded sequences (right padding: causal attention alone keeps
    real rows off the padding). The embedding (and LM head) stay the target's, frozen."""

    def __init__(self, mc, embed: torch.Tensor, num_layers: int) -> None:
        super().__init__()
        self.mc = mc
        self.layers = nn.ModuleList(
            _Layer(mc.hidden_size, mc.intermediate_size, mc.num_attention_heads,
                   mc.num_key_value_heads, mc.head_dim) for _ in range(num_layers))
        self.norm = nn.Parameter(torch.ones(mc.hidden_size))
        self.register_buffer("embed_tokens", embed.detach().float(), persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(mc.head_dim, mc.rope_theta,
                                                       mc.rope_scaling), persistent=False)

    def load_target_layers(self, target_dir: str | Path, layers: list[int],
                           final_norm: torch.Tensor) -> None:
        from specserve.runtime.model_loader.hf_dir import iter_safetensors_weights

        where = {src: dst for dst, src in enumerate(layers)}
        loaded = 0
        with torch.no_grad():
            for name, w in iter_safetensors_weights(str(target_dir)):
                parts = name.removeprefix("model.").split(".")
                if parts[0] != "layers" or int(parts[1]) not in where:
                    continue
                layer = self.layers[where[int(parts[1])]]
                rest = parts[2:]
                if rest[0] in ("input_layernorm", "post_attention_layernorm"):
                    getattr(layer, rest[0]).copy_(w.float())
                else:
                    getattr(layer, rest[0])[rest[1]].weight.copy_(w.float())
                loaded += 1
            self.norm.copy_(final_norm.float())
        if loaded != 9 * len(layers):
            raise ValueError(f"loaded {loaded} tensors for {len(layers)} layers (9 each)")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> final hidden states [B, T, H] (after the final norm)."""
        mc = self.mc
        b, t = tokens.shape
        nh, nkv, hd, eps = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, \
            mc.rms_norm_eps
        x = F.embedding(tokens, self.embed_tokens)
        pos = torch.arange(t, device=tokens.device)
        freqs = pos.float()[:, None] * self.inv_freq
        cos = freqs.cos()[None, :, None].expand(b, t, 1, -1).reshape(b * t, 1, -1)
        sin = freqs.sin()[None, :, None].expand(b, t, 1, -1).reshape(b * t, 1, -1)
        for layer in self.layers:
            a = layer.self_attn
            y = _rms(x, layer.input_layernorm, eps)
            q = apply_rotary(a["q_proj"](y).view(b * t, nh, hd), cos, sin).view(b, t, nh, hd)
            k = apply_rotary(a["k_proj"](y).view(b * t, nkv, hd), cos, sin).view(b, t, nkv, hd)
            v = a["v_proj"](y).view(b, t, nkv, hd)
            rep = nh // nkv
            k = k.transpose(1, 2).repeat_interleave(rep, dim=1)
            v = v.transpose(1, 2).repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)
            x = x + a["o_proj"](o.transpose(1, 2).reshape(b, t, nh * hd))
            y = _rms(x, layer.post_attention_layernorm, eps)
            m = layer.mlp
            x = x + m["down_proj"](F.silu(m["gate_proj"](y)) * m["up_proj"](y))
        return _rms(x, self.norm, eps)

    def hf_state(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        out = {"model.norm.weight": self.norm}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = layer.input_layernorm
            out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm
            for group in ("self_attn", "mlp"):
                for name, lin in getattr(layer, group).items():
                    out[f"{p}{group}.{name}.weight"] = lin.weight
        return {k: v.detach().to(dtype).cpu().contiguous() for k, v in out.items()}


class DraftModelTrainer(Trainer):
    desc = "distil STANDALONE draft"
    export_name = "draft"

    def build_model(self, mc, embed, lm_head, final_norm, draft_ids):
        from specserve.runtime.model_loader.default_model import resolve_model_path

        self.target_dir = resolve_model_path(
            None if self.cfg.target_model == "default" else self.cfg.target_model)
        n, k = mc.num_hidden_layers, self.cfg.draft_layers
        if self.cfg.draft_layer_pick == "first":
            if not 1 <= k <= n:
                raise ValueError(f"a draft of {k} layers from a {n}-layer target")
            self.layers = list(range(k))
        else:
            self.layers = spread_layers(n, k)
        model = TrainableDraftLlama(mc, embed, len(self.layers))
        model.load_target_layers(self.target_dir, self.layers, final_norm)
        self._embed, self._lm_head = embed, lm_head
        return model

    def losses(self, batch):
        need = _answer_rows(batch)
        h = self.model(batch["tokens"])
        return distill_losses(h[need] @ self.target_w.T, batch["final"][need], self.target_w,
                              need)

    def chain_accept(self, metrics):
        return chain_accept_from_hits(metrics, self.cfg.steps)

    def export(self, path: Path) -> Path:
        """An ordinary HF Llama directory: the trained layers and norm, the target's embedding
        (and LM head when untied), config and tokenizer files."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        cfg = json.loads((Path(self.target_dir) / "config.json").read_text())
        dtype = torch.bfloat16
        state = self.model.hf_state(dtype)
        state["model.embed_tokens.weight"] = self._embed.to(dtype).contiguous()
        if not cfg.get("tie_word_embeddings", False):
            state["lm_head.weight"] = self._lm_head.to(dtype).contiguous()
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        cfg = {k: v for k, v in cfg.items() if not k.startswith("specserve")}
        cfg.update(num_hidden_layers=len(self.layers), torch_dtype="bfloat16",
                   architectures=["LlamaForCausalLM"],
                   specserve_training={
                       "algorithm": "STANDALONE", "target_layers": self.layers,
                       "train_tokens_seen": self.pos["tokens"],
                       "optimizer_steps": self.pos["step"],
                       "train_seconds": round(self.pos["elapsed_s"])})
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        for name in TOKENIZER_FILES:
            if (Path(self.target_dir) / name).exists():
                shutil.copy(Path(self.target_dir) / name, out / name)
        if len(self.draft_ids) < self.target_config.vocab_size:
            write_draft_vocab(out, self.draft_ids)  # the vocabulary it was distilled on
        return out


# ---- EARLY_EXIT: an exit adapter --------------------------------------------------------------
class TrainableExitAdapter(nn.Module):
    """The trainable twin of `ExitAdapter` (same function; export writes what it loads)."""

    def __init__(self, h: int, inter: int, eps: float, final_norm: torch.Tensor) -> None:
        super().__init__()
        self.eps = eps
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.norm = nn.Parameter(torch.ones(h))
        self.register_buffer("final_norm", final_norm.detach().float().clone())
        with torch.no_grad():
            std = 0.02
            nn.init.normal_(self.gate_proj.weight, std=std)
            nn.init.normal_(self.up_proj.weight, std=std)
            nn.init.zeros_(self.down_proj.weight)  # starts as the plain early exit

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = _rms(hidden, self.norm, self.eps)
        h = hidden + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return _rms(h, self.final_norm, self.eps)


class ExitAdapterTrainer(Trainer):
    desc = "train EARLY_EXIT adapter"
    export_name = "adapter"

    def build_model(self, mc, embed, lm_head, final_norm, draft_ids):
        layers = self.store.capture_layers
        if len(layers) != 1:
            raise ValueError(f"an exit adapter reads one layer's hidden states; the features "
                             f"hold layers {layers}: capture with --exit-layer E")
        if self.cfg.exit_layer is not None and self.cfg.exit_layer != layers[0]:
            raise ValueError(f"features were captured at layer {layers[0]}, not "
                             f"--exit-layer {self.cfg.exit_layer}: use a new --output")
        self.exit_layer = layers[0]
        self.mc = mc
        self._final_norm = final_norm
        return TrainableExitAdapter(mc.hidden_size, self.cfg.adapter_size, mc.rms_norm_eps,
                                    final_norm)

    def losses(self, batch):
        need = _answer_rows(batch)
        h = self.model(batch["feats"][need])
        return distill_losses(h @ self.target_w.T, batch["final"][need], self.target_w, need)

    def chain_accept(self, metrics):
        return chain_accept_from_hits(metrics, self.cfg.steps)

    def export(self, path: Path) -> Path:
        mc = self.mc
        shape = AdapterShape(
            exit_layer=self.exit_layer, num_target_layers=mc.num_hidden_layers,
            hidden_size=mc.hidden_size, intermediate_size=self.cfg.adapter_size,
            draft_vocab_size=len(self.draft_ids), target_vocab_size=mc.vocab_size,
            rms_norm_eps=mc.rms_norm_eps)
        m = self.model
        tensors = {"gate_proj.weight": m.gate_proj.weight, "up_proj.weight": m.up_proj.weight,
                   "down_proj.weight": m.down_proj.weight, "norm.weight": m.norm,
                   "final_norm.weight": self._final_norm, "lm_head.weight": self.target_w,
                   "draft_ids": self.draft_ids}
        return export_exit_adapter(path, shape, tensors, extra_config={"specserve_training": {
            "algorithm": "EARLY_EXIT", "target": str(mc.model_dir),
            "train_tokens_seen": self.pos["tokens"], "optimizer_steps": self.pos["step"],
            "train_seconds": round(self.pos["elapsed_s"]),
            "draft_vocab_coverage": round(self.coverage, 4)}})


def _medusa_trainer(cfg):
    from specserve.speculative.train.medusa_train import MedusaTrainer

    return MedusaTrainer(cfg)


def _mlp_trainer(cfg):
    from specserve.speculative.train.mlp_train import MlpSpeculatorTrainer

    return MlpSpeculatorTrainer(cfg)


TRAINERS = {"STANDALONE": DraftModelTrainer, "EARLY_EXIT": ExitAdapterTrainer,
            "MEDUSA": _medusa_trainer, "MLP_SPECULATOR": _mlp_trainer}


def default_exit_layer(num_layers: int) -> int:
    """EARLY_EXIT's default E (specserve/speculative/drafters/early_exit.py): a quarter of the
    layers."""
    return max(1, num_layers // 4)


def lr_default(algorithm: str) -> float:
    """A draft model starts from trained layers: a gentler rate than a head trained from
    scratch."""
    return {"STANDALONE": 1e-4, "EARLY_EXIT": 1e-3}.get(algorithm, 1e-3)



