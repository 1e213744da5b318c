"""An output head over a reduced draft vocabulary: the target's LM-head rows of `ids` (sorted
target token ids), returning logits over the whole vocabulary with -inf outside `ids`.

A 135M target's LM head (49152 x 576) is a third of its bytes per step, and a draft that speaks
its vocabulary pays it again per draft token; the few thousand most frequent answer tokens cover
most of what a draft ever proposes (EAGLE-3's draft vocabulary is the same idea). Drafts only:
the draft's q is zero outside `ids`, which greedy verification ignores and sampling
verification handles losslessly (the residual restores that mass).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specserve.runtime.layers.linear import Linear

VOCAB_FILE = "draft_vocab.safetensors"  # beside a draft model's weights: {"draft_ids": [Vd]}


def scatter_to_vocab(z: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, Vd] logits of `ids` -> [n, vocab_size], -inf elsewhere."""
    out = z.new_full((z.shape[0], vocab_size), float("-inf"))
    out[:, ids] = z
    return out


class ReducedVocabHead(nn.Module):
    def __init__(self, lm_head_rows: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        self.lm_head = Linear(lm_head_rows.shape[1], lm_head_rows.shape[0])
        self.lm_head.weight.data = lm_head_rows.detach().float().contiguous()
        self.register_buffer("ids", ids.long())
        self.vocab_size = vocab_size

    @torch.inference_mode()
    def forward(self, normed_hidden: torch.Tensor) -> torch.Tensor:
        z = self.lm_head(normed_hidden.float()).float()
        return scatter_to_vocab(z, self.ids, self.vocab_size)

    def pack_weights(self, compute_dtype, threads: int | None = None) -> int:
        return int(self.lm_head.pack(compute_dtype, threads))


def write_draft_vocab(model_dir: str | Path, ids: torch.Tensor) -> Path:
    p = Path(model_dir) / VOCAB_FILE
    save_file({"draft_ids": ids.long().sort().values.contiguous()}, str(p))
    return p


def read_draft_vocab(model_dir: str | Path) -> torch.Tensor | None:
    p = Path(model_dir) / VOCAB_FILE
    return load_file(str(p))["draft_ids"].long() if p.exists() else None
