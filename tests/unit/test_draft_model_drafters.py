"""STANDALONE (a separate draft model) and EARLY_EXIT (the target's own first layers) on tiny
models, through the scheduler and the runner worker on the exact CPU engine: greedy output is
plain decoding's token for token (batch 1 and concurrency 8, chunked prefill, radix hits,
retraction, aborts) with no near-tie exemption; a draft that IS the target is accepted
everywhere (so the draft KV the drafters keep is right, not merely harmless); the resumed
verify pass equals the full one bit for bit; sampled output follows the target's distribution
(chains drawn from q, verified with q; seeded requests); bad drafts fail at start-up with one
clear line."""

from __future__ import annotations

import json

import pytest
import torch

from specserve.launch.server_args import ServerArgs
from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.messages import AbortReq
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.speculative.base import RunnerReq, SpecConfig, TargetRows, create_drafter
from specserve.speculative.drafters.standalone import DraftModelError
from specserve.speculative.models.exit_adapter import (
    AdapterShape,
    export_exit_adapter,
    load_exit_adapter,
)
from specserve.speculative.models.vocab_head import write_draft_vocab
from specserve.speculative.train.draft_init import init_draft_from_target, spread_layers
from specserve.speculative.worker import SpeculativeWorker
from tests.helpers.tiny_models import write_tiny_model
from tests.unit.test_scheduler import Harness, prompts, reference
from tests.unit.test_spec_sampling_distribution import (  # noqa: F401 - fixtures
    joints,
    pair_fits,
    run_samples,
    tiny_vocab,
)

