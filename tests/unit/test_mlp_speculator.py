"""MLP_SPECULATOR: checkpoints in the layout vLLM and IBM publish (untied, tied, "speculator."
keys, pytorch_model.bin read weights-only) load and compute the reference's stages, ours with a
reduced draft vocabulary too; the CPU engine's fused stages follow the torch stages; and
greedy (chains and trees) and seeded output equal plain decoding on the tiny model at batch 1
and 8, with drafts accepted (stages steered toward the known continuation)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from specserve.kernels import cpu
from specserve.runtime.model_runner.local_generator import LocalGenerator
from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.speculative.base import RunnerReq, SpecConfig, TargetRows, create_drafter
from specserve.speculative.drafters.mlp_speculator import MlpSpeculatorDrafter
from specserve.speculative.models.mlp_speculator import (
    MlpSpeculator,
    MlpSpeculatorConfig,
    MlpSpeculatorError,
    load_mlp_speculator,
    save_mlp_speculator,
)
from specserve.speculative.models.mlp_speculator_cpu import PackedStages
from specserve.speculative.worker import SpeculativeWorker
from tests.integration.test_spec_lossless import copy_heavy_prompts
from tests.unit.test_scheduler import Harness, tiny  # noqa: F401
from tests.unit.test_spec_sampling_distribution import joints, tiny_vocab  # noqa: F401

H, V = 32, 50
needs_ext = pytest.mark.skipif(not cpu.available()[0], reason="the CPU extension is not built")


def public_tensors(n: int, inner: int, tied: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """A checkpoint as IBM's trainer saves it (keys under "speculator."), random values."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(1 if tied else n):
        sd[f"speculator.emb.{i}.weight"] = torch.randn(V, inner, generator=g)
        sd[f"speculator.head.{i}.weight"] = torch.randn(V, inner, generator=g) / inner ** 0.5
        sd[f"speculator.ln.{i}.weight"] = 1 + 0.2 * torch.randn(inner, generator=g)
        sd[f"speculator.ln.{i}.bias"] = 0.2 * torch.randn(inner, generator=g)
    for i in range(2 if tied else n):
        sd[f"speculator.proj.{i}.weight"] = torch.randn(inner, H if i == 0 else inner,
                                                        generator=g) / H ** 0.5
    return sd


def write_public(path, n=3, inner=0, tied=False, scale_input=True, seed=0, weights="st"):
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
           "emb_dim": H, "inner_dim": inner, "vocab_size": V, "n_predict": n,
           "top_k_tokens_per_head": [4] * n, "n_candidates": 4, "tie_weights": tied,
           "scale_input": scale_input}
    (path / "config.json").write_text(json.dumps(cfg))
    sd = public_tensors(n, inner or H, tied, seed)
    if weights == "st":
        save_file(sd, str(path / "model.safetensors"))
    else:
        torch.save(sd, path / "pytorch_model.bin")
    return path, {k.removeprefix("speculator."): v for k, v in sd.items()}


def reference_chain(sd, n_predict, tied, scale_input, h, root, depth):
    """The reference's generate loop, top-1 per stage, written out: [depth] token ids."""
    inner = sd["proj.0.weight"].shape[0]
    sw = 0.5 ** (0.5 / n_predict)
    ew = math.sqrt(1 - sw ** 2) * math.sqrt(inner / 2)
    state = h
    if scale_input:
        state = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) / math.sqrt(2)
    tok, out = root, []
    for i in range(depth):
        s, p = (0, min(i, 1)) if tied else (i, i)
        x = state @ sd[f"proj.{p}.weight"].T * sw + sd[f"emb.{s}.weight"][tok] * ew
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        x = x * sd[f"ln.{s}.weight"] + sd[f"ln.{s}.bias"]
        state = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
        tok = int((state @ sd[f"head.{s}.weight"].T).argmax())
        out.append(tok)
    return out


@pytest.mark.parametrize("tied,weights,inner", [(False, "st", 0), (True, "st", 64),
                                                (False, "bin", 64)])
