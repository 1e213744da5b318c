"""Medusa heads for a target: `python -m specserve.speculative.train --algorithm MEDUSA --output
DIR`.

Same stages as the EAGLE-3 trainer (regen / capture / train / eval / report, resumable, progress
bars, plots); the capture keeps only the target's final (normed) hidden state. Head k on the
hidden state of position t is trained toward the target's own distribution of the token at
t + 2 + k (its LM head on the final hidden state of position t + 1 + k), soft cross-entropy over
the draft vocabulary, weighted `step_decay ** k`; answer rows only. Heads are tied: their output
goes through the target's LM head (specserve/speculative/models/medusa.py), so the export holds only
the ResBlocks (H x H + H per block) and serves with `--speculative-algorithm MEDUSA
--speculative-draft-model-path DIR/medusa`. ResBlocks start at zero (each head starts as the
target's own next-token head, as the Medusa paper initialises them).

Metrics as the EAGLE-3 trainer's: `acc_k` (head k's top-1 equals the token on greedy answers)
and `chain_accept` (a chain of the K heads' top-1 drafts, 1 + consecutive hits).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specserve.speculative.models.medusa import MedusaHeads, save_medusa
from specserve.speculative.train.trainer import SoftCrossEntropy, Trainer, chain_accept


class TrainableMedusa(nn.Module):
    def __init__(self, num_heads: int, num_layers: int, hidden: int) -> None:
        super().__init__()
        self.heads = MedusaHeads(num_heads, num_layers, hidden, 1, tied=True)
        for p in self.heads.parameters():
            nn.init.zeros_(p)

    def head(self, k: int, x: torch.Tensor) -> torch.Tensor:
        for block in self.heads.blocks[k]:
            x = block(x)
        return x


def medusa_losses(model: TrainableMedusa, batch: dict, target_w: torch.Tensor,
                  draft_ids: torch.Tensor, step_decay: float) -> tuple[torch.Tensor, dict]:
    final, tokens = batch["final"], batch["tokens"]
    b, t, _ = final.shape
    pos = torch.arange(t, device=final.device)
    total = final.new_zeros(())
    metrics: dict = {}
    for k in range(model.heads.num_heads):
        n_rows = t - 2 - k
        if n_rows <= 0:
            break
        label_pos = pos[:n_rows] + 2 + k  # [R] the token head k predicts from row t
        valid = label_pos[None] < batch["lengths"][:, None]  # [B, R]
        sel = valid & (label_pos[None] >= batch["prompt"][:, None])
        if not bool(sel.any()):
            continue
        z = model.head(k, final[:, :n_rows][sel]) @ target_w.T  # [M, Vd]
        with torch.no_grad():
            target_p = torch.softmax(final[:, 1 + k: 1 + k + n_rows][sel] @ target_w.T, -1)
        ce = SoftCrossEntropy.apply(z, target_p)
        loss_k = ce.mean()
        total = total + step_decay ** k * loss_k
        with torch.no_grad():
            scored = sel & batch["greedy"][:, None]
            hit = torch.zeros_like(scored)
            hit[sel] = draft_ids[z.argmax(-1)] == tokens[:, 2 + k: 2 + k + n_rows][sel]
            hit &= scored
            metrics[f"loss_{k}"] = float(loss_k)
            metrics[f"acc_{k}"] = float(hit.sum()) / max(float(scored.sum()), 1.0)
            metrics[f"_hits_{k}"] = (hit, scored)
    return total, metrics


class MedusaTrainer(Trainer):
    desc = "train MEDUSA heads"
    export_name = "medusa"

    def build_model(self, mc, embed, lm_head, final_norm, draft_ids):
        if self.store.capture_layers:
            raise ValueError(f"Medusa heads read the final hidden state only; the features hold "
                             f"layers {self.store.capture_layers}: use a new --output")
        self.mc = mc
        return TrainableMedusa(self.cfg.medusa_heads, self.cfg.medusa_layers, mc.hidden_size)

    def losses(self, batch):
        return medusa_losses(self.model, batch, self.target_w, self.draft_ids.to(self.device),
                             self.cfg.step_decay)

    def chain_accept(self, metrics):
        return chain_accept(metrics, self.cfg.medusa_heads)

    def export(self, path: Path) -> Path:
        heads = MedusaHeads(self.cfg.medusa_heads, self.cfg.medusa_layers,
                            self.mc.hidden_size, self.mc.vocab_size, tied=True)
        heads.load_state_dict({k: v.detach().cpu() for k, v in
                               self.model.heads.state_dict().items()})
        out = save_medusa(heads, path, base_model=str(self.mc.model_dir))
        import json

        cfg = json.loads((out / "config.json").read_text())
        cfg["specserve_training"] = {
            "algorithm": "MEDUSA", "train_tokens_seen": self.pos["tokens"],
            "optimizer_steps": self.pos["step"], "train_seconds": round(self.pos["elapsed_s"]),
            "draft_vocab_coverage": round(self.coverage, 4)}
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        return out
