"""MLPSpeculator (Wertheimer et al. 2024, "Accelerating Production LLMs with Combined
Token/Embedding Speculators"; IBM fms-extras, served by vLLM): n_predict small MLP stages on the
target's final (normed) hidden state, each also fed the token drafted just before it.

Stage i (0-based) on state s and token x, with w_s = 0.5 ** (0.5 / n_predict) and
w_e = sqrt(1 - w_s ** 2) * sqrt(inner_dim / 2):

    s' = gelu(ln_i(w_s * proj_i(s) + w_e * emb_i(x)))      ln: x / rms(x) * weight + bias
    logits_i = head_i(s')                                   scores the token after x

s_0 is the target's final hidden state at the last committed row (divided by its rms and by
sqrt(2) first when `scale_input`: the reference's `ln0`, no affine), x_0 the token the target
produced there (the draft tree's root). The norm is the reference's LayerNormParameterized
as the speculator builds it: no mean subtraction, eps 1e-6, elementwise scale and shift; gelu
is the exact (erf) one. No attention and no KV: a stage is two matmuls and a lookup.

Public layout (config.json with "model_type": "mlp_speculator", emb_dim, inner_dim (0: emb_dim),
vocab_size, n_predict, tie_weights, scale_input, top_k_tokens_per_head, n_candidates; weights in
model.safetensors, other *.safetensors shards or pytorch_model.bin read weights-only; keys
optionally prefixed "speculator."): emb.{i}.weight [vocab, inner], proj.{i}.weight [inner, emb_dim
for i = 0 else inner], head.{i}.weight [vocab, inner], ln.{i}.weight / .bias [inner]. Tied
checkpoints (`tie_weights`) share emb, head and ln across stages and proj across stages >= 1,
and are read from emb.0, head.0, ln.0, proj.0 and proj.1, as vLLM reads them.

Reduced draft vocabulary (ours, like EAGLE-3's d2t): "draft_vocab_size": Vd in config.json and a
`draft_ids` tensor [Vd] (the target ids of the draft ids, sorted) beside the weights; head.{i}
is [Vd, inner] and emb.{i} [Vd + 1, inner], whose last row stands for every target token outside
the draft vocabulary (a root can be any token). Runtimes without this extension cannot load it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

EPS = 1e-6
WEIGHT_FILE = "model.safetensors"


class MlpSpeculatorError(ValueError):
    """A checkpoint we cannot use (missing files or keys, shapes that do not fit the target)."""


@dataclass(frozen=True)
class MlpSpeculatorConfig:
    emb_dim: int  # the target's hidden size
    inner_dim: int
    vocab_size: int  # the target's vocabulary
    n_predict: int
    tie_weights: bool = False
    scale_input: bool = False
    draft_vocab_size: int | None = None  # ours: a reduced output vocabulary
    top_k_tokens_per_head: tuple[int, ...] = ()
    n_candidates: int = 5
    extra: dict = field(default_factory=dict, compare=False)  # other config keys, kept on save

    @property
    def out_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def emb_rows(self) -> int:
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size + 1

    @property
    def state_weight(self) -> float:
        return 0.5 ** (0.5 / self.n_predict)

    @property
    def emb_weight(self) -> float:
        return math.sqrt((1 - self.state_weight ** 2) * self.inner_dim / 2)


def rms_normalize(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    y = F.rms_norm(x, (x.shape[-1],), weight, EPS)
    return y if bias is None else y + bias


class StageNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_normalize(x, self.weight, self.bias)


def _stages(make, n: int, tied: bool, first=None) -> nn.ModuleList:
    """n stage modules; tied: one shared module (after a separate `first`, if given)."""
    if not tied:
        return nn.ModuleList([first() if first and i == 0 else make() for i in range(n)])
    shared = make()
    return nn.ModuleList(([first()] if first else [shared]) + [shared] * (n - 1))


class MlpSpeculator(nn.Module):
    """The stages in float32 torch (training, the reference of the packed CPU path)."""

    def __init__(self, cfg: MlpSpeculatorConfig, draft_ids: Tensor | None = None) -> None:
        super().__init__()
        self.cfg = c = cfg
        n, d = c.n_predict, c.inner_dim
        self.emb = _stages(lambda: nn.Embedding(c.emb_rows, d), n, c.tie_weights)
        self.proj = _stages(lambda: nn.Linear(d, d, bias=False), n, c.tie_weights,
                            first=lambda: nn.Linear(c.emb_dim, d, bias=False))
        self.head = _stages(lambda: nn.Linear(d, c.out_vocab, bias=False), n, c.tie_weights)
        self.ln = _stages(lambda: StageNorm(d), n, c.tie_weights)
        if c.draft_vocab_size is None:
            draft_ids = torch.arange(c.vocab_size)
        assert draft_ids is not None and draft_ids.numel() == c.out_vocab, "draft_ids: [Vd]"
        self.register_buffer("draft_ids", draft_ids.long().clone(), persistent=False)
        # [vocab] the emb row of each target id (the last row for ids outside the draft vocab)
        index = torch.full((c.vocab_size,), c.emb_rows - 1, dtype=torch.long)
        index[self.draft_ids] = torch.arange(c.out_vocab)
        self.register_buffer("emb_index", index, persistent=False)

    def scale_input(self, hidden: Tensor) -> Tensor:
        return rms_normalize(hidden) / math.sqrt(2) if self.cfg.scale_input else hidden

    def stage(self, i: int, state: Tensor, rows: Tensor) -> Tensor:
        """The state after stage i: `state` [..., K_i] (stage 0: scaled target hidden),
        `rows` [...] emb rows of the tokens fed (`emb_index` of target ids; draft ids as they
        are)."""
        c = self.cfg
        z = self.proj[i](state) * c.state_weight + self.emb[i](rows) * c.emb_weight
        return F.gelu(self.ln[i](z))

    def logits(self, i: int, state: Tensor) -> Tensor:
        return self.head[i](state)  # [..., Vd]

    def public_state(self) -> dict[str, Tensor]:
        """The public layout's tensors (tied: the stage-0 sharers and proj.1 only)."""
        n = 1 if self.cfg.tie_weights else self.cfg.n_predict
        out = {}
        for i in range(n):
            out[f"emb.{i}.weight"] = self.emb[i].weight
            out[f"head.{i}.weight"] = self.head[i].weight
            out[f"ln.{i}.weight"] = self.ln[i].weight
            out[f"ln.{i}.bias"] = self.ln[i].bias
        for i in range(min(2, self.cfg.n_predict) if self.cfg.tie_weights else n):
            out[f"proj.{i}.weight"] = self.proj[i].weight
        return {k: v.detach().contiguous() for k, v in out.items()}


