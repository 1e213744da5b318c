"""An MLPSpeculator for a target: `python -m specserve.speculative.train --algorithm
MLP_SPECULATOR --output DIR`.

Same stages as the EAGLE-3 and Medusa trainers (regen / capture / train / eval / report,
resumable); the capture keeps only the target's final (normed) hidden state. With teacher
forcing, stage i at row t reads the state stage i - 1 left there (stage 0: the target's final
hidden state of position t) and the actual token t + 1 + i, and is trained toward the target's
own distribution of token t + 2 + i (its LM head on the final hidden state of position
t + 1 + i): soft cross-entropy over the draft vocabulary, weighted `step_decay ** i`, answer
rows only. Serving feeds each stage the draft before it, which is the actual token whenever
that draft is accepted, so the loss scores exactly the drafts that can count.

The speculator is tied (one embedding, norm and head for every stage, one projection for the
stages after the first), scales its input (the reference's `scale_input`) and speaks a reduced
draft vocabulary (specserve/speculative/models/mlp_speculator.py). Its embedding and head start
from the target's embedding rows of the draft vocabulary, projected on their top `inner_dim`
principal directions: tokens the target embeds alike start alike. The export is the public
layout (bfloat16) plus the draft vocabulary.

Metrics as the other trainers': `acc_i` (stage i's top-1 equals the token on greedy answers)
and `chain_accept` (a chain of the stages' top-1 drafts, 1 + consecutive hits).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from specserve.speculative.models.mlp_speculator import (
    MlpSpeculator,
    MlpSpeculatorConfig,
    save_mlp_speculator,
)
from specserve.speculative.train.trainer import SoftCrossEntropy, Trainer, chain_accept


def principal_rows(rows: torch.Tensor, dim: int) -> torch.Tensor:
    """`rows` [n, H] centred and projected on their top `dim` principal directions, scaled to
    the reference's initial spread (std 1 / sqrt(dim)) -> [n, dim]."""
    x = rows.float() - rows.float().mean(0)
    _, _, vh = torch.linalg.svd(x, full_matrices=False)
    p = x @ vh[:dim].T
    return p / p.std().clamp_min(1e-6) / math.sqrt(dim)


def build_speculator(hidden: int, vocab: int, embed: torch.Tensor, draft_ids: torch.Tensor,
                     inner: int, stages: int) -> MlpSpeculator:
    reduced = len(draft_ids) < vocab
    cfg = MlpSpeculatorConfig(hidden, inner, vocab, stages, tie_weights=True, scale_input=True,
                              draft_vocab_size=len(draft_ids) if reduced else None)
    model = MlpSpeculator(cfg, draft_ids if reduced else None)
    std = 1 / math.sqrt(inner)
    with torch.no_grad():
        init = principal_rows(embed[draft_ids], min(inner, hidden))
        for p in model.parameters():
            torch.nn.init.trunc_normal_(p, 0.0, std, -2 * std, 2 * std)
        model.emb[0].weight[: len(draft_ids), : init.shape[1]] = init
        model.head[0].weight[:, : init.shape[1]] = init
        model.ln[0].weight.fill_(1.0)
        model.ln[0].bias.zero_()
    return model


def mlp_losses(model: MlpSpeculator, batch: dict, target_w: torch.Tensor, step_decay: float
               ) -> tuple[torch.Tensor, dict]:
    final, tokens = batch["final"], batch["tokens"]
    b, t, _ = final.shape
    pos = torch.arange(t, device=final.device)
    lengths, prompt = batch["lengths"][:, None], batch["prompt"][:, None]
    # the target's distribution at every position u whose next token is an answer token
    need = (pos[None] < lengths) & (pos[None] + 1 >= prompt)
    with torch.no_grad():
        target_z = final[need] @ target_w.T  # [N, Vd]
        lse = torch.logsumexp(target_z, dim=-1)
        target_p = torch.exp(target_z - lse[:, None])
        ent = lse - torch.bmm(target_p.unsqueeze(1), target_z.unsqueeze(2)).view(-1)
        del target_z
        where = torch.full((b, t), -1, dtype=torch.long, device=final.device)
        where[need] = torch.arange(int(need.sum()), device=final.device)
    state = model.scale_input(final)
    rows = model.emb_index[tokens]  # [B, T] emb rows of the actual tokens
    total, metrics = final.new_zeros(()), {}
    for i in range(model.cfg.n_predict):
        n = t - 2 - i  # row u of stage i: token u + 1 + i in, token u + 2 + i out
        if n <= 0:
            break
        state = model.stage(i, state[:, :n], rows[:, 1 + i: 1 + i + n])
        label = pos[:n] + 2 + i
        sel = (label[None] < lengths) & (label[None] >= prompt)  # [B, n]
        if not bool(sel.any()):
            continue
        z = model.logits(i, state[sel])  # [M, Vd]
        at = where[:, 1 + i: 1 + i + n][sel]
        ce = SoftCrossEntropy.apply(z, target_p[at])
        total = total + step_decay ** i * ce.mean()
        with torch.no_grad():
            scored = sel & batch["greedy"][:, None]
            hit = torch.zeros_like(scored)
            hit[sel] = model.draft_ids[z.argmax(-1)] == tokens[:, 2 + i: 2 + i + n][sel]
            hit &= scored
            metrics[f"loss_{i}"] = float(ce.mean())
            metrics[f"kl_{i}"] = float((ce - ent[at]).mean())
            metrics[f"acc_{i}"] = float(hit.sum()) / max(float(scored.sum()), 1.0)
            metrics[f"_hits_{i}"] = (hit, scored)
    return total, metrics


class MlpSpeculatorTrainer(Trainer):
    desc = "train MLP_SPECULATOR"
    export_name = "mlp_speculator"

    def build_model(self, mc, embed, lm_head, final_norm, draft_ids):
        if self.store.capture_layers:
            raise ValueError(f"an MLPSpeculator reads the final hidden state only; the features "
                             f"hold layers {self.store.capture_layers}: use a new --output")
        self.mc = mc
        return build_speculator(mc.hidden_size, mc.vocab_size, embed, draft_ids,
                                self.cfg.mlp_inner_dim, self.cfg.mlp_stages)

    def losses(self, batch):
        return mlp_losses(self.model, batch, self.target_w, self.cfg.step_decay)

    def chain_accept(self, metrics):
        return chain_accept(metrics, self.cfg.mlp_stages)

    def export(self, path: Path) -> Path:
        model = MlpSpeculator(self.model.cfg, self.model.draft_ids.cpu())
        model.load_state_dict({k: v.detach().cpu() for k, v in self.model.state_dict().items()})
        return save_mlp_speculator(model, path, torch.bfloat16, {"specserve_training": {
            "algorithm": "MLP_SPECULATOR", "base_model": str(self.mc.model_dir),
            "train_tokens_seen": self.pos["tokens"], "optimizer_steps": self.pos["step"],
            "train_seconds": round(self.pos["elapsed_s"]),
            "draft_vocab_coverage": round(self.coverage, 4)}})
