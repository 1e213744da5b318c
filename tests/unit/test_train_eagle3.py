"""The EAGLE-3 trainer on a tiny target: the trainable head computes exactly what the serving
head computes once exported (step 0 and the unrolled TTT steps, against head DECODE rows whose
KV lists are [committed prefix, ancestors, self]), capture → train → export → load runs, the
loss falls, and a time-budgeted run resumes from its checkpoint."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from specserve.speculative.models import load_draft_head
from specserve.speculative.train.capture import CaptureConfig, FeatureStore, capture
from specserve.speculative.train.model import HeadShape, TrainableEagle3
from specserve.speculative.train.regen import REGEN_FILE, read_regen
from specserve.speculative.train.trainer import (
    TrainConfig,
    Trainer,
    chain_accept,
    choose_draft_vocab,
    read_log,
)
from tests.helpers.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = write_tiny_model(tmp_path_factory.mktemp("train_t") / "t", "llama", seed=5,
                         num_hidden_layers=4)
    # a random tiny model predicts almost uniformly (nothing to learn): sharpen its LM head so
    # its next-token distribution is peaked and depends on the context
    weights = load_file(str(d / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 40
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d, ModelRunner(RunnerConfig(str(d), "cpu", "float32", max_total_tokens=4096,
                                       pack_weights=False))


def _trainable(runner, draft_ids, seed=0):
    torch.manual_seed(seed)
    mc = runner.model_config
    model = TrainableEagle3(HeadShape.for_target(mc, len(draft_ids)),
                            runner.model.embed_tokens.detach(), draft_ids)
    model.init_from_target(runner.model.lm_head.weight.detach(), runner.model.norm.weight)
    with torch.no_grad():  # non-trivial norms and a live residual branch
        for p in (model.input_layernorm, model.hidden_norm, model.post_attention_layernorm,
                  model.norm):
            p.mul_(1 + 0.2 * torch.randn_like(p))
        for lin in (model.o_proj, model.down_proj, model.fc):
            lin.weight.normal_(std=0.2)
    return model


def test_exported_head_computes_what_the_trainable_head_computes(target, tmp_path):
    model_dir, runner = target
    vocab = runner.model_config.vocab_size
    draft_ids = torch.tensor(sorted(random.Random(0).sample(range(vocab), 200)))
    model = _trainable(runner, draft_ids).eval()
    head_dir = model.export(tmp_path / "head", dtype=torch.float32)
    head = load_draft_head(head_dir, runner.model_config, runner.model, kv_capacity=1024)
    backend = head.create_backend()

    seq = [random.Random(1).randrange(3, vocab) for _ in range(24)]
    t = len(seq)
    slots = torch.arange(1, t + 1)
    out = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [seq], [slots], [0],
                                            capture_layers=head.capture_layers))
    fused = head.target_hidden(out)  # [T, 3H]
    with torch.no_grad():
        hs = model(fused[None], torch.tensor([seq]), torch.ones(1, t, dtype=torch.bool), 3)
    # step 0 = the serving draft extend over rows 0..T-2 (row r: token r+1, features r)
    ext = head(ForwardBatch.build(ForwardMode.DRAFT_EXTEND, [seq[1:]], [slots[:-1]], [0],
                                  logits="all"), backend, fused[:-1], hidden_is_fused=True)
    torch.testing.assert_close(ext.hidden, hs[0][0, : t - 1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ext.logits, model.logits(hs[0][0, : t - 1]), atol=1e-4, rtol=1e-4)
    # steps 1, 2 of the chain under row r = a depth-2 and depth-3 tree node's DECODE rows
    for r in (0, 7, t - 4):
        prev, ancestors = ext.hidden[r], []
        for k in (1, 2):
            scratch = 400 + 10 * r + k
            ancestors.append(scratch)
            kv = torch.cat([slots[: r + 1], torch.tensor(ancestors)])
            res = head(ForwardBatch.build(ForwardMode.DECODE, [[seq[r + 1 + k]]], [kv],
                                          [kv.numel() - 1]), backend, prev[None],
                       hidden_is_fused=False)
            torch.testing.assert_close(res.hidden[0], hs[k][0, r], atol=1e-4, rtol=1e-4)
            prev = res.hidden[0]


def _fake_regen(out_dir, vocab, n=40, seed=0):
    """Regen records whose answers follow a learnable rule (next = f(previous two))."""
    rng = random.Random(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / REGEN_FILE).open("w") as fh:
        for i in range(n):
            prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 12))]
            ans = [rng.randrange(3, 60), rng.randrange(3, 60)]
            for _ in range(rng.randint(20, 40)):
                ans.append(3 + (ans[-1] * 7 + ans[-2]) % 57)
            fh.write(json.dumps({"id": f"c{i}", "prompt_ids": prompt, "output_ids": ans,
                                 "temperature": 0.0}) + "\n")
        fh.write('{"id": "cut-by-a-crash", "prompt_ids": [1, 2')


def test_capture_train_export_and_resume(target, tmp_path):
    model_dir, runner = target
    vocab = runner.model_config.vocab_size
    out = tmp_path / "run"
    _fake_regen(out, vocab)
    assert len(read_regen(out / REGEN_FILE)) == 40  # the cut line is skipped
    capture(CaptureConfig(target_model=str(model_dir), output=str(out), batch_tokens=256))
    store = FeatureStore(out / "features")
    assert len(store.index) == 40
    feats, final, tokens = store.arrays()
    # rows are the target's states: recompute one sequence
    r = store.index[3]
    seq = np.asarray(tokens[r["start"]: r["start"] + r["length"]]).tolist()
    ref = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [seq],
                                            [torch.arange(1, len(seq) + 1)], [0],
                                            capture_layers=store.capture_layers),
                         return_final_hidden=True)
    got = torch.from_numpy(np.asarray(final[r["start"]: r["start"] + r["length"]], np.float32))
    torch.testing.assert_close(got, ref.final_hidden, atol=2e-3, rtol=2e-3)
    # capture resumes: a rerun adds nothing
    capture(CaptureConfig(target_model=str(model_dir), output=str(out), batch_tokens=256))
    assert FeatureStore(out / "features").num_tokens == store.num_tokens

    ids, coverage = choose_draft_vocab(store, 64)
    assert ids.numel() == 64 and coverage > 0.9  # answers use 57 ids + the first two

    cfg = TrainConfig(target_model=str(model_dir), output=str(out), draft_vocab_size=64,
                      steps=2, lr=3e-3, warmup_steps=5, epochs=3000, batch_tokens=512,
                      eval_every=20, val_percent=10, ckpt_every_s=0.0, time_budget_s=4.0)
    first = Trainer(cfg)
    first.train()
    stopped_at = first.pos["step"]
    assert 0 < stopped_at < first.total_steps
    cfg.time_budget_s = 8.0
    second = Trainer(cfg)
    assert second.pos["step"] == stopped_at  # resumed from the checkpoint
    second.train()
    rows, evals = read_log(out / "train" / "log.jsonl")
    assert rows[-1]["step"] > stopped_at
    early = np.mean([r["kl_0"] for r in rows[:5]])
    late = np.mean([r["kl_0"] for r in rows[-5:]])
    assert late < 0.7 * early, (early, late)
    assert evals and "val_chain_accept" in evals[-1]
    head = load_draft_head(out / "head", runner.model_config, runner.model, kv_capacity=256)
    assert head.config.draft_vocab_size == 64
    cfgjson = json.loads((out / "head" / "config.json").read_text())
    assert cfgjson["specserve_training"]["train_tokens_seen"] == second.pos["tokens"]
    assert sorted((out / "snapshots").iterdir())


def test_chain_accept_counts_consecutive_hits():
    hit0 = torch.tensor([[True, True, False, True]])
    hit1 = torch.tensor([[True, False, True, True]])
    ok = torch.ones(1, 4, dtype=torch.bool)
    m = {"_hits_0": (hit0, ok), "_hits_1": (hit1, ok)}
    mean, n = chain_accept(m, 2)
    assert n == 4 and mean == pytest.approx((3 + 2 + 1 + 3) / 4)


def test_soft_cross_entropy_value_and_gradient():
    from specserve.speculative.train.trainer import SoftCrossEntropy

    gen = torch.Generator().manual_seed(0)
    z = torch.randn(6, 11, dtype=torch.double, generator=gen, requires_grad=True)
    p = torch.softmax(torch.randn(6, 11, dtype=torch.double, generator=gen), -1)
    ref = -(p * torch.log_softmax(z, -1)).sum(-1)
    torch.testing.assert_close(SoftCrossEntropy.apply(z, p), ref)
    assert torch.autograd.gradcheck(lambda x: SoftCrossEntropy.apply(x, p), (z,))


def test_learning_rate_follows_steps_or_time_whichever_is_further():
    from specserve.speculative.train.trainer import _lr

    cfg = TrainConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert _lr(cfg, 0, 100) == pytest.approx(0.1)
    assert _lr(cfg, 10, 100) == pytest.approx(1.0)
    assert _lr(cfg, 100, 100) == pytest.approx(0.1)
    assert _lr(cfg, 10, 100, time_frac=1.0) == pytest.approx(0.1)  # budget spent: floor
    assert _lr(cfg, 55, 100, time_frac=0.0) == pytest.approx(0.55)  # half way: cosine mid
