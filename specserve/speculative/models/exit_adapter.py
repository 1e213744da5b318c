"""The EARLY_EXIT exit adapter: a small trained block between the target's layer E and an output
head over a reduced draft vocabulary.

    x = h_E + down(silu(gate(n)) * up(n)),  n = rmsnorm(h_E, norm)     (a residual SwiGLU MLP)
    logits_draft = rmsnorm(x, final_norm) @ lm_head.T                  ([Vd] draft vocabulary)

h_E is the hidden state leaving the target's first E layers (per token, no attention: the
adapter keeps no KV). `final_norm` is the target's, `lm_head` its LM-head rows of the draft
vocabulary `draft_ids` (sorted target ids), so an adapter with `down` = 0 is the plain early
exit restricted to the draft vocabulary; training (`python -m specserve.speculative.train
--algorithm EARLY_EXIT`) fits gate/up/down/norm only. The draft's q is zero outside the draft
vocabulary (`full_logits` fills those with -inf), which sampling verification handles losslessly
(the residual puts their mass back).

On disk (`export`/`load_exit_adapter`): `config.json` with a `specserve_exit_adapter` block
(exit layer, sizes, target) and `model.safetensors` with `norm.weight`, `gate_proj.weight`,
`up_proj.weight`, `down_proj.weight`, `final_norm.weight`, `lm_head.weight`, `draft_ids`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from specserve.runtime.layers.linear import Linear
from specserve.speculative.models.vocab_head import scatter_to_vocab

CONFIG_KEY = "specserve_exit_adapter"


@dataclass(frozen=True)
class AdapterShape:
    exit_layer: int
    num_target_layers: int
    hidden_size: int
    intermediate_size: int
    draft_vocab_size: int
    target_vocab_size: int
    rms_norm_eps: float


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


class ExitAdapter(nn.Module):
    """The serving adapter (frozen; its linears may be packed like an EAGLE head's)."""

    def __init__(self, shape: AdapterShape) -> None:
        super().__init__()
        self.shape = s = shape
        self.gate_proj = Linear(s.hidden_size, s.intermediate_size)
        self.up_proj = Linear(s.hidden_size, s.intermediate_size)
        self.down_proj = Linear(s.intermediate_size, s.hidden_size)
        self.lm_head = Linear(s.hidden_size, s.draft_vocab_size)
        self.norm = nn.Parameter(torch.ones(s.hidden_size), requires_grad=False)
        self.final_norm = nn.Parameter(torch.ones(s.hidden_size), requires_grad=False)
        self.register_buffer("draft_ids", torch.arange(s.draft_vocab_size))

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] leaving layer E -> draft-vocabulary logits [n, Vd] float32."""
        s = self.shape
        h = hidden.float()
        x = _rms(h, self.norm, s.rms_norm_eps)
        h = h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.lm_head(_rms(h, self.final_norm, s.rms_norm_eps)).float()

    def full_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, target vocab]: the draft logits in their target ids, -inf elsewhere."""
        return scatter_to_vocab(self.forward(hidden), self.draft_ids,
                                self.shape.target_vocab_size)

    def pack_weights(self, compute_dtype, threads: int | None = None) -> int:
        return sum(m.pack(compute_dtype, threads) for m in
                   (self.gate_proj, self.up_proj, self.down_proj, self.lm_head))


def export_exit_adapter(out_dir: str | Path, shape: AdapterShape,
                        tensors: dict[str, torch.Tensor], extra_config: dict | None = None,
                        dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write an adapter directory. `tensors`: the names listed in the module docstring."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().cpu().contiguous() if k == "draft_ids"
                 else v.detach().to(dtype).cpu().contiguous()) for k, v in tensors.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {CONFIG_KEY: asdict(shape), **(extra_config or {})}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def is_exit_adapter(path: str | Path) -> bool:
    p = Path(path) / "config.json"
    return p.exists() and CONFIG_KEY in json.loads(p.read_text())


def load_exit_adapter(path: str | Path) -> ExitAdapter:
    """Load an adapter directory (safetensors only) as float32."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    if CONFIG_KEY not in cfg:
        raise ValueError(f"{path} is not an exit adapter (no {CONFIG_KEY} in its config.json)")
    shape = AdapterShape(**cfg[CONFIG_KEY])
    w = load_file(str(path / "model.safetensors"))
    model = ExitAdapter(shape)
    with torch.no_grad():
        for name in ("gate_proj", "up_proj", "down_proj", "lm_head"):
            getattr(model, name).weight.data = w[f"{name}.weight"].float().contiguous()
        model.norm.data = w["norm.weight"].float()
        model.final_norm.data = w["final_norm.weight"].float()
        model.draft_ids = w["draft_ids"].long()
    if model.draft_ids.numel() != shape.draft_vocab_size:
        raise ValueError(f"{path}: {model.draft_ids.numel()} draft ids for a draft vocabulary "
                         f"of {shape.draft_vocab_size}")
    return model.eval()