NEW = 24


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("dm")
    d = write_tiny_model(root / "t", "llama", seed=7, num_hidden_layers=4)
    runner = ModelRunner(RunnerConfig(str(d), "cpu", "float32", max_total_tokens=4096))
    assert runner.engine == "cpu", "these tests pin the exact CPU engine"
    drafts = {"half": init_draft_from_target(d, root / "half", [0, 3]),
              "same": init_draft_from_target(d, root / "same", [0, 1, 2, 3])}
    # a draft with a reduced output vocabulary (as the distiller writes one)
    drafts["vocab"] = init_draft_from_target(d, root / "vocab", [0, 3])
    vocab = runner.model_config.vocab_size
    write_draft_vocab(drafts["vocab"], torch.randperm(
        vocab, generator=torch.Generator().manual_seed(3))[: vocab * 3 // 4])
    return d, runner, drafts


@pytest.fixture(scope="module")
def truth(target):
    ps = prompts(50, seed=21)
    return ps, reference(target[:2], ps, ignore_eos=True, max_new_tokens=NEW)


def write_adapter(runner, path, exit_layer, keep=0.8, seed=0, down_std=0.05):
    """A random exit adapter over a random `keep` share of the target's vocabulary (built the
    way the trainer exports one: the target's final norm and LM-head rows)."""
    mc = runner.model_config
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(mc.vocab_size, generator=g)[: int(keep * mc.vocab_size)].sort().values
    inter = 64
    shape = AdapterShape(exit_layer, mc.num_hidden_layers, mc.hidden_size, inter, len(ids),
                         mc.vocab_size, mc.rms_norm_eps)
    h = mc.hidden_size
    lm_head = runner.model.lm_head.weight.detach().float()
    tensors = {"gate_proj.weight": torch.randn(inter, h, generator=g) * 0.2,
               "up_proj.weight": torch.randn(inter, h, generator=g) * 0.2,
               "down_proj.weight": torch.randn(h, inter, generator=g) * down_std,
               "norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
               "final_norm.weight": runner.model.norm.weight.detach().float(),
               "lm_head.weight": lm_head[ids], "draft_ids": ids}
    return export_exit_adapter(path, shape, tensors, dtype=torch.float32)


def make_cfg(algo, target, draft="half", steps=3, **kw):
    if algo == "STANDALONE-tree":  # top-2 trees of depth 3, 6 nodes
        return SpecConfig("STANDALONE", 6, num_steps=steps, eagle_topk=2, disable_adaptive=True,
                          draft_model_path=str(target[2][draft]), draft_weight_format="f32",
                          **kw)
    if algo == "STANDALONE":
        kw.setdefault("draft_model_path", str(target[2][draft]))
        kw.setdefault("draft_weight_format", "f32")  # the draft exactly as written
    else:
        kw.setdefault("early_exit_layer", 2)
    return SpecConfig(algo, steps + 1, num_steps=steps, disable_adaptive=True, **kw)


def harness(target, cfg, **sched):
    runner = target[1]
    h = Harness(target[:2], num_draft_tokens=cfg.num_draft_tokens, **sched)
    drafter = create_drafter(cfg, runner)
    h.worker = RunnerWorker(runner, SpeculativeWorker(cfg, drafter, runner))
    h.sched.run_batch = h.worker.run
    return h, drafter


def accept_length(h) -> float:
    t = h.sched.spec_totals
    return t["spec_tokens_from_verify"] / max(t["spec_verify_steps"], 1)


@pytest.mark.parametrize("algo", ["STANDALONE", "STANDALONE+vocab", "STANDALONE-tree",
                                  "EARLY_EXIT"])
@pytest.mark.parametrize("concurrency", [1, 8])
def test_greedy_output_equals_plain_decoding_on_50_prompts(target, truth, algo, concurrency):
    ps, ref = truth
    cfg = (make_cfg("STANDALONE", target, draft="vocab") if algo == "STANDALONE+vocab"
           else make_cfg(algo, target))
    h, drafter = harness(target, cfg, max_running_requests=concurrency,
                         chunked_prefill_size=32)
    if algo == "STANDALONE+vocab":
        assert drafter.vocab_head is not None and "output vocabulary" in drafter.describe()
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=NEW)
    h.run()
    for i, r in enumerate(ref):
        assert h.outputs[f"r{i}"] == r, f"prompt {i} differs from plain decoding"
    assert h.sched.spec_totals["spec_verify_steps"] > 0
    assert h.sched.spec_totals["spec_decode_num_accepted_tokens"] > 0, "nothing was accepted"
    h.sched.check_no_leak()


@pytest.mark.parametrize("concurrency", [1, 8])
def test_early_exit_with_an_adapter_equals_plain_decoding_on_50_prompts(target, truth,
                                                                       concurrency, tmp_path):
    ps, ref = truth
    path = write_adapter(target[1], tmp_path / "ad", exit_layer=2)
    cfg = make_cfg("EARLY_EXIT", target, draft_model_path=str(path))
    h, drafter = harness(target, cfg, max_running_requests=concurrency, chunked_prefill_size=32)
    assert drafter.adapter is not None and "adapter" in drafter.describe()
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=NEW)
    h.run()
    for i, r in enumerate(ref):
        assert h.outputs[f"r{i}"] == r, f"prompt {i} differs from plain decoding"
    assert h.sched.spec_totals["spec_decode_num_accepted_tokens"] > 0, "nothing was accepted"
    h.sched.check_no_leak()


def test_exit_adapter_drafts_are_its_greedy_choices_within_its_vocabulary(target, tmp_path):
    runner = target[1]
    path = write_adapter(runner, tmp_path / "ad", exit_layer=2, keep=0.5)
    adapter = load_exit_adapter(path)
    drafter = create_drafter(make_cfg("EARLY_EXIT", target, draft_model_path=str(path),
                                      draft_matmul_dtype="float32"), runner)
    prompt = list(range(5, 25))
    slots = torch.arange(1, len(prompt) + 4)
    runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [prompt[:-1]], [slots[:19]], [0]))
    req = RunnerReq.drafting("a", prompt, 4, None, slots=slots[: 19 + 4])
    tree = drafter.propose([req])[0]
    assert tree.num_nodes == 4
    allowed = set(adapter.draft_ids.tolist())
    assert all(t in allowed for t in tree.tokens[1:].tolist())
    # node j's draft = argmax of the adapter over layer 2's output for node j
    batch = ForwardBatch.build(ForwardMode.TARGET_VERIFY, [tree.tokens.tolist()], [slots], [19],
                               positions=[19 + tree.depth], custom_masks=[tree.ancestor_mask],
                               logits="all", capture_layers=(2,))
    hidden = runner.forward(batch, layers=(0, 2)).captured[2]
    z = adapter.full_logits(hidden)
    assert torch.isinf(z[:, [i for i in range(z.shape[1]) if i not in allowed]]).all()
    assert tree.tokens[1:].tolist() == z.argmax(-1)[:3].tolist()


