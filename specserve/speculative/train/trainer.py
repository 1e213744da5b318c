"""Stage 3 of head training: fit an EAGLE-3 head to the target with training-time test.

Loss. For every unrolled draft step k (0..steps-1) and row t, soft cross-entropy between the
head's distribution over the draft vocabulary and the target's next-token distribution
(its final hidden state through its own LM-head rows of the draft vocabulary, renormalized over
them), weighted by `step_decay ** k` (EAGLE-3: later steps matter less, their acceptance is
conditional on earlier ones). Rows predicting answer tokens weigh 1, rows predicting prompt
tokens `prompt_loss_weight`.

Metrics. `kl_k`: KL(target || head) at step k (the loss minus the target's entropy). `acc_k`:
the head's top-1 (mapped to target ids) equals the actual next token at step k, scored on
greedy-regenerated answers only, where that token IS the target's greedy choice — the chance a
chain's k-th draft is accepted given the earlier ones were. `chain_accept`: the mean
accept length a `steps`-deep chain draft would reach on held-out rows (1 + consecutive hits):
a cheap proxy, the real worker's tree reaches more (see `evaluate.py`).

Runs are time-budgeted and resumable: `ckpt/` (safetensors for the head and the AdamW state,
JSON for the position in the data) is written every `ckpt_every_s` seconds and at the end;
rerunning with the same output continues where it stopped. Every evaluation also exports the
head (`head/`, and `snapshots/tokens-<n>/` for the accept-length-vs-data curve).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specserve.speculative.train.capture import FEATURE_DIR, FeatureStore
from specserve.speculative.train.model import HeadShape, TrainableEagle3

logger = logging.getLogger(__name__)

TRAIN_DIR = "train"


@dataclass
class TrainConfig:
    target_model: str = "default"
    output: str = "."
    draft_vocab_size: int = 8192
    steps: int = 3  # unrolled draft steps (training-time test)
    step_decay: float = 0.8
    lr: float = 1e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    epochs: float = 2.0
    batch_tokens: int = 8192
    max_seq_len: int = 768
    prompt_loss_weight: float = 0.0  # prompt rows: attention context only
    train_lm_head: bool = False  # keep the target's LM-head rows (fewer parameters to fit)
    val_percent: int = 3
    eval_every: int = 100  # optimizer steps
    ckpt_every_s: float = 300.0
    time_budget_s: float | None = None
    seed: int = 0
    device: str = "auto"


def is_val(seq_id: str, percent: int) -> bool:
    digest = hashlib.sha256(f"specserve-headval:{seq_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < percent


def choose_draft_vocab(store: FeatureStore, size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent answer tokens (sorted ids) and the share of answer tokens
    they cover."""
    _, _, tokens = store.arrays()
    counts = np.zeros(int(tokens.max()) + 1 if len(tokens) else 1, dtype=np.int64)
    for r in store.index:
        a = r["start"] + r["prompt_len"]
        np.add.at(counts, np.asarray(tokens[a: r["start"] + r["length"]]), 1)
    order = np.argsort(-counts, kind="stable")[:size]
    covered = counts[order].sum() / max(counts.sum(), 1)
    ids = np.sort(order)
    if len(ids) < size:  # tiny corpora: pad with the lowest unused ids so the shape is fixed
        rest = np.setdiff1d(np.arange(size * 2), ids)[: size - len(ids)]
        ids = np.sort(np.concatenate([ids, rest]))
    return torch.from_numpy(ids.astype(np.int64)), float(covered)


