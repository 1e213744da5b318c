"""Medusa heads (Cai et al. 2024, Medusa-1): K extra decoding heads on the target's last hidden
state; head k predicts the token k + 2 positions ahead of that state's position (the target's
own LM head predicts k = -1, the next token).

Public layout (the Medusa repository's `medusa_lm_head.safetensors`, or `medusa_lm_head.pt`
read only with `torch.load(weights_only=True)`, beside a `config.json` holding
`medusa_num_heads` and `medusa_num_layers`): head i is `nn.Sequential` of L ResBlocks
(`x + SiLU(Linear(H, H)(x))`, keys `{i}.{j}.linear.weight` / `.bias`) and an output projection
`{i}.{L}.weight` [vocab, H] without bias. The reference code builds the L ResBlocks as one
module repeated, so a file may hold the same tensors under every j; we load each j as stored.

Tied variant (ours, `"medusa_tied_lm_head": true` in config.json): no `{i}.{L}.weight`; a head's
output goes through the target's own LM head, so shipped heads hold only H x H blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


class MedusaError(ValueError):
    """A Medusa checkpoint we cannot use (missing files or keys, shapes that do not fit)."""


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads of `num_layers` ResBlocks each, with their own output projections or (tied)
    none, in which case `logits` needs the target's LM head (`lm_head`: hidden -> logits)."""

    def __init__(self, num_heads: int, num_layers: int, hidden: int, vocab: int,
                 tied: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_layers, self.hidden, self.vocab = (num_heads, num_layers,
                                                                     hidden, vocab)
        self.tied = tied
        self.blocks = nn.ModuleList(nn.ModuleList(ResBlock(hidden) for _ in range(num_layers))
                                    for _ in range(num_heads))
        self.out = None if tied else nn.ModuleList(
            nn.Linear(hidden, vocab, bias=False) for _ in range(num_heads))

    @torch.inference_mode()
    def logits(self, h: Tensor, lm_head=None, num_heads: int | None = None) -> Tensor:
        """h [B, H] (the target's final, normed hidden state) -> [K, B, vocab] float32, for the
        first `num_heads` heads (default all)."""
        outs = []
        for k in range(self.num_heads if num_heads is None else num_heads):
            x = h.to(self.blocks[k][0].linear.weight.dtype) if self.num_layers else h
            for block in self.blocks[k]:
                x = block(x)
            if self.out is not None:
                outs.append(self.out[k](x).float())
            else:
                assert lm_head is not None, "tied Medusa heads need the target's LM head"
                outs.append(lm_head(x.float()).float())
        return torch.stack(outs)

    def state_dict_public(self) -> dict[str, Tensor]:
        """The public layout's keys (`{i}.{j}.linear.*`, `{i}.{L}.weight`)."""
        out = {}
        for i in range(self.num_heads):
            for j, block in enumerate(self.blocks[i]):
                out[f"{i}.{j}.linear.weight"] = block.linear.weight.detach().contiguous()
                out[f"{i}.{j}.linear.bias"] = block.linear.bias.detach().contiguous()
            if self.out is not None:
                out[f"{i}.{self.num_layers}.weight"] = self.out[i].weight.detach().contiguous()
        return out


def save_medusa(heads: MedusaHeads, path: str | Path, base_model: str = "") -> Path:
    """Write `heads` in the public layout (safetensors + config.json)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(heads.state_dict_public(), str(path / WEIGHT_FILES[0]))
    cfg = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
           "hidden_size": heads.hidden, "vocab_size": heads.vocab,
           "base_model_name_or_path": base_model}
    if heads.tied:
        cfg["medusa_tied_lm_head"] = True
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def load_medusa(path: str | Path, hidden: int, vocab: int) -> MedusaHeads:
    """Medusa heads from a directory in the public layout, checked against the target's hidden
    size and vocabulary; `MedusaError` with what does not fit otherwise."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not path.is_dir() or not cfg_path.is_file():
        raise MedusaError(f"Medusa heads: {path} must be a directory with config.json and "
                          f"{' or '.join(WEIGHT_FILES)}")
    cfg = json.loads(cfg_path.read_text())
    try:
        num_heads, num_layers = int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
    except (KeyError, TypeError, ValueError):
        raise MedusaError(f"{cfg_path}: needs an integer medusa_num_heads "
                          "(and medusa_num_layers)") from None
    weights = next((path / f for f in WEIGHT_FILES if (path / f).is_file()), None)
    if weights is None:
        raise MedusaError(f"Medusa heads: none of {WEIGHT_FILES} in {path}")
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(weights))
    else:  # never unpickle arbitrary objects: tensors only
        state = torch.load(str(weights), map_location="cpu", weights_only=True)
    state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
    tied = bool(cfg.get("medusa_tied_lm_head", False)) or f"0.{num_layers}.weight" not in state
    heads = MedusaHeads(num_heads, num_layers, hidden, vocab, tied=tied)
    for i in range(num_heads):
        for j in range(num_layers):
            for name, want in (("weight", (hidden, hidden)), ("bias", (hidden,))):
                key = f"{i}.{j}.linear.{name}"
                t = state.get(key)
                if t is None:
                    raise MedusaError(f"{weights}: missing {key}")
                if tuple(t.shape) != want:
                    raise MedusaError(f"{weights}: {key} has shape {tuple(t.shape)}, the target "
                                      f"needs {want} (hidden size {hidden})")
                getattr(heads.blocks[i][j].linear, name).data.copy_(t.float())
        if not tied:
            key = f"{i}.{num_layers}.weight"
            t = state.get(key)
            if t is None:
                raise MedusaError(f"{weights}: missing {key}")
            if tuple(t.shape) != (vocab, hidden):
                raise MedusaError(f"{weights}: {key} has shape {tuple(t.shape)}, the target "
                                  f"needs ({vocab}, {hidden}) (vocabulary {vocab}, hidden size "
                                  f"{hidden})")
            heads.out[i].weight.data.copy_(t.float())
    return heads.eval()