def test_an_adapter_for_another_layer_or_target_is_refused(target, tmp_path):
    d, runner, _ = target
    path = write_adapter(runner, tmp_path / "ad", exit_layer=2)
    args = ServerArgs(model_path=str(d), speculative_algorithm="EARLY_EXIT",
                      speculative_draft_model_path=str(path)).resolve()
    assert args.speculative_early_exit_layer == 2  # taken from the adapter
    with pytest.raises(ValueError, match="reads layer 2, not"):
        ServerArgs(model_path=str(d), speculative_algorithm="EARLY_EXIT",
                   speculative_draft_model_path=str(path),
                   speculative_early_exit_layer=3).resolve()
    with pytest.raises(ValueError, match="is not an exit adapter"):
        ServerArgs(model_path=str(d), speculative_algorithm="EARLY_EXIT",
                   speculative_draft_model_path=str(target[2]["half"])).resolve()
    cfg = json.loads((path / "config.json").read_text())
    cfg["specserve_exit_adapter"]["num_target_layers"] = 30
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="trained for a target of 30 layers"):
        create_drafter(make_cfg("EARLY_EXIT", target, draft_model_path=str(path)), runner)


@pytest.mark.parametrize("algo,draft", [("STANDALONE", "same"), ("STANDALONE-tree", "same"),
                                        ("EARLY_EXIT", None)])
def test_a_draft_equal_to_the_target_is_accepted_everywhere(target, truth, algo, draft):
    """STANDALONE with the target itself as the draft must accept every draft: any position
    whose draft KV was missing or stale (catch-up, the last accepted draft, prefill chunks,
    radix hits) would show as a rejection. EARLY_EXIT at the last layer but one accepts less,
    but its resumed verify must still be exact (the greedy test)."""
    ps, ref = truth
    cfg = make_cfg(algo, target, draft=draft or "half",
                   **({} if algo == "STANDALONE" else {"early_exit_layer": 3}))
    h, _ = harness(target, cfg, max_running_requests=4, chunked_prefill_size=16)
    for i, p in enumerate(ps[:16]):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=NEW)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(16)] == ref[:16]
    t = h.sched.spec_totals
    if algo == "STANDALONE":
        assert t["spec_decode_num_accepted_tokens"] == t["spec_decode_num_draft_tokens"], t
        assert accept_length(h) > 3.5
    if algo == "STANDALONE-tree":  # the kept tree may cut the greedy path; it still lands
        assert accept_length(h) > 2.0
    h.sched.check_no_leak()


def test_decoding_requests_riding_a_prefill_step_keep_their_draft_kv(target, truth):
    """Requests that decode in a mixed step (a new prompt's chunk in the same forward) keep the
    draft KV they have: the draft catches up each committed position once, not the whole
    sequence again after every step that prefilled someone else."""
    ps, ref = truth
    h, drafter = harness(target, make_cfg("STANDALONE", target, draft="same"),
                         max_running_requests=4, chunked_prefill_size=16)
    fed = {"extend": 0}
    forward = drafter.draft.forward

    def counting(batch, *a, **kw):
        if batch.mode == ForwardMode.EXTEND:
            fed["extend"] += batch.num_tokens
        return forward(batch, *a, **kw)

    drafter.draft.forward = counting
    try:
        # 4 at a time, finishing at different steps: each admission rides with decoders
        lens = [NEW - 6 * (i % 4) for i in range(12)]
        for i, p in enumerate(ps[:12]):
            h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=lens[i])
        h.run()
    finally:
        drafter.draft.forward = forward
    assert [h.outputs[f"r{i}"] for i in range(12)] == [ref[i][: lens[i]] for i in range(12)]
    assert h.sched.totals["retracted"] == 0
    positions = sum(len(p) + n for p, n in zip(ps[:12], lens))
    assert fed["extend"] <= positions, (fed, positions)
    h.sched.check_no_leak()