class Batches:
    """Length-bucketed padded batches of whole sequences (cut at `max_seq_len`)."""

    def __init__(self, store: FeatureStore, seqs: list[dict], batch_tokens: int,
                 max_seq_len: int) -> None:
        self.feats, self.final, self.tokens = store.arrays()
        self.seqs = sorted(seqs, key=lambda r: min(r["length"], max_seq_len))
        self.max_seq_len = max_seq_len
        self.groups: list[list[dict]] = []
        cur: list[dict] = []
        for r in self.seqs:
            n = min(r["length"], max_seq_len)
            if cur and n * (len(cur) + 1) > batch_tokens:
                self.groups.append(cur)
                cur = []
            cur.append(r)
        if cur:
            self.groups.append(cur)

    def order(self, epoch: int, seed: int) -> list[int]:
        idx = list(range(len(self.groups)))
        random.Random(seed * 1000 + epoch).shuffle(idx)
        return idx

    def load(self, g: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        group = self.groups[g]
        t = max(min(r["length"], self.max_seq_len) for r in group)
        b = len(group)
        feats = torch.zeros(b, t, self.feats.shape[1])
        final = torch.zeros(b, t, self.final.shape[1])
        tokens = torch.zeros(b, t, dtype=torch.long)
        lengths = torch.zeros(b, dtype=torch.long)
        prompt = torch.zeros(b, dtype=torch.long)
        # greedy-regenerated answers: the actual next token is the target's greedy choice
        greedy = torch.tensor([r.get("temperature") == 0.0 for r in group])
        for i, r in enumerate(group):
            n = min(r["length"], self.max_seq_len)
            s = r["start"]
            feats[i, :n] = torch.from_numpy(np.asarray(self.feats[s: s + n], dtype=np.float32))
            final[i, :n] = torch.from_numpy(np.asarray(self.final[s: s + n], dtype=np.float32))
            tokens[i, :n] = torch.from_numpy(np.asarray(self.tokens[s: s + n], dtype=np.int64))
            lengths[i], prompt[i] = n, r["prompt_len"]
        out = {"feats": feats, "final": final, "tokens": tokens, "lengths": lengths,
               "prompt": prompt, "greedy": greedy}
        out = {k: v.to(device) for k, v in out.items()}
        out["num_tokens"] = int(lengths.sum())
        return out


class SoftCrossEntropy(torch.autograd.Function):
    """-sum_v p_v log softmax(z)_v per row, = logsumexp(z) - <p, z> (p sums to 1), with the
    gradient softmax(z) - p written in one pass: on this CPU the [rows, vocab] elementwise
    passes of log_softmax + p * logq + their backward cost as much as the LM-head matmuls."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(z, dim=-1)
        dot = torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1)
        ctx.save_for_backward(z, p, lse)
        return lse - dot

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        z, p, lse = ctx.saved_tensors
        g = torch.exp(z - lse[:, None])
        g.sub_(p).mul_(grad[:, None])
        return g, None


def step_losses(model: TrainableEagle3, batch: dict, target_w: torch.Tensor, steps: int,
                step_decay: float, prompt_loss_weight: float,
                draft_to_target: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Forward + loss for one batch; returns (loss, metrics).

    Only rows with a non-zero loss weight go through the LM heads (the head's and the
    target's): with `prompt_loss_weight=0` prompt rows are attention context only."""
    feats, final, tokens = batch["feats"], batch["final"], batch["tokens"]
    b, t, _ = feats.shape
    pos = torch.arange(t, device=feats.device)
    real = pos[None] < batch["lengths"][:, None]  # [B, T]
    hs = model(feats, tokens, real, steps)
    # positions u whose target distribution (of token u+1) some step is trained on
    need = real & (pos[None] + 1 >= batch["prompt"][:, None]) if prompt_loss_weight == 0 \
        else real
    with torch.no_grad():
        target_z = final[need] @ target_w.T  # [M, Vd] the target's logits, draft vocabulary
        target_lse = torch.logsumexp(target_z, dim=-1)
        target_p = torch.exp(target_z - target_lse[:, None])
        # entropy of each row: lse - <p, z>
        target_ent = target_lse - torch.bmm(target_p.unsqueeze(1), target_z.unsqueeze(2)).view(-1)
        del target_z
        where = torch.full((b, t), -1, dtype=torch.long, device=feats.device)
        where[need] = torch.arange(int(need.sum()), device=feats.device)
    total = feats.new_zeros(())
    metrics: dict = {}
    for k, h in enumerate(hs):
        # row t predicts token t+2+k from the target's distribution at position t+1+k
        n_rows = t - 2 - k
        if n_rows <= 0:
            break
        label_pos = pos[:n_rows] + 2 + k  # [R] position of the predicted token
        valid = label_pos[None] < batch["lengths"][:, None]  # [B, R]
        answer = label_pos[None] >= batch["prompt"][:, None]
        w = valid.float() * torch.where(answer, 1.0, prompt_loss_weight)
        sel = w > 0
        wk = w[sel]
        z = model.logits(h[:, :n_rows][sel])  # [M_k, Vd]
        rows = where[:, 1 + k: 1 + k + n_rows][sel]
        ce = SoftCrossEntropy.apply(z, target_p[rows])  # [M_k]
        loss_k = (ce * wk).sum() / wk.sum().clamp_min(1.0)
        total = total + step_decay ** k * loss_k
        with torch.no_grad():
            # KL(p || q) = CE - H(p): 0 for a perfect head (CE's floor is the target's entropy)
            kl = ce.detach() - target_ent[rows]
            metrics[f"kl_{k}"] = float((kl * wk).sum() / wk.sum().clamp_min(1.0))
            logq = z.detach()
            scored = valid & answer & batch["greedy"][:, None]
            hit = torch.zeros_like(scored)
            pred = draft_to_target[logq.argmax(-1)]
            hit[sel] = pred == tokens[:, 2 + k: 2 + k + n_rows][sel]
            hit &= scored
            metrics[f"loss_{k}"] = float(loss_k)
            metrics[f"acc_{k}"] = float(hit.sum()) / max(float(scored.sum()), 1.0)
            metrics[f"_hits_{k}"] = (hit, scored)
    return total, metrics


def chain_accept(metrics: dict, steps: int) -> tuple[float, int]:
    """Mean accept length of a `steps`-deep chain over rows where every step is scored."""
    hits = [metrics[f"_hits_{k}"] for k in range(steps) if f"_hits_{k}" in metrics]
    if len(hits) < steps:
        return 0.0, 0
    r = min(h.shape[1] for h, _ in hits)
    ok = torch.ones_like(hits[0][1][:, :r])
    for _, v in hits:
        ok &= v[:, :r]
    run = torch.ones_like(ok, dtype=torch.float32)
    length = torch.ones_like(run)
    for h, _ in hits:
        run = run * h[:, :r].float()
        length = length + run
    n = int(ok.sum())
    return (float(length[ok].sum()) / n if n else 0.0), n


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with each tensor once (a model whose modules share weights, tied stages,
    lists them under every name; safetensors refuses that, and loading is not strict)."""
    out, seen = {}, set()
    for k, v in state.items():
        if v.data_ptr() not in seen or v.numel() == 0:
            seen.add(v.data_ptr())
            out[k] = v.contiguous()
    return out


def _lr(cfg: TrainConfig, step: int, total: int, time_frac: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to `min_lr_ratio` over whichever runs out first: the
    planned steps or the run's time budget (`time_frac`), so a time-budgeted run still ends
    at the low learning rate instead of being cut mid-schedule."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = min(1.0, max((step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps), time_frac))
    cosine = 0.5 * (1 + math.cos(math.pi * frac))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def load_target_parts(target_model: str) -> tuple:
    """(ModelConfig, embed_tokens, lm_head weight, final norm weight) of the target, fp32."""
    from specserve.runtime.model_loader.config import ModelConfig
    from specserve.runtime.model_loader.default_model import resolve_model_path
    from specserve.runtime.model_loader.hf_dir import iter_safetensors_weights

    model_dir = resolve_model_path(None if target_model == "default" else target_model)
    mc = ModelConfig.from_dir(str(model_dir))
    want = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    got = {k: v.float() for k, v in iter_safetensors_weights(str(model_dir)) if k in want}
    embed = got["model.embed_tokens.weight"]
    lm_head = got.get("lm_head.weight", embed)
    return mc, embed, lm_head, got["model.norm.weight"]


class Trainer:
    """The training loop every draft kind shares: data, draft vocabulary, AdamW, the learning-rate
    schedule, time budget, checkpoints (resumable), evaluation and export. This class trains an
    EAGLE-3 head; `specserve/speculative/train/distill.py` subclasses it for STANDALONE draft models
    and EARLY_EXIT adapters by overriding the hooks `build_model`, `losses`, `export`."""

    desc = "train EAGLE-3 head"
    export_name = "head"  # the run directory's export: <output>/<export_name>

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.output)
        self.dir = self.out / TRAIN_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.store = FeatureStore(self.out / FEATURE_DIR)
        mc, embed, lm_head, final_norm = load_target_parts(cfg.target_model)
        self.target_config = mc
        state = self._read_state()
        if state is not None:
            draft_ids = torch.tensor(state["draft_ids"], dtype=torch.long)
            self.coverage = state["draft_vocab_coverage"]
        elif cfg.draft_vocab_size <= 0 or cfg.draft_vocab_size >= mc.vocab_size:
            draft_ids, self.coverage = torch.arange(mc.vocab_size), 1.0
        else:
            draft_ids, self.coverage = choose_draft_vocab(self.store, cfg.draft_vocab_size)
        self.draft_ids = draft_ids
        torch.manual_seed(cfg.seed)
        from specserve.runtime.model_runner.model_runner import resolve_device

        self.device = resolve_device(cfg.device)
        self.model = self.build_model(mc, embed, lm_head, final_norm, draft_ids)
        self.model.to(self.device)
        # [Vd, H] the target's LM-head rows of the draft vocabulary
        self.target_w = lm_head[draft_ids].contiguous().to(self.device)
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                     lr=cfg.lr,
                                     weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        seqs = [r for r in self.store.index if r["length"] >= 3]
        self.train_seqs = [r for r in seqs if not is_val(r["id"], cfg.val_percent)]
        self.val_seqs = [r for r in seqs if is_val(r["id"], cfg.val_percent)]
        self.train_batches = Batches(self.store, self.train_seqs, cfg.batch_tokens,
                                     cfg.max_seq_len)
        self.val_batches = Batches(self.store, self.val_seqs, cfg.batch_tokens, cfg.max_seq_len)
        per_epoch = len(self.train_batches.groups)
        self.total_steps = max(1, int(math.ceil(cfg.epochs * per_epoch)))
        self.pos = {"step": 0, "tokens": 0, "elapsed_s": 0.0}
        if state is not None:
            self._load_ckpt(state)
        logger.info(
            "train: %d train / %d val sequences (%d / %d tokens), %d batches per epoch, "
            "%d steps planned, draft vocab %d covers %.1f%% of answer tokens", len(self.train_seqs),
            len(self.val_seqs), sum(r["length"] for r in self.train_seqs),
            sum(r["length"] for r in self.val_seqs), per_epoch, self.total_steps,
            len(draft_ids), 100 * self.coverage)

    # ---- the hooks a draft kind overrides -------------------------------------------------------
    def build_model(self, mc, embed: torch.Tensor, lm_head: torch.Tensor,
                    final_norm: torch.Tensor, draft_ids: torch.Tensor) -> torch.nn.Module:
        shape = HeadShape.for_target(mc, len(draft_ids))
        assert tuple(shape.capture_layers) == self.store.capture_layers, (
            "features were captured at other layers than the head reads")
        model = TrainableEagle3(shape, embed, draft_ids)
        model.init_from_target(lm_head, final_norm)
        model.lm_head.weight.requires_grad_(self.cfg.train_lm_head)
        return model

    def losses(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """(loss, metrics) of one batch; metrics keys starting with '_' are not logged."""
        cfg = self.cfg
        return step_losses(self.model, batch, self.target_w, cfg.steps, cfg.step_decay,
                           cfg.prompt_loss_weight, self.model.draft_ids)

    def chain_accept(self, metrics: dict) -> tuple[float, int]:
        return chain_accept(metrics, self.cfg.steps)

    # ---- checkpoints -------------------------------------------------------------------------
    def _read_state(self) -> dict | None:
        p = self.dir / "ckpt" / "state.json"
        return json.loads(p.read_text()) if p.exists() else None

    def _save_ckpt(self) -> None:
        tmp = self.dir / "ckpt.tmp"
        tmp.mkdir(exist_ok=True)
        save_file(_unshared(self.model.state_dict()), str(tmp / "model.safetensors"))
        opt = self.opt.state_dict()
        tensors = {}
        for i, st in opt["state"].items():
            for name, v in st.items():
                tensors[f"{i}.{name}"] = torch.as_tensor(v).reshape(-1) if name == "step" \
                    else v.contiguous()
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        state = {**self.pos, "draft_ids": self.draft_ids.tolist(),
                 "draft_vocab_coverage": self.coverage, "config": asdict(self.cfg),
                 "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                  for g in opt["param_groups"]]}
        (tmp / "state.json").write_text(json.dumps(state))
        final = self.dir / "ckpt"
        if final.exists():
            old = self.dir / "ckpt.old"
            final.rename(old)
            tmp.rename(final)
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
        else:
            tmp.rename(final)

    def _load_ckpt(self, state: dict) -> None:
        d = self.dir / "ckpt"
        dev = str(self.device)
        self.model.load_state_dict(load_file(str(d / "model.safetensors"), device=dev),
                                   strict=False)
        tensors = load_file(str(d / "optimizer.safetensors"), device=dev)
        opt_state: dict = {}
        for key, v in tensors.items():
            i, name = key.split(".", 1)
            opt_state.setdefault(int(i), {})[name] = v.reshape(()).cpu() if name == "step" else v
        groups = self.opt.state_dict()["param_groups"]
        for g, saved in zip(groups, state["param_groups"]):
            g.update(saved)
        self.opt.load_state_dict({"state": opt_state, "param_groups": groups})
        self.pos = {k: state[k] for k in ("step", "tokens", "elapsed_s")}
        logger.info("resumed at step %d (%d tokens, %.0f s trained)", self.pos["step"],
                    self.pos["tokens"], self.pos["elapsed_s"])

    def _log(self, rec: dict) -> None:
        with (self.dir / "log.jsonl").open("a") as fh:
            fh.write(json.dumps(rec) + "\n")

    # ---- evaluation --------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, max_batches: int = 4) -> dict:
        self.model.eval()
        sums: dict[str, float] = {}
        acc_len, acc_n, n = 0.0, 0, 0
        for g in range(min(max_batches, len(self.val_batches.groups))):
            batch = self.val_batches.load(g, self.device)
            _, m = self.losses(batch)
            a, k = self.chain_accept(m)
            acc_len += a * k
            acc_n += k
            n += 1
            for key, v in m.items():
                if not key.startswith("_"):
                    sums[key] = sums.get(key, 0.0) + v
        self.model.train()
        out = {f"val_{k}": v / max(n, 1) for k, v in sums.items()}
        out["val_chain_accept"] = acc_len / max(acc_n, 1)
        return out

    def export(self, path: Path) -> Path:
        return self.model.export(path, extra_config={"specserve_training": {
            "train_tokens_seen": self.pos["tokens"], "optimizer_steps": self.pos["step"],
            "train_seconds": round(self.pos["elapsed_s"]),
            "draft_vocab_coverage": round(self.coverage, 4),
        }})

    # ---- the loop ------------------------------------------------------------------------------
    def train(self) -> Path:
        cfg = self.cfg
        torch.manual_seed(cfg.seed + self.pos["step"])
        deadline = None if cfg.time_budget_s is None else time.monotonic() + cfg.time_budget_s
        # this run's share of the schedule: from the elapsed time at its start to the deadline
        t_start, e_start = time.monotonic(), self.pos["elapsed_s"]
        per_epoch = len(self.train_batches.groups)
        bar = tqdm(total=self.total_steps, initial=self.pos["step"], desc=self.desc,
                   unit="step", dynamic_ncols=True)
        last_ckpt = time.monotonic()
        self.model.train()
        stopped = "done"
        while self.pos["step"] < self.total_steps:
            if deadline is not None and time.monotonic() > deadline:
                stopped = "time budget"
                break
            step = self.pos["step"]
            epoch, within = divmod(step, per_epoch)
            g = self.train_batches.order(epoch, cfg.seed)[within]
            t0 = time.monotonic()
            batch = self.train_batches.load(g, self.device)
            time_frac = 0.0
            if cfg.time_budget_s:
                done = e_start + (time.monotonic() - t_start)
                time_frac = done / (e_start + cfg.time_budget_s)
            lr = _lr(cfg, step, self.total_steps, time_frac)
            for group in self.opt.param_groups:
                group["lr"] = lr
            loss, m = self.losses(batch)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.pos["step"] += 1
            self.pos["tokens"] += batch["num_tokens"]
            self.pos["elapsed_s"] += time.monotonic() - t0
            rec = {"step": self.pos["step"], "tokens": self.pos["tokens"], "lr": lr,
                   "loss": float(loss.detach()), "elapsed_s": round(self.pos["elapsed_s"], 1),
                   **{k: round(v, 4) for k, v in m.items() if not k.startswith("_")}}
            self._log(rec)
            bar.update(1)
            bar.set_postfix(kl0=f"{m.get('kl_0', 0):.3f}", acc0=f"{m.get('acc_0', 0):.2f}",
                            tok=self.pos["tokens"])
            if self.pos["step"] % cfg.eval_every == 0:
                self._eval_and_export()
            if time.monotonic() - last_ckpt > cfg.ckpt_every_s:
                self._save_ckpt()
                last_ckpt = time.monotonic()
        bar.close()
        self._save_ckpt()
        self._eval_and_export()
        logger.info("training stopped (%s) at step %d, %d tokens", stopped, self.pos["step"],
                    self.pos["tokens"])
        return self.out / self.export_name

    def _eval_and_export(self) -> None:
        ev = self.evaluate()
        rec = {"step": self.pos["step"], "tokens": self.pos["tokens"], "eval": True,
               **{k: round(v, 4) for k, v in ev.items()}}
        self._log(rec)
        logger.info("eval at %d tokens: %s", self.pos["tokens"],
                    ", ".join(f"{k}={v:.3f}" for k, v in ev.items()))
        self.export(self.out / self.export_name)
        self.export(self.out / "snapshots" / f"tokens-{self.pos['tokens']:09d}")


def train(cfg: TrainConfig) -> Path:
    return Trainer(cfg).train()


def read_log(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows) of a training log."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    return [r for r in rows if not r.get("eval")], [r for r in rows if r.get("eval")]