def save_mlp_speculator(model: MlpSpeculator, path: str | Path, dtype: torch.dtype =
                        torch.float32, extra_config: dict | None = None) -> Path:
    """Write `model` in the public layout (plus our reduced vocabulary, when it has one)."""
    from safetensors.torch import save_file

    c = model.cfg
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype) for k, v in model.public_state().items()}
    cfg = {**c.extra, "architectures": ["MLPSpeculatorPreTrainedModel"],
           "model_type": "mlp_speculator", "emb_dim": c.emb_dim, "inner_dim": c.inner_dim,
           "vocab_size": c.vocab_size, "n_predict": c.n_predict, "tie_weights": c.tie_weights,
           "scale_input": c.scale_input, "n_candidates": c.n_candidates,
           "top_k_tokens_per_head": list(c.top_k_tokens_per_head) or [1] * c.n_predict,
           **(extra_config or {})}
    if c.draft_vocab_size is not None:
        cfg["draft_vocab_size"] = c.draft_vocab_size
        tensors["draft_ids"] = model.draft_ids.cpu()
    save_file(tensors, str(path / WEIGHT_FILE), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def read_config(path: Path) -> MlpSpeculatorConfig:
    cfg_path = path / "config.json"
    if not path.is_dir() or not cfg_path.is_file():
        raise MlpSpeculatorError(f"MLPSpeculator: {path} must be a directory with config.json "
                                 "and the weights (model.safetensors or pytorch_model.bin)")
    raw = json.loads(cfg_path.read_text())
    if raw.get("model_type", "mlp_speculator") != "mlp_speculator":
        raise MlpSpeculatorError(f"{cfg_path}: model_type {raw['model_type']!r} is not "
                                 "'mlp_speculator'")
    try:
        emb_dim, n = int(raw["emb_dim"]), int(raw["n_predict"])
        inner = int(raw.get("inner_dim", 0)) or emb_dim
        vocab = int(raw["vocab_size"])
    except (KeyError, TypeError, ValueError):
        raise MlpSpeculatorError(f"{cfg_path}: needs integer emb_dim, n_predict and "
                                 "vocab_size") from None
    tied = bool(raw.get("tie_weights", False))
    if n < 1 or (tied and n < 2):
        raise MlpSpeculatorError(f"{cfg_path}: n_predict {n} (tied weights need 2 or more)")
    known = {"emb_dim", "inner_dim", "vocab_size", "n_predict", "tie_weights", "scale_input",
             "draft_vocab_size", "top_k_tokens_per_head", "n_candidates"}
    draft = raw.get("draft_vocab_size")
    return MlpSpeculatorConfig(
        emb_dim, inner, vocab, n, tied, bool(raw.get("scale_input", False)),
        None if draft is None else int(draft),
        tuple(int(k) for k in raw.get("top_k_tokens_per_head") or ()),
        int(raw.get("n_candidates", 5)), {k: v for k, v in raw.items() if k not in known})


def _read_weights(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if files:
        state = {k: v for f in files for k, v in load_file(str(f)).items()}
    elif (path / "pytorch_model.bin").is_file():  # tensors only: never unpickle objects
        state = torch.load(str(path / "pytorch_model.bin"), map_location="cpu",
                           weights_only=True)
    else:
        raise MlpSpeculatorError(f"MLPSpeculator: no *.safetensors or pytorch_model.bin in "
                                 f"{path}")
    return {k.removeprefix("speculator."): v for k, v in state.items()}


def _take(state: dict, weights: Path, key: str, shape: tuple, why: str) -> Tensor:
    t = state.get(key)
    if t is None:
        raise MlpSpeculatorError(f"{weights}: missing {key}")
    if tuple(t.shape) != shape:
        raise MlpSpeculatorError(f"{weights}: {key} has shape {tuple(t.shape)}, {why} needs "
                                 f"{shape}")
    return t.float()


def load_mlp_speculator(path: str | Path, hidden: int, vocab: int) -> MlpSpeculator:
    """An MLPSpeculator from a directory in the public layout, checked against the target's
    hidden size and vocabulary; `MlpSpeculatorError` with what does not fit otherwise."""
    path = Path(path)
    c = read_config(path)
    if c.emb_dim != hidden or c.vocab_size != vocab:
        raise MlpSpeculatorError(
            f"{path}: an MLPSpeculator for emb_dim {c.emb_dim} and vocab_size {c.vocab_size}; "
            f"the target has hidden size {hidden} and vocabulary {vocab}")
    state = _read_weights(path)
    draft_ids = None
    if c.draft_vocab_size is not None:
        draft_ids = _take(state, path, "draft_ids", (c.draft_vocab_size,), "draft_vocab_size")
        draft_ids = draft_ids.long()
        if draft_ids.min() < 0 or draft_ids.max() >= vocab or draft_ids.unique().numel() != \
                draft_ids.numel():
            raise MlpSpeculatorError(f"{path}: draft_ids must be distinct target ids < {vocab}")
    model = MlpSpeculator(c, draft_ids)
    d, why = c.inner_dim, f"inner_dim {c.inner_dim} (target hidden {hidden}, vocab {vocab})"
    with torch.no_grad():
        for i in range(c.n_predict):
            s = 0 if c.tie_weights else i
            p = min(i, 1) if c.tie_weights else i
            model.emb[i].weight.copy_(_take(state, path, f"emb.{s}.weight", (c.emb_rows, d), why))
            model.head[i].weight.copy_(_take(state, path, f"head.{s}.weight",
                                             (c.out_vocab, d), why))
            model.ln[i].weight.copy_(_take(state, path, f"ln.{s}.weight", (d,), why))
            model.ln[i].bias.copy_(_take(state, path, f"ln.{s}.bias", (d,), why))
            k = c.emb_dim if p == 0 else d
            model.proj[i].weight.copy_(_take(state, path, f"proj.{p}.weight", (d, k), why))
    return model.eval()