@pytest.mark.parametrize("algo", ["STANDALONE", "EARLY_EXIT"])
def test_steps_skipped_while_off_leave_the_drafts_right(target, truth, algo):
    """Both skip whole steps the controller calls idle (no propose, no draft_extend). Forcing
    two steps in three idle: output is still plain decoding's, and a draft equal to the target
    is still accepted everywhere, so the draft KV of the positions decoded in skipped steps is
    caught up before it is read."""
    from specserve.runtime.speculation import StepPlan

    ps, ref = truth
    h, drafter = harness(target, make_cfg(algo, target, draft="same"), max_running_requests=4,
                         chunked_prefill_size=16)
    ctl, n = h.sched.spec, {"steps": 0, "skipped": 0}

    def plan(states, full=ctl.plan):
        n["steps"] += 1
        if n["steps"] % 3 == 0:
            return full(states)
        n["skipped"] += 1
        return StepPlan([1] * len(states), [False] * len(states), True, True)

    ctl.plan = plan
    for i, p in enumerate(ps[:8]):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=NEW)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(8)] == ref[:8]
    t = h.sched.spec_totals
    assert n["skipped"] > 0 and t["spec_decode_num_draft_tokens"] > 0, (n, t)
    if algo == "STANDALONE":
        assert t["spec_decode_num_accepted_tokens"] == t["spec_decode_num_draft_tokens"], t
    h.sched.check_no_leak()


def test_a_tree_from_a_draft_equal_to_the_target_holds_its_argmax_under_every_node(target):
    """Every expanded node's children include the target's argmax at that node (computed by the
    tree-masked verify forward): the draft's tree rows saw the right prefix, root and ancestors
    (scratch slots), so with the target's own weights they reproduce its logits."""
    runner = target[1]
    cfg = SpecConfig("STANDALONE", 11, num_steps=3, eagle_topk=2, disable_adaptive=True,
                     draft_model_path=str(target[2]["same"]), draft_weight_format="f32")
    drafter = create_drafter(cfg, runner)
    prompt = list(range(5, 25))
    slots = torch.arange(1, len(prompt) + 11)  # 19 committed + 11 fresh
    runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [prompt[:-1]], [slots[:19]], [0]))
    # the prompt's prefill (a chunk: the draft runs nothing now, its first step catches up)
    drafter.draft_extend([TargetRows("a", 0, slots[:19], torch.arange(19), prompt[1:20],
                                     prompt[:19])], None)
    req = RunnerReq.drafting("a", prompt, 11, None, slots=slots[: 19 + 11])
    tree = drafter.propose([req])[0]
    assert tree.num_nodes == 11 and int(tree.depth.max()) == 3
    logits = runner.forward(ForwardBatch.build(
        ForwardMode.TARGET_VERIFY, [tree.tokens.tolist()], [slots[:30]], [19],
        positions=[19 + tree.depth], custom_masks=[tree.ancestor_mask], logits="all")).logits
    expanded = 0
    for u in range(tree.num_nodes):
        kids = tree.children(u)
        if kids:
            expanded += 1
            assert int(logits[u].argmax()) in [int(tree.tokens[c]) for c in kids], u
    assert expanded >= 3


@pytest.mark.parametrize("algo", ["STANDALONE", "STANDALONE-tree", "EARLY_EXIT"])
def test_radix_hits_retraction_and_aborts_keep_output_and_free_kv(target, truth, algo):
    ps, ref = truth
    h, drafter = harness(target, make_cfg(algo, target, draft="same"), max_running_requests=8,
                         capacity=200, chunked_prefill_size=16, decode_reserve_ratio=0.0)
    base = ps[0]
    for i, p in enumerate(ps[:10]):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=NEW)
    h.submit("hit", base + ref[0][:5], ignore_eos=True, max_new_tokens=NEW)
    h.submit("gone", ps[11], ignore_eos=True, max_new_tokens=NEW)
    for _ in range(4):
        h.sched.step()
    h.sched.handle(AbortReq(rid="gone"))
    h.run()
    assert h.sched.totals["retracted"] > 0, "capacity was meant to force retractions"
    assert [h.outputs[f"r{i}"] for i in range(10)] == ref[:10]
    hit_ref = reference(target[:2], [base + ref[0][:5]], ignore_eos=True, max_new_tokens=NEW)[0]
    assert h.outputs["hit"] == hit_ref
    assert h.finish["gone"]["type"] == "abort"
    h.sched.check_no_leak()  # one allocator covers both pools: the draft KV mirrors its slots
    if algo == "STANDALONE":  # finished requests are released with the next batch
        assert set(drafter.reqs) <= {"hit"}, "released requests left draft state"


