"""The Medusa trainer (`python -m specserve.speculative.train --algorithm MEDUSA`) on a tiny target:
the heads learn (soft cross-entropy falls), resume from their checkpoint, export in the tied public
layout, and the exported heads compute what the trainable ones do and draft in the server's MEDUSA
drafter."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.speculative.base import RunnerReq, SpecConfig, TargetRows, create_drafter
from specserve.speculative.models.medusa import load_medusa
from specserve.speculative.train.capture import CaptureConfig, capture
from specserve.speculative.train.distill import TRAINERS
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
    tree = d.propose([RunnerReq.drafting("r", [3, 4, 5], 3)])[0]
    assert tree.num_nodes == 3 and tree.parents.tolist() == [-1, 0, 1]


def test_medusa_tree_greedy_construction_and_cost_choice():
    import numpy as np

    from specserve.runtime.verify_cost import VerifyCost
    from specserve.speculative.train.medusa_tree import choose, grow_tree

    acc = np.array([[0.6, 0.2, 0.1], [0.5, 0.1, 0.05]])
    order = grow_tree(acc, 5)
    # (0) .6, (0,0) .3, (1) .2, (0,1) .06 vs (1,0) .1 vs (2) .1: ties keep the first found
    assert [p for p, _ in order][:3] == [(0,), (0, 0), (1,)]
    assert all(p[:-1] == () or p[:-1] in [q for q, _ in order[:i]]
               for i, (p, _) in enumerate(order))  # every prefix came first
    probs = [p for _, p in order]
    assert probs == sorted(probs, reverse=True)
    flat = VerifyCost((1, 2), (1.0, 1.0))  # free rows: the biggest tree wins
    assert choose(acc, 5, flat, 0.0)["best"]["drafts"] == 5
    steep = VerifyCost((1, 2), (1.0, 2.0))  # each row costs a whole step: one draft at most
    res = choose(acc, 5, steep, 0.0)
    assert res["best"]["drafts"] == 1 and res["choices"] == [[0]]
    assert res["table"][0]["expected_accept"] == pytest.approx(1.6)


def test_medusa_tree_rank_accuracy_on_captured_run(target, captured_final, tmp_path):  # noqa: F811
    from specserve.speculative.models.medusa import MedusaHeads
    from specserve.speculative.train.capture import FeatureStore
    from specserve.speculative.train.medusa_tree import rank_accuracy

    _, runner = target
    mc = runner.model_config
    heads = MedusaHeads(2, 1, mc.hidden_size, mc.vocab_size, tied=True)
    for p in heads.parameters():  # zero ResBlocks: every head is the target's own next-token head
        torch.nn.init.zeros_(p)
    w = runner.model.lm_head.weight.detach().float()
    acc = rank_accuracy(FeatureStore(captured_final / "features"), heads, w, 4)
    assert acc.shape == (2, 4) and ((acc >= 0) & (acc <= 1)).all()
    assert acc.sum(1).max() <= 1.0 + 1e-9  # ranks are disjoint events
    # brute force for head 0 = the target's next-token head on row t: does its choice after
    # t equal the target's choice after t + 1 (the token at t + 2)?
    import numpy as np

    _, final, _ = FeatureStore(captured_final / "features").arrays()
    hit = tot = 0
    for r in FeatureStore(captured_final / "features").index:
        s, n, p = r["start"], r["length"], r["prompt_len"]
        lo, hi = max(p - 1, 0), n - 1 - 2
        if hi <= lo:
            continue
        g = (torch.from_numpy(np.asarray(final[s: s + n], dtype=np.float32)) @ w.T).argmax(-1)
        hit += int((g[lo:hi] == g[lo + 1: hi + 1]).sum())
        tot += hi - lo
    assert acc[0, 0] == pytest.approx(hit / tot)
