"""`--speculative-token-map` (SGLang's hot token map for EAGLE-1/2 heads): the loader's formats
and errors, the sliced LM head, the flag's checks, and losslessness on a tiny target: greedy
output equals plain decoding with every drafted token inside the map, and sampled output follows
the target distribution (q is zero outside the map)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from specserve.launch.server_args import ServerArgs, parse_args
from specserve.runtime.layers.linear import Linear
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.speculative.base import SpecConfig, create_drafter
from specserve.speculative.drafters.eagle import EagleDrafter
from specserve.speculative.models.eagle_head import lm_head_rows
from specserve.speculative.token_map import load_token_map
from specserve.speculative.worker import SpeculativeWorker
from tests.helpers.eagle_checkpoints import write_eagle1_checkpoint, write_eagle3_checkpoint
from tests.helpers.tiny_models import write_tiny_model
from tests.unit.test_eagle_worker import SteeredEagle, hints_of
from tests.unit.test_scheduler import Harness, prompts, reference
from tests.unit.test_spec_sampling_distribution import (  # noqa: F401 - fixtures
    PARAMS,
    PROMPT,
    TOKENS,
    VOCAB,
    joints,
    pair_fits,
    tiny_vocab,
)

IDS = [7, 3, 250, 3, 0, 41]  # unsorted, one duplicate
EXPECT = [0, 3, 7, 41, 250]
NEW_TOKENS = 16


# ---- loader -------------------------------------------------------------------------------
def _write(path, fmt: str, value) -> str:
    if fmt == "safetensors":
        save_file({"hot_ids": value}, str(path))
    elif fmt == "json":
        path.write_text(json.dumps(value))
    elif fmt == "npy":
        np.save(path, value)
    else:
        torch.save(value, path)
    return str(path)


@pytest.mark.parametrize("fmt,value", [
    ("safetensors", torch.tensor(IDS, dtype=torch.int32)),
    ("json", IDS),
    ("json", {"token_ids": IDS}),
    ("npy", np.array(IDS, dtype=np.int64)),
    ("pt", torch.tensor(IDS)),
    ("pt", IDS),
])
def test_loader_formats_give_sorted_unique_ids(tmp_path, fmt, value):
    ids = load_token_map(_write(tmp_path / f"map.{fmt}", fmt, value), 320)
    assert ids.dtype == torch.int64 and ids.tolist() == EXPECT


@pytest.mark.parametrize("name,fmt,value,match", [
    ("map.txt", "json", IDS, "unknown format '.txt'"),
    ("map.json", "json", [], "empty"),
    ("map.pt", "pt", torch.tensor([], dtype=torch.int64), "empty"),
    ("map.json", "json", [1, 2.5], "must be integers"),
    ("map.json", "json", {"ids": IDS}, "'token_ids'"),
    ("map.npy", "npy", np.array([1.0, 2.0]), "must be integers"),
    ("map.safetensors", "safetensors", torch.tensor([1.0, 2.0]), "must be integers"),
    ("map.pt", "pt", torch.tensor([1.0, 2.0]), "must be integers"),
    ("map.json", "json", [0, 320], "token id 320 is outside"),
    ("map.npy", "npy", np.array([-1, 4]), "token id -1 is outside"),
    ("map.pt", "pt", torch.tensor([[1, 2], [3, 4]]), "1-D"),
    ("map.npy", "npy", np.array([[1, 2]]), "1-D"),
    ("map.json", "json", [[1, 2]], "1-D"),
    ("map.pt", "pt", {"ids": torch.tensor([1])}, "expected a list"),
])
def test_loader_errors_name_the_file(tmp_path, name, fmt, value, match):
    path = _write(tmp_path / name, fmt, value)
    with pytest.raises(ValueError, match=match) as err:
        load_token_map(path, 320)
    assert name in str(err.value)


def test_loader_refuses_pickles(tmp_path):
    ran = []

    class Payload:
        def __reduce__(self):
            return ran.append, ("unpickled",)

    torch.save([Payload()], tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="weights_only=True"):
        load_token_map(str(tmp_path / "evil.pt"), 320)
    np.save(tmp_path / "obj.npy", np.array([1, "x"], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="obj.npy"):
        load_token_map(str(tmp_path / "obj.npy"), 320)
    save_file({"a": torch.tensor([1]), "b": torch.tensor([2])}, str(tmp_path / "two.safetensors"))
    with pytest.raises(ValueError, match="expected one tensor"):
        load_token_map(str(tmp_path / "two.safetensors"), 320)
    with pytest.raises(ValueError, match="no such file"):
        load_token_map(str(tmp_path / "missing.json"), 320)
    assert ran == []


def test_lm_head_rows_plain_prepacked_and_tied():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 72, generator=gen)
    ids = torch.tensor([0, 17, 299])
    head = Linear(72, 300)
    head.weight.data.copy_(weight)
    assert torch.equal(lm_head_rows(head, ids), weight[ids])
    if head.pack():  # CPU fp32 with oneDNN: no dense weight left, recovered exactly
        assert torch.equal(lm_head_rows(head, ids), weight[ids])
        assert torch.equal(lm_head_rows(head, ids, tied_weight=2 * weight), 2 * weight[ids])


# ---- flag ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = write_tiny_model(tmp_path_factory.mktemp("tmap") / "t", "llama", seed=3)
    return d, ModelRunner(RunnerConfig(str(d), "cpu", "float32", max_total_tokens=4096))


@pytest.fixture(scope="module")
def truth(target):
    ps = prompts(12, seed=5)
    return ps, reference(target, ps, ignore_eos=True, max_new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def hot_map(truth, tmp_path_factory):
    """The ids of the runs (so steering can reach them) plus a random third of the rest; ids
    0-2 and 300+ are left out."""
    ps, ref = truth
    rng = random.Random(0)
    ids = {t for p, r in zip(ps, ref) for t in p + r} | {rng.randrange(3, 300) for _ in range(90)}
    ids -= {0, 1, 2}
    path = tmp_path_factory.mktemp("tmap_file") / "hot.pt"
    torch.save(torch.tensor(sorted(ids)), path)
    return str(path), sorted(ids)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("tmap_heads")
    return {"EAGLE": write_eagle1_checkpoint(root / "e1", target[0], seed=1),
            "EAGLE3": write_eagle3_checkpoint(root / "e3", target[0], seed=2)}


def test_flag_reaches_spec_config_and_is_checked(target, heads, hot_map, tmp_path):
    args = parse_args(["--model-path", str(target[0]), "--device", "cpu",
                       "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path",
                       str(heads["EAGLE"]), "--speculative-token-map", hot_map[0]])
    assert args.speculative_token_map == hot_map[0]
    assert args.resolve().spec_config().token_map == hot_map[0]
    base = {"model_path": str(target[0]), "device": "cpu",
            "speculative_draft_model_path": str(heads["EAGLE"])}
    with pytest.raises(ValueError, match="EAGLE-3 heads carry their own draft vocabulary"):
        ServerArgs(**base, speculative_algorithm="EAGLE3",
                   speculative_token_map=hot_map[0]).resolve()
    with pytest.raises(ValueError, match="token-map applies to .*not NGRAM"):
        ServerArgs(model_path=str(target[0]), device="cpu", speculative_algorithm="NGRAM",
                   speculative_token_map=hot_map[0]).resolve()
    for bad, match in ((str(tmp_path / "hot.bin"), "unknown format"),
                       (str(tmp_path / "hot.json"), "no such file")):
        with pytest.raises(ValueError, match=match):
            ServerArgs(**base, speculative_algorithm="EAGLE", speculative_token_map=bad).resolve()
    cfg = SpecConfig("EAGLE3", 8, draft_model_path=str(heads["EAGLE3"]), token_map=hot_map[0],
                    num_steps=3, eagle_topk=4)
    with pytest.raises(ValueError, match="applies to EAGLE-1/2 heads"):
        create_drafter(cfg, target[1])


def test_restricted_head_logits_are_the_hot_columns(target, heads, hot_map):
    runner = target[1]
    cfg = SpecConfig("EAGLE", 8, draft_model_path=str(heads["EAGLE"]), token_map=hot_map[0],
                    num_steps=3, eagle_topk=4)
    drafter = create_drafter(cfg, runner)
    hot = torch.tensor(hot_map[1])
    assert drafter.to_target.tolist() == hot_map[1]
    x = torch.randn(5, runner.model_config.hidden_size, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(drafter.head.target.compute_logits(x),
                               runner.model.compute_logits(x)[:, hot], atol=1e-5, rtol=1e-5)
    assert not any("lm_head" in k or "hot" in k for k in drafter.head.state_dict())


# ---- greedy -------------------------------------------------------------------------------
@pytest.mark.parametrize("steered", [False, True])
def test_greedy_with_token_map_equals_plain_decoding(target, truth, heads, hot_map, steered):
    ps, ref = truth
    runner = target[1]
    n = 8
    cfg = SpecConfig("EAGLE", n, draft_model_path=str(heads["EAGLE"]), num_steps=3,
                     eagle_topk=4, token_map=hot_map[0], disable_adaptive=True)
    if steered:
        drafter = SteeredEagle(cfg, runner)
        drafter.hints = hints_of(ps, ref)
    else:
        drafter = EagleDrafter(cfg, runner)
    drafted: set[int] = set()
    propose = drafter.propose

    def spy(reqs):
        trees = propose(reqs)
        for t in trees:
            drafted.update(t.tokens[1:].tolist())
        return trees

    drafter.propose = spy
    h = Harness(target, num_draft_tokens=n, max_running_requests=4)
    h.worker = RunnerWorker(runner, SpeculativeWorker(cfg, drafter, runner))
    h.sched.run_batch = h.worker.run
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=NEW_TOKENS)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(len(ps))] == ref
    assert drafted and drafted <= set(hot_map[1]), sorted(drafted - set(hot_map[1]))
    info = h.sched.info()
    assert info["spec_decode_num_draft_tokens"] == 7 * info["spec_verify_steps"]
    if steered:  # draft index → target id is right, or steering could not reach the hints
        assert info["avg_spec_accept_length"] > 2.0, info
    h.sched.check_no_leak()


# ---- sampling -----------------------------------------------------------------------------
def test_sampling_with_token_map_matches_target_distribution(tiny_vocab, joints,  # noqa: F811
                                                             tmp_path):
    runner = tiny_vocab[1]
    head = write_eagle1_checkpoint(tmp_path / "e1", tiny_vocab[0], seed=5)
    hot = [0, 2, 3, 5, 6, 7, 9, 11]  # 8 of the 12 ids
    (tmp_path / "hot.json").write_text(json.dumps({"token_ids": hot}))
    steps, topk, nodes, samples = 2, 3, 6, 1000
    cfg = SpecConfig("EAGLE", nodes, draft_model_path=str(head), num_steps=steps,
                     eagle_topk=topk, token_map=str(tmp_path / "hot.json"), disable_adaptive=True)
    drafter = create_drafter(cfg, runner)
    cold = torch.tensor([t not in hot for t in range(VOCAB)])
    q_rows = []
    propose = drafter.propose

    def spy(reqs):
        trees = propose(reqs)
        q_rows.extend(t.draft_probs for t in trees if t.num_nodes > 1)
        return trees

    drafter.propose = spy
    h = Harness(tiny_vocab, capacity=60000, num_draft_tokens=nodes, max_running_requests=512,
                chunked_prefill_size=4096)
    h.worker = RunnerWorker(runner, SpeculativeWorker(cfg, drafter, runner))
    h.sched.run_batch = h.worker.run
    h.sched.stop.eos = set()
    torch.manual_seed(0)  # unseeded: trees drawn from q and verified with q, global RNG
    for i in range(samples):
        h.submit(f"s{i}", PROMPT, max_new_tokens=TOKENS, **PARAMS)
    h.run()
    assert q_rows and all(q is not None for q in q_rows), "sampled trees carry q"
    assert all(float(q[:, cold].abs().sum()) == 0.0 for q in q_rows), "q > 0 outside the map"
    assert sum(float(q.sum()) for q in q_rows) > 0
    info = h.sched.info()
    assert info["spec_decode_num_accepted_tokens"] > 0, info
    outs = torch.tensor([h.outputs[f"s{i}"] for i in range(samples)])  # [n, TOKENS]
    for k, fit in enumerate(pair_fits(outs, joints)):
        assert fit.passed, f"tokens {k + 1},{k + 2}: {fit}"
    h.sched.check_no_leak()

