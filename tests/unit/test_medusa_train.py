"""The Medusa trainer (`python -m speculative.train --algorithm MEDUSA`) on a tiny target: the
heads learn (soft cross-entropy falls), resume from their checkpoint, export in the tied public
layout, and the exported heads compute what the trainable ones do and draft in the server's
MEDUSA drafter."""

from __future__ import annotations

import json

import pytest
import torch

from speculative.base import SpecConfig, SpecReq, TargetRows, create_drafter
from speculative.models.medusa import load_medusa
from speculative.train.capture import CaptureConfig, capture
from speculative.train.distill import TRAINERS
from tests.unit.test_distill import _cfg
from tests.unit.test_train_eagle3 import _fake_regen, target  # noqa: F401 - fixture


@pytest.fixture(scope="module")
def captured_final(target, tmp_path_factory):  # noqa: F811
    model_dir, runner = target
    out = tmp_path_factory.mktemp("medusa") / "run"
    _fake_regen(out, runner.model_config.vocab_size)
    capture(CaptureConfig(target_model=str(model_dir), output=str(out), batch_tokens=256,
                          capture_layers=()))
    return out


def test_train_medusa_heads_resume_export_and_draft(target, captured_final, tmp_path):  # noqa: F811
    model_dir, runner = target
    (tmp_path / "features").symlink_to(captured_final / "features")
    cfg = _cfg(model_dir, tmp_path, medusa_heads=2, time_budget_s=5.0, lr=1e-2)
    t = TRAINERS["MEDUSA"](cfg)
    batch = t.train_batches.load(0)
    with torch.no_grad():
        _, before = t.losses(batch)
    t.train()
    with torch.no_grad():
        _, after = t.losses(batch)
    assert after["loss_0"] < 0.9 * before["loss_0"], (before["loss_0"], after["loss_0"])
    steps = t.pos["step"]
    assert steps > 0
    # resume: a new trainer on the same output continues from the checkpoint
    again = TRAINERS["MEDUSA"](_cfg(model_dir, tmp_path, medusa_heads=2, time_budget_s=0.0))
    assert again.pos["step"] == steps
    cfg_json = json.loads((tmp_path / "medusa" / "config.json").read_text())
    assert cfg_json["medusa_num_heads"] == 2 and cfg_json["medusa_tied_lm_head"]
    heads = load_medusa(tmp_path / "medusa", runner.model_config.hidden_size,
                        runner.model_config.vocab_size)
    h = torch.randn(5, runner.model_config.hidden_size)
    with torch.no_grad():
        ref = torch.stack([t.model.head(k, h) for k in range(2)]) @ runner.model.lm_head.weight.T
    got = heads.logits(h, lambda x: x @ runner.model.lm_head.weight.T)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    d = create_drafter(SpecConfig("MEDUSA", 3, draft_model_path=str(tmp_path / "medusa"),
                                  medusa_choices="[[0], [0, 0]]"), runner)

    class Out:
        final_hidden = h

    d.draft_extend([TargetRows("r", 0, torch.arange(5), torch.arange(5), [1] * 5, [1] * 5)],
                   Out)
    tree = d.propose([SpecReq("r", [3, 4, 5], 3)])[0]
    assert tree.num_nodes == 3 and tree.parents.tolist() == [-1, 0, 1]