def test_a_public_checkpoint_loads_and_computes_the_reference_stages(tmp_path, tied, weights,
                                                                     inner):
    path, sd = write_public(tmp_path, tied=tied, inner=inner, weights=weights)
    model = load_mlp_speculator(path, H, V)
    assert model.cfg.inner_dim == (inner or H) and model.cfg.tie_weights == tied
    stages = PackedStages(model, torch.float32, 1)
    for seed in range(5):
        h = torch.randn(H, generator=torch.Generator().manual_seed(seed)) * 3
        want = reference_chain(sd, 3, tied, True, h, 7 + seed, 3)
        run = stages.run(0, 3, stages.first_state(h[None]), [stages.emb_index[7 + seed]], 1)
        assert [lv[0][0] for lv in run.tokens] == want


def test_a_pickled_object_is_refused(tmp_path):
    write_public(tmp_path, weights="bin")
    torch.save({"emb.0.weight": object()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(Exception, match="(?i)weights_only|unpickl|global"):
        load_mlp_speculator(tmp_path, H, V)


def test_a_checkpoint_that_does_not_fit_fails_clearly(tmp_path):
    write_public(tmp_path)
    with pytest.raises(MlpSpeculatorError, match="hidden size 33 and vocabulary 50"):
        load_mlp_speculator(tmp_path, H + 1, V)
    sd = {k: v for k, v in public_tensors(3, H, False).items() if "ln.1.bias" not in k}
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(MlpSpeculatorError, match="missing ln.1.bias"):
        load_mlp_speculator(tmp_path, H, V)
    with pytest.raises(MlpSpeculatorError, match="config.json"):
        load_mlp_speculator(tmp_path / "nowhere", H, V)


def reduced_speculator(path, tied=True, seed=0):
    torch.manual_seed(seed)
    ids = torch.randperm(V)[:20].sort().values
    model = MlpSpeculator(MlpSpeculatorConfig(H, 64, V, 3, tied, True, 20), ids)
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    return save_mlp_speculator(model, path), model


def test_our_reduced_vocabulary_round_trips_and_maps_other_roots_to_the_last_row(tmp_path):
    path, model = reduced_speculator(tmp_path)
    back = load_mlp_speculator(path, H, V)
    assert torch.equal(back.draft_ids, model.draft_ids) and back.emb[0].weight.shape == (21, 64)
    outside = next(t for t in range(V) if t not in set(model.draft_ids.tolist()))
    assert back.emb_index[outside] == 20 and back.emb_index[model.draft_ids[3]] == 3
    x = torch.randn(2, H)
    with torch.no_grad():
        got = back.logits(0, back.stage(0, back.scale_input(x), torch.tensor([3, 20])))
        want = model.logits(0, model.stage(0, model.scale_input(x), torch.tensor([3, 20])))
    torch.testing.assert_close(got, want)
    # a tied export holds the shared tensors once, under the names vLLM reads
    saved = json.loads((path / "config.json").read_text())
    assert saved["tie_weights"] and saved["draft_vocab_size"] == 20
    assert set(model.public_state()) == {"emb.0.weight", "head.0.weight", "ln.0.weight",
                                         "ln.0.bias", "proj.0.weight", "proj.1.weight"}


@needs_ext
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_engine_stages_follow_the_torch_stages_and_a_chain_is_its_levels(tmp_path, fmt):
    _, model = reduced_speculator(tmp_path, tied=False)
    fast, ref = PackedStages(model, fmt, 2), PackedStages(model, torch.float32, 1)
    assert fast.core is not None and ref.core is None
    h = torch.randn(6, H) * 2
    rows = [fast.emb_index[t] for t in (1, 5, 9, 13, 40, 49)]
    chain = fast.run(0, 3, fast.first_state(h), rows, 2)
    state, ref_state, lv_rows = fast.first_state(h), ref.first_state(h), rows
    for i in range(3):  # the same stages one run each, fed the previous top-1
        one = fast.run(i, 1, state, lv_rows, 2)
        assert one.tokens[0] == chain.tokens[i] and one.logq[0] == chain.logq[i]
        want = ref.run(i, 1, ref_state, lv_rows, 2)  # float32 torch, the same inputs
        tol = (0.05 if fmt == "q8_0" else 0.15) * want.logits.abs().max()
        assert (one.logits - want.logits).abs().max() < tol
        state, ref_state = one.state, one.state
        lv_rows = [fast.emb_index[row[0]] for row in one.tokens[0]]
    assert torch.equal(state, chain.state)


def test_depth_is_bounded_by_the_checkpoints_stages(tiny, tmp_path):  # noqa: F811
    from specserve.launch.server_args import ServerArgs

    path, _ = write_public(tmp_path / "spec", n=2)
    model = str(tiny[0])
    args = ServerArgs(model_path=model, speculative_algorithm="MLP_SPECULATOR",
                      speculative_draft_model_path=str(path)).resolve()
    assert (args.speculative_num_steps, args.speculative_eagle_topk,
            args.speculative_num_draft_tokens) == (2, 1, 3)  # the CPU chain, cut to n_predict
    with pytest.raises(ValueError, match="exceeds the 2 stages"):
        ServerArgs(model_path=model, speculative_algorithm="MLP_SPECULATOR",
                   speculative_draft_model_path=str(path), speculative_num_steps=3).resolve()
    with pytest.raises(ValueError, match="MLP_SPECULATOR needs --speculative-draft-model-path"):
        ServerArgs(model_path=model, speculative_algorithm="MLP_SPECULATOR").resolve()
    vllm = ServerArgs(model_path=model, speculative_config=json.dumps(
        {"method": "mlp_speculator", "model": str(path), "num_speculative_tokens": 2})).resolve()
    assert vllm.speculative_algorithm == "MLP_SPECULATOR"
    assert vllm.speculative_num_draft_tokens == 3 and vllm.speculative_eagle_topk == 1


def tiny_speculator(model_dir, out_dir, seed=0):
    cfg = json.loads((model_dir / "config.json").read_text())
    torch.manual_seed(seed)
    model = MlpSpeculator(MlpSpeculatorConfig(cfg["hidden_size"], 64, cfg["vocab_size"], 3,
                                              True, True))
    return save_mlp_speculator(model, out_dir)


def test_a_tree_level_is_one_run_over_every_frontier(tiny, tmp_path):  # noqa: F811
    path = tiny_speculator(tiny[0], tmp_path / "spec")
    d = create_drafter(SpecConfig("MLP_SPECULATOR", 7, draft_model_path=str(path), num_steps=3,
                                  eagle_topk=2), tiny[1])
    runs = []
    run_of = d._stage_run
    d._stage_run = lambda *a: runs.append(a[1:5:]) or run_of(*a)
    hid = torch.randn(2, json.loads((tiny[0] / "config.json").read_text())["hidden_size"])

    class Out:
        final_hidden = hid

    d.draft_extend([TargetRows(f"r{i}", 0, torch.arange(3), torch.tensor([i]), [5], [4])
                    for i in range(2)], Out)
    trees = d.propose([RunnerReq.drafting(f"r{i}", [4, 5], 7) for i in range(2)])
    assert [len(r[0]) for r in runs] == [2, 4, 4]  # the roots, then top-k 2 of each request
    assert [(r[1], r[2]) for r in runs] == [(0, 1), (1, 1), (2, 1)]
    assert all(t.num_nodes == 7 and max(t.depth.tolist()) <= 3 for t in trees)
    # a request that decoded a step without the drafter has no state below its root
    stale = d.propose([RunnerReq.drafting("r0", [4, 5, 6], 7)])
    assert stale[0].num_nodes == 1 and len(runs) == 3


class SteeredMlp(MlpSpeculatorDrafter):
    """Puts each row's known next tokens (from `truth`: prompt -> output) first in three steps
    of four (the fourth left as the stages have it): chains and top-k trees by their top
    tokens, sampled trees by their logits."""

    truth: dict[tuple, list[int]]

    def _stage_run(self, work, flat, first, count, state, rows, k):
        run = super()._stage_run(work, flat, first, count, state, rows, k)
        logits = run.logits.clone()
        for j, (b, u) in enumerate(flat):
            r, tree = work[b][1], work[b][2]
            path = []
            while u > 0:
                path.append(tree.tokens[u])
                u = tree.parents[u]
            ctx = r.tokens + path[::-1]
            if len(r.tokens) % 4 == 3:
                continue
            cont = next((out[len(ctx) - len(p):] for p, out in self.truth.items()
                         if list(p) == ctx[: len(p)]), [])
            for c in range(min(count, len(cont))):
                run.tokens[c][j][0], run.logq[c][j][0] = cont[c], 0.0
            if cont and count == 1:
                logits[j, self.stages.emb_index[cont[0]]] = logits[j].max() + 6.0
        return run._replace(logits=logits)


@pytest.mark.parametrize("params", [{"temperature": 0.0},
                                    {"temperature": 0.8, "top_p": 0.9, "seed": 0}],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("concurrency,topk", [(1, 1), (8, 1), (8, 2)])
def test_tiny_model_mlp_speculator_equals_plain_with_drafts_accepted(
        tiny, tmp_path, concurrency, topk, params):  # noqa: F811
    path = tiny_speculator(tiny[0], tmp_path / "spec")
    prompts = copy_heavy_prompts(16, seed=40 + concurrency)
    sps = [SamplingParams(max_new_tokens=20, ignore_eos=True,
                          **{**params, **({"seed": 100 + i} if "seed" in params else {})})
           for i in range(len(prompts))]
    ref = [r.output_ids for r in LocalGenerator(tiny[1]).generate(prompts, sps)]
    nodes = 4 if topk == 1 else 6
    h = Harness(tiny, num_draft_tokens=nodes, max_running_requests=concurrency)
    cfg = SpecConfig("MLP_SPECULATOR", nodes, draft_model_path=str(path), num_steps=3,
                     eagle_topk=topk, disable_adaptive=True)
    runner = tiny[1]
    drafter = SteeredMlp(cfg, runner)
    drafter.truth = {tuple(p): r for p, r in zip(prompts, ref)}
    h.worker = RunnerWorker(runner, SpeculativeWorker(cfg, drafter, runner))
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        h.submit(f"r{i}", p, **sp.to_dict())
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(len(prompts))] == ref
    info = h.sched.info()
    assert info["spec_decode_num_accepted_tokens"] > 0.2 * info["spec_decode_num_draft_tokens"]
    assert info["avg_spec_accept_length"] > 1.5, info["avg_spec_accept_length"]
    h.sched.check_no_leak()


def test_unseeded_sampling_follows_the_target_distribution(tiny_vocab, joints):  # noqa: F811
    """Trees drawn from q over a reduced draft vocabulary (8 of the 12 ids), verified with q
    (WITHOUT_REPLACEMENT): the tokens at every verify position follow the target's processed
    distribution (penalties included), and depth-2 drafts are accepted."""
    from tests.unit.test_spec_sampling_distribution import PARAMS, PROMPT, TOKENS, pair_fits

    runner = tiny_vocab[1]
    mc = runner.model_config
    torch.manual_seed(0)
    ids = torch.tensor([1, 2, 3, 5, 6, 7, 9, 11])
    model = MlpSpeculator(MlpSpeculatorConfig(mc.hidden_size, 32, mc.vocab_size, 2, True, True,
                                              len(ids)), ids)
    for p in model.parameters():
        p.data.normal_(0, 0.5)
    path = save_mlp_speculator(model, tiny_vocab[0].parent / "mlp_tv")
    cfg = SpecConfig("MLP_SPECULATOR", 6, draft_model_path=str(path), num_steps=2, eagle_topk=3,
                     disable_adaptive=True)
    drafter = create_drafter(cfg, runner)
    with_q = []
    propose = drafter.propose
    drafter.propose = lambda reqs: [with_q.append(t.draft_probs is not None) or t
                                    for t in propose(reqs)]
    samples = 3000
    h = Harness(tiny_vocab, capacity=60000, num_draft_tokens=6, max_running_requests=512,
                chunked_prefill_size=4096)
    h.worker = RunnerWorker(runner, SpeculativeWorker(cfg, drafter, runner))
    h.sched.run_batch = h.worker.run
    h.sched.stop.eos = set()
    for i in range(samples):
        h.submit(f"s{i}", PROMPT, max_new_tokens=TOKENS, **PARAMS)
    h.run()
    assert with_q and all(with_q), "sampled trees carry q"
    per_pos = h.sched.info()["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) >= 2 and per_pos[1] > 0, f"no depth-2 draft accepted: {per_pos}"
    outs = torch.tensor([h.outputs[f"s{i}"] for i in range(samples)])
    for k, fit in enumerate(pair_fits(outs, joints)):
        assert fit.passed, f"tokens {k + 1},{k + 2}: {fit}"
    h.sched.check_no_leak()
