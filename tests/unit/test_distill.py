"""The draft distiller (`python -m specserve.speculative.train --algorithm STANDALONE | EARLY_EXIT`)
on a tiny target: a draft of every target layer IS the target (so the trainable draft computes the
target's function); distillation lowers the KL and resumes from its checkpoint; the exported HF
directory serves with the logits the trainable draft computes; the shipped-asset form (without the
target's tensors) materializes back into the same directory; the exported exit adapter computes what
the trainable one does."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from specserve.speculative.models.draft_asset import is_draft_asset, materialize, pack_draft_asset
from specserve.speculative.models.exit_adapter import load_exit_adapter
from specserve.speculative.train.capture import CaptureConfig, FeatureStore, capture
from specserve.speculative.train.distill import (
    DistillConfig,
    DraftModelTrainer,
    ExitAdapterTrainer,
    chain_accept_from_hits,
)
from specserve.speculative.train.trainer import read_log
from tests.unit.test_train_eagle3 import _fake_regen, target  # noqa: F401 - fixture


def _cfg(model_dir, out, **kw):
    base = dict(target_model=str(model_dir), output=str(out), draft_vocab_size=64, steps=3,
                lr=3e-3, warmup_steps=5, epochs=3000, batch_tokens=512, eval_every=20,
                val_percent=10, ckpt_every_s=0.0)
    return DistillConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def captured(target, tmp_path_factory):  # noqa: F811
    model_dir, runner = target
    out = tmp_path_factory.mktemp("distill") / "run"
    _fake_regen(out, runner.model_config.vocab_size)
    capture(CaptureConfig(target_model=str(model_dir), output=str(out), batch_tokens=256,
                          capture_layers=(2,)))
    return out


def test_capture_stores_the_requested_layer(target, captured):  # noqa: F811
    _, runner = target
    store = FeatureStore(captured / "features")
    assert store.capture_layers == (2,) and store.width == runner.model_config.hidden_size
    feats, _, tokens = store.arrays()
    r = store.index[5]
    seq = np.asarray(tokens[r["start"]: r["start"] + r["length"]]).tolist()
    out = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [seq],
                                            [torch.arange(1, len(seq) + 1)], [0],
                                            capture_layers=(2,)))
    got = torch.from_numpy(np.asarray(feats[r["start"]: r["start"] + r["length"]], np.float32))
    torch.testing.assert_close(got, out.captured[2], atol=3e-3, rtol=3e-3)


def test_a_draft_of_every_target_layer_is_the_target(target, captured, tmp_path):  # noqa: F811
    model_dir, runner = target
    n = runner.model_config.num_hidden_layers
    (tmp_path / "features").symlink_to(captured / "features")
    t = DraftModelTrainer(_cfg(model_dir, tmp_path, draft_layers=n, val_percent=0))
    with torch.no_grad():
        _, m = t.losses(t.train_batches.load(0))
    assert m["kl_0"] < 1e-3 and m["acc_0"] > 0.99, m
    acc, rows = t.chain_accept(m)
    assert rows > 0 and acc > 3.9


def test_distil_a_draft_model_resume_export_and_serve(target, captured, tmp_path):  # noqa: F811
    model_dir, runner = target
    (tmp_path / "features").symlink_to(captured / "features")
    cfg = _cfg(model_dir, tmp_path, draft_layers=2, time_budget_s=4.0)
    first = DraftModelTrainer(cfg)
    first.train()
    stopped = first.pos["step"]
    assert 0 < stopped < first.total_steps
    cfg.time_budget_s = 8.0
    second = DraftModelTrainer(cfg)
    assert second.pos["step"] == stopped  # resumed
    second.train()
    rows, evals = read_log(tmp_path / "train" / "log.jsonl")
    assert np.mean([r["kl_0"] for r in rows[-5:]]) < 0.7 * np.mean([r["kl_0"] for r in rows[:5]])
    assert evals and "val_chain_accept" in evals[-1]

    draft = tmp_path / "draft"
    cfgjson = json.loads((draft / "config.json").read_text())
    assert cfgjson["num_hidden_layers"] == 2 and (draft / "tokenizer.json").exists()
    assert cfgjson["specserve_training"]["train_tokens_seen"] == second.pos["tokens"]
    # the exported directory serves the trainable draft's function (bf16 weights both sides)
    model = second.model
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
        model.embed_tokens.copy_(model.embed_tokens.bfloat16().float())
    served = ModelRunner(RunnerConfig(str(draft), "cpu", "float32", max_total_tokens=512,
                                      weight_format="torch", pack_weights=False))
    seq = list(range(3, 40))
    logits = served.forward(ForwardBatch.build(ForwardMode.EXTEND, [seq],
                                               [torch.arange(1, len(seq) + 1)], [0],
                                               logits="all")).logits
    w = load_file(str(draft / "model.safetensors"))
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"]).float()
    with torch.no_grad():
        ref = model(torch.tensor([seq]))[0] @ head.T
    torch.testing.assert_close(logits, ref, atol=2e-3, rtol=2e-3)

    # the shipped form drops the target's tensors and materializes back to the same weights
    asset = pack_draft_asset(draft, tmp_path / "asset", target=str(model_dir))
    assert is_draft_asset(asset) and not is_draft_asset(draft)
    small = load_file(str(asset / "model.safetensors"))
    assert "model.embed_tokens.weight" not in small
    full = materialize(asset, cache=tmp_path / "cache")
    assert materialize(asset, cache=tmp_path / "cache") == full  # written once
    again = load_file(str(full / "model.safetensors"))
    assert set(again) == set(w)
    for k, v in w.items():
        assert torch.equal(again[k], v), k

    # q8_0 (the shipped form): half the bytes, and the floats it materializes to round back to
    # exactly the blocks the bfloat16 weights give (the CPU engine's q8_0 draft is unchanged)
    from specserve.kernels.cpu.packing import Fmt, quantize

    q8 = pack_draft_asset(draft, tmp_path / "asset_q8", target=str(model_dir), q8_0=True)
    size = (q8 / "model.safetensors").stat().st_size
    assert size < 0.6 * (asset / "model.safetensors").stat().st_size
    deq = load_file(str(materialize(q8, cache=tmp_path / "cache") / "model.safetensors"))
    assert set(deq) == set(w)
    for k, v in w.items():
        if v.dim() == 2 and k not in ("model.embed_tokens.weight", "lm_head.weight"):
            a, b = quantize(Fmt.Q8_0, v.float().numpy()), quantize(Fmt.Q8_0, deq[k].numpy())
            assert np.array_equal(a.q, b.q) and np.array_equal(a.d, b.d), k
        else:
            assert torch.equal(deq[k], v), k


def test_train_an_exit_adapter_export_and_load(target, captured, tmp_path):  # noqa: F811
    model_dir, runner = target
    (tmp_path / "features").symlink_to(captured / "features")
    with pytest.raises(ValueError, match="captured at layer 2, not --exit-layer 1"):
        ExitAdapterTrainer(_cfg(model_dir, tmp_path, exit_layer=1))
    t = ExitAdapterTrainer(_cfg(model_dir, tmp_path, exit_layer=2, adapter_size=32,
                                time_budget_s=5.0))
    batch = t.train_batches.load(0)
    with torch.no_grad():
        _, before = t.losses(batch)
    t.train()
    with torch.no_grad():
        _, after = t.losses(batch)
    assert after["kl_0"] < 0.8 * before["kl_0"], (before["kl_0"], after["kl_0"])
    adapter = load_exit_adapter(tmp_path / "adapter")
    assert adapter.shape.exit_layer == 2 and adapter.draft_ids.numel() == 64
    h = torch.randn(7, runner.model_config.hidden_size)
    with torch.no_grad():
        # the trainable adapter with its exported (bf16-rounded) weights
        m = t.model
        for p in m.parameters():
            p.copy_(p.bfloat16().float())
        m.final_norm.copy_(m.final_norm.bfloat16().float())
        ref = m(h) @ t.target_w.bfloat16().float().T
    z = adapter.full_logits(h)
    torch.testing.assert_close(z[:, adapter.draft_ids], ref, atol=2e-3, rtol=2e-3)
    outside = torch.ones(z.shape[1], dtype=torch.bool)
    outside[adapter.draft_ids] = False
    assert torch.isinf(z[:, outside]).all()


def test_chain_accept_counts_consecutive_agreements():
    hits = torch.tensor([[1, 1, 0, 1, 1, 1, 0]], dtype=torch.bool)
    need = torch.ones_like(hits)
    acc, n = chain_accept_from_hits({"_hits": hits, "_need": need}, 2)
    # starts 0..5: runs capped at 2 -> 2,1,0,2,2,1 -> lengths 3,2,1,3,3,2
    assert n == 6 and acc == pytest.approx(14 / 6)
    need[0, 3] = False  # windows covering an unscored row are skipped
    acc, n = chain_accept_from_hits({"_hits": hits, "_need": need}, 2)
    assert n == 4
