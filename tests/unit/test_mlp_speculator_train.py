"""The MLPSpeculator trainer (`python -m specserve.speculative.train --algorithm MLP_SPECULATOR`)
on a tiny target: the stages learn (soft cross-entropy falls), resume from their checkpoint (tied
stages saved once), export in the public layout with the draft vocabulary, and the exported
speculator computes what the trainable one does and drafts in the server's drafter."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.speculative.base import RunnerReq, SpecConfig, TargetRows, create_drafter
from specserve.speculative.models.mlp_speculator import load_mlp_speculator
from specserve.speculative.train.capture import CaptureConfig, capture
from specserve.speculative.train.distill import TRAINERS
from specserve.speculative.train.mlp_train import principal_rows
from tests.unit.test_distill import _cfg
from tests.unit.test_train_eagle3 import _fake_regen, target  # noqa: F401 - fixture


@pytest.fixture(scope="module")
def captured_final(target, tmp_path_factory):  # noqa: F811
    model_dir, runner = target
    out = tmp_path_factory.mktemp("mlp") / "run"
    _fake_regen(out, runner.model_config.vocab_size)
    capture(CaptureConfig(target_model=str(model_dir), output=str(out), batch_tokens=256,
                          capture_layers=()))
    return out


def test_principal_rows_keep_the_leading_directions_at_the_reference_spread():
    torch.manual_seed(0)
    rows = torch.randn(200, 3) @ torch.tensor([[5.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 0.1, 0]])
    p = principal_rows(rows, 2)
    assert p.shape == (200, 2)
    assert abs(float(p.std()) - 1 / 2 ** 0.5) < 1e-4
    assert p[:, 0].var() > 10 * p[:, 1].var()  # the widest direction first


def test_train_mlp_speculator_resume_export_and_draft(target, captured_final, tmp_path):  # noqa: F811
    model_dir, runner = target
    mc = runner.model_config
    (tmp_path / "features").symlink_to(captured_final / "features")
    kw = dict(mlp_stages=3, mlp_inner_dim=32)
    t = TRAINERS["MLP_SPECULATOR"](_cfg(model_dir, tmp_path, time_budget_s=5.0, lr=1e-2, **kw))
    batch = t.train_batches.load(0)
    with torch.no_grad():
        _, before = t.losses(batch)
    t.train()
    with torch.no_grad():
        _, after = t.losses(batch)
    for i in range(3):
        assert after[f"loss_{i}"] < 0.9 * before[f"loss_{i}"], (i, before, after)
    steps = t.pos["step"]
    assert steps > 0
    again = TRAINERS["MLP_SPECULATOR"](_cfg(model_dir, tmp_path, time_budget_s=0.0, **kw))
    assert again.pos["step"] == steps
    for a, b in zip(again.model.parameters(), t.model.parameters()):
        assert torch.equal(a, b.detach())
    out = tmp_path / "mlp_speculator"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "mlp_speculator" and cfg["tie_weights"] and cfg["scale_input"]
    assert cfg["draft_vocab_size"] == 64 and cfg["n_predict"] == 3
    spec = load_mlp_speculator(out, mc.hidden_size, mc.vocab_size)
    assert torch.equal(spec.draft_ids, t.model.draft_ids)
    h = torch.randn(4, mc.hidden_size)
    x = torch.tensor([5, 9, 40, 1])
    with torch.no_grad():
        want = t.model.logits(1, t.model.stage(1, t.model.stage(
            0, t.model.scale_input(h), t.model.emb_index[x]), x % 64))
        got = spec.logits(1, spec.stage(1, spec.stage(0, spec.scale_input(h),
                                                      spec.emb_index[x]), x % 64))
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)  # bfloat16 on disk
    d = create_drafter(SpecConfig("MLP_SPECULATOR", 4, draft_model_path=str(out), num_steps=3,
                                  eagle_topk=1), runner)

    class Out:
        final_hidden = h

    d.draft_extend([TargetRows("r", 0, torch.arange(4), torch.arange(4), [1] * 4, [1] * 4)],
                   Out)
    tree = d.propose([RunnerReq.drafting("r", [1] * 5, 4)])[0]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert set(tree.tokens.tolist()[1:]) <= set(spec.draft_ids.tolist())