def test_early_exit_verify_resumed_from_draft_hidden_states_is_bit_exact(target):
    runner = target[1]
    drafter = create_drafter(make_cfg("EARLY_EXIT", target, early_exit_layer=2), runner)
    assert drafter.resume
    prompt = list(range(5, 25))
    slots = torch.arange(1, len(prompt) + 4)  # 19 committed + 4 fresh
    runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [prompt[:-1]], [slots[:19]], [0]))
    req = RunnerReq.drafting("a", prompt, 4, None, slots=slots[: 19 + 4])
    tree = drafter.propose([req])[0]
    assert tree.num_nodes == 4
    batch = lambda: ForwardBatch.build(  # noqa: E731 - one batch per forward
        ForwardMode.TARGET_VERIFY, [tree.tokens.tolist()], [slots], [19],
        positions=[19 + tree.depth], custom_masks=[tree.ancestor_mask], logits="all")
    resumed = drafter.target_forward(batch(), [tree], False).logits
    full = runner.forward(batch()).logits
    assert torch.equal(resumed, full)
    # and the draft's own tokens are the early exit's greedy choices
    exit_logits = runner.forward(batch(), layers=(0, 2)).logits
    assert tree.tokens[1:].tolist() == exit_logits.argmax(-1)[:3].tolist()


# `make test` runs one chain, one tree and a seeded EARLY_EXIT; the grid is `make test-all`'s
SAMPLED_KEPT = {("STANDALONE", False), ("STANDALONE-tree", False), ("EARLY_EXIT", True)}


@pytest.mark.parametrize("algo,seeded", [
    pytest.param(a, s, marks=() if (a, s) in SAMPLED_KEPT else pytest.mark.full)
    for a in ("STANDALONE", "STANDALONE+vocab", "STANDALONE-tree", "STANDALONE-tree-target-only",
              "EARLY_EXIT", "EARLY_EXIT+adapter") for s in (False, True)])
def test_sampled_chains_follow_the_target_distribution(tiny_vocab, joints, algo,  # noqa: F811
                                                       seeded, tmp_path):
    d, runner = tiny_vocab
    if algo.startswith("STANDALONE"):
        kw = {"draft_model_path": str(init_draft_from_target(d, tmp_path / "dr", [1])),
              "draft_weight_format": "f32"}
        if algo == "STANDALONE+vocab":  # q is zero outside it: the residual restores that mass
            vocab = runner.model_config.vocab_size
            write_draft_vocab(tmp_path / "dr", torch.randperm(
                vocab, generator=torch.Generator().manual_seed(5))[: vocab * 7 // 10])
        if algo.startswith("STANDALONE-tree"):  # children drawn without replacement from q
            kw.update(eagle_topk=2, eagle_target_only=algo.endswith("target-only"))
            cfg = SpecConfig("STANDALONE", 6, num_steps=3, disable_adaptive=True, **kw)
        algo = "STANDALONE"
    elif algo == "EARLY_EXIT":
        kw = {"early_exit_layer": 1}
    else:  # q is zero outside the adapter's vocabulary: the residual must restore that mass
        kw = {"draft_model_path": str(write_adapter(runner, tmp_path / "ad", 1, keep=0.7,
                                                    down_std=0.02))}
        algo = "EARLY_EXIT"
    if algo != "STANDALONE" or "eagle_topk" not in kw:
        cfg = SpecConfig(algo, 4, num_steps=3, disable_adaptive=True, **kw)
    outs, info = run_samples(tiny_vocab, lambda _c, r: create_drafter(cfg, r), seeded=seeded,
                             budget=cfg.num_draft_tokens)
    per_pos = info["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) >= 2 and per_pos[1] > 0, f"no depth-2 draft accepted: {per_pos}"
    for k, fit in enumerate(pair_fits(outs, joints)):
        assert fit.passed, f"tokens {k + 1},{k + 2}: {fit}"


def test_an_incompatible_or_short_draft_fails_at_start_up_with_one_line(target, tmp_path):
    d, runner, _ = target
    other = write_tiny_model(tmp_path / "o", "llama", seed=1)  # the same shape and file names
    swap_two_tokens(other, "Ġthe", "fo")
    with pytest.raises(DraftModelError, match="not vocabulary-compatible") as exc:
        create_drafter(SpecConfig("STANDALONE", 4, num_steps=3, draft_model_path=str(other)),
                       runner)
    assert "names 2 of the ids below 320 differently" in str(exc.value)
    assert "id 267 is 'fo' in the draft, 'Ġthe' in the target" in str(exc.value)
    assert "\n" not in str(exc.value)
    short = init_draft_from_target(d, tmp_path / "short", [0])
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 16}))
    with pytest.raises(DraftModelError, match="fewer than the target's context") as exc:
        create_drafter(SpecConfig("STANDALONE", 4, num_steps=3, draft_model_path=str(short)),
                       runner)
    assert "\n" not in str(exc.value)


