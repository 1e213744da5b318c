"""An `MlpSpeculator`'s stages as the drafter runs them: weights packed once, one call per run.

Right after a target forward has streamed its weights through the caches, each small torch op
costs tens of microseconds, and a stage in torch is a dozen of them. With the CPU extension the
stages run in the engine (`MlpStages`, specserve/kernels/cpu/csrc/engine.cpp): one call runs a
tree level over every request's frontier, or a whole chain (each stage fed the previous one's
top-1), with the matmuls in q8_0 / q4_0 blocks (int8 activations), the state weight (and
scale_input's 1 / sqrt(2)) folded into the packed projections and the embedding tables
pre-scaled. Without it (or in bf16 / fp32) the same stages run as torch ops. Tied stages share
one packed copy.

Drafts only: verification is the target's, so the rounding here changes acceptance at most,
never output.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from specserve.runtime.layers.linear import DRAFT_ACTIVATION_DIGITS, Linear
from specserve.speculative.models.mlp_speculator import EPS, MlpSpeculator, rms_normalize


class StageRun(NamedTuple):
    state: Tensor  # [M, inner] after the last stage run
    logits: Tensor  # [M, Vd] of the last stage run
    logq: list  # [stages][M][k] log q of each row's k best draft ids
    tokens: list  # [stages][M][k] their target ids


def _packed(weight: Tensor, scale: float, fmt, threads: int) -> Linear:
    lin = Linear(weight.shape[1], weight.shape[0])
    lin.weight.data = (weight.detach().float() * scale).contiguous()
    if fmt != torch.float32:
        lin.pack(fmt, threads)
    return lin


class PackedStages:
    """`model`'s stages with matmuls in `fmt` ("q8_0" / "q4_0", torch.bfloat16 or
    torch.float32)."""

    def __init__(self, model: MlpSpeculator, fmt, threads: int) -> None:
        c = self.cfg = model.cfg
        self.threads = threads
        shared: dict[tuple, object] = {}

        def once(key, make):
            if key not in shared:
                shared[key] = make()
            return shared[key]

        first = c.state_weight / (math.sqrt(2) if c.scale_input else 1.0)
        self.emb = [once(("e", id(m)), lambda m=m: (m.weight.detach().float() * c.emb_weight)
                         .contiguous()) for m in model.emb]  # [rows, inner] each
        self.proj = [once(("p", id(m), i == 0), lambda m=m, i=i: _packed(
            m.weight, first if i == 0 else c.state_weight, fmt, threads))
            for i, m in enumerate(model.proj)]
        self.head = [once(("h", id(m)), lambda m=m: _packed(m.weight, 1.0, fmt, threads))
                     for m in model.head]
        self.ln = [(m.weight.detach().float().clone(), m.bias.detach().float().clone())
                   for m in model.ln]
        self.draft_ids = model.draft_ids.clone()  # [Vd] target id of each draft id
        self.emb_index = model.emb_index.tolist()  # target id -> emb row (Python: per root)
        self.to_target = self.draft_ids.tolist()
        self.core = None  # the engine's MlpStages, when every matmul is packed for it
        if all(lin.blocks is not None for lin in self.proj + self.head):
            from specserve.kernels import cpu

            self.ext = cpu.load()
            self.core = self.ext.MlpStages(
                [p.blocks for p in self.proj], [h.blocks for h in self.head], self.emb,
                [w for w, _ in self.ln], [b for _, b in self.ln], EPS,
                DRAFT_ACTIVATION_DIGITS, threads)
            self._ones = torch.ones(c.emb_dim)

    def first_state(self, hidden: Tensor) -> Tensor:
        """[B, H] the target's final hidden rows -> stage 0's input (1 / sqrt(2) is in proj 0)."""
        if not self.cfg.scale_input:
            return hidden.float()
        if self.core is not None:
            return self.ext.rmsnorm(hidden, self._ones, EPS)
        return rms_normalize(hidden.float())

    def run(self, first: int, count: int, state: Tensor, rows: list[int], k: int) -> StageRun:
        """Stages [first, first + count) over input states [M, K_first] and emb rows [M]; a
        stage after the first reads each row's top-1 of the one before (a chain)."""
        rows_t = torch.tensor(rows, dtype=torch.int64, device=state.device)
        if self.core is not None:
            s, logits, lse, vals, ids = self.core.run(state, rows_t, first, count, k)
            logq = (vals - lse[:, :, None]).tolist()
            ids = ids.tolist()
        else:
            logq, ids = [], []
            for i in range(first, first + count):
                state, logits = self._stage(i, state, rows_t)
                lq, top = torch.log_softmax(logits.float(), -1).topk(min(k, logits.shape[-1]))
                logq.append(lq.tolist())
                ids.append(top.tolist())
                rows_t = top[:, 0]
            s = state
        t = self.to_target
        return StageRun(s, logits, logq, [[[t[j] for j in row] for row in lv] for lv in ids])

    def _stage(self, i: int, state: Tensor, rows: Tensor) -> tuple[Tensor, Tensor]:
        """The torch path of stage i: (state [M, inner], logits [M, Vd])."""
        z = self.emb[i].index_select(0, rows) + self.proj[i](state)
        w, b = self.ln[i]
        s = F.gelu(rms_normalize(z, w, b))
        return s, self.head[i](s)