def swap_two_tokens(model_dir, a: str, b: str) -> None:
    """The model's tokenizer with tokens `a` and `b` trading ids: another vocabulary of the
    same size."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (model_dir / "tokenizer.json").write_text(json.dumps(spec))


def test_a_draft_whose_embedding_is_smaller_drafts_losslessly(target, truth, tmp_path):
    """The same tokenizer over fewer embedding rows (as Qwen2.5's small models pad to 151936,
    its large ones to 152064): drafts come from the rows it has, output is plain decoding's."""
    from safetensors.torch import load_file, save_file

    d, runner, _ = target
    small = init_draft_from_target(d, tmp_path / "small", [0, 3])
    state = load_file(str(small / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = state[name][:300].contiguous()
    save_file(state, str(small / "model.safetensors"))
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "vocab_size": 300}))
    ps, ref = truth
    h, drafter = harness(target, make_cfg("STANDALONE", target, draft_model_path=str(small)),
                         max_running_requests=8)
    assert drafter.draft.vocab_size == 300 < runner.model_config.vocab_size
    for i, p in enumerate(ps[:16]):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=NEW)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(16)] == ref[:16]
    assert h.sched.spec_totals["spec_decode_num_accepted_tokens"] > 0, "nothing was accepted"
    h.sched.check_no_leak()


def test_server_args_resolve_chains_and_reject_what_does_not_apply(target):
    d = str(target[0])
    args = ServerArgs(model_path=d, speculative_algorithm="STANDALONE",
                      speculative_draft_model_path=str(target[2]["half"]),
                      speculative_num_steps=4).resolve()
    assert (args.speculative_num_draft_tokens, args.speculative_eagle_topk) == (5, 1)
    args = ServerArgs(model_path=d, speculative_config={
        "method": "draft_model", "model": str(target[2]["half"]),
        "num_speculative_tokens": 2}).resolve()
    assert (args.speculative_algorithm, args.speculative_num_steps) == ("STANDALONE", 2)
    args = ServerArgs(model_path=d, speculative_config={"method": "early_exit",
                                                        "early_exit_layer": 2}).resolve()
    assert args.speculative_algorithm == "EARLY_EXIT" and args.speculative_early_exit_layer == 2
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        ServerArgs(model_path=d, speculative_algorithm="STANDALONE").resolve()
    with pytest.raises(ValueError, match="drafts chains"):
        ServerArgs(model_path=d, speculative_algorithm="EARLY_EXIT",
                   speculative_eagle_topk=4).resolve()
    with pytest.raises(ValueError, match="early-exit-layer applies to"):
        ServerArgs(model_path=d, speculative_algorithm="NGRAM",
                   speculative_early_exit_layer=3).resolve()
    with pytest.raises(ValueError, match=r"must be in \[1, 3\]"):
        create_drafter(make_cfg("EARLY_EXIT", target, early_exit_layer=4), target[1])


def test_spread_layers_keeps_first_and_last():
    assert spread_layers(30, 4) == [0, 10, 19, 29]
    assert spread_layers(4, 1) == [0]
    with pytest.raises(ValueError):
        spread_layers(4, 5)
