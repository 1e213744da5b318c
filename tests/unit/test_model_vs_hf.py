"""Our Llama-family model against Hugging Face transformers on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch

from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from tests.helpers.tiny_models import write_tiny_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    dirs = {arch: write_tiny_model(root / arch, arch, seed=i) for i, arch in enumerate(ARCHS)}
    dirs["llama_tied"] = write_tiny_model(root / "llama_tied", "llama", seed=7,
                                          tie_word_embeddings=True)
    dirs["llama3_rope"] = write_tiny_model(
        root / "llama3_rope", "llama", seed=8,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    )
    return dirs


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, vocab]


def run_prefill_then_decode(runner: ModelRunner, ids: list[int], split: int) -> torch.Tensor:
    """Prefill ids[:split] (all logits), then decode the rest one token at a time."""
    slots = torch.arange(1, len(ids) + 1)
    out = [runner.forward(ForwardBatch.build(
        ForwardMode.EXTEND, [ids[:split]], [slots[:split]], [0], logits="all")).logits]
    for t in range(split, len(ids)):
        batch = ForwardBatch.build(ForwardMode.DECODE, [[ids[t]]], [slots[: t + 1]], [t])
        out.append(runner.forward(batch).logits)
    return torch.cat(out)


@pytest.mark.parametrize("arch", ARCHS + ["llama_tied", "llama3_rope"])
@pytest.mark.parametrize("pack", [False, True])
def test_logits_match_hf_within_1e_3(tiny_dirs, arch, pack):
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = hf_logits(tiny_dirs[arch], ids)
    runner = ModelRunner(RunnerConfig(str(tiny_dirs[arch]), "cpu", "float32",
                                      max_total_tokens=256, pack_weights=pack))
    ours = run_prefill_then_decode(runner, ids, split=25)
    assert (ours - ref).abs().max().item() < 1e-3


def test_batched_extend_with_prefixes_matches_single_requests(tiny_dirs):
    runner = ModelRunner(RunnerConfig(str(tiny_dirs["qwen3"]), "cpu", "float32",
                                      max_total_tokens=512))
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (7, 19, 30)]
    refs = [hf_logits(tiny_dirs["qwen3"], p)[-1] for p in prompts]
    # cache a prefix of each prompt first, then extend the rest of all three in one batch
    slots = [torch.arange(1, len(p) + 1) + 100 * i for i, p in enumerate(prompts)]
    splits = [3, 10, 0]
    for p, s, k in zip(prompts, slots, splits):
        if k:
            runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [p[:k]], [s[:k]], [0]))
    batch = ForwardBatch.build(
        ForwardMode.EXTEND, [p[k:] for p, k in zip(prompts, splits)], slots, splits
    )
    logits = runner.forward(batch).logits
    for row, ref in zip(logits, refs):
        assert (row - ref).abs().max().item() < 1e-3


def test_verify_tree_logits_equal_each_path_run_causally(tiny_dirs):
    """TARGET_VERIFY over a tree gives every node the logits of its root-to-node path."""
    runner = ModelRunner(RunnerConfig(str(tiny_dirs["llama"]), "cpu", "float32",
                                      max_total_tokens=256))
    prompt = list(range(10, 30))
    tree_tokens = [40, 41, 42, 43, 44, 45]
    parents = [-1, 0, 0, 1, 1, 2]
    depth = [0, 1, 1, 2, 2, 2]
    mask = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    slots = torch.arange(1, len(prompt) + 7)
    runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [prompt], [slots[:20]], [0]))
    verify = ForwardBatch.build(
        ForwardMode.TARGET_VERIFY, [tree_tokens], [slots], [20],
        positions=[20 + torch.tensor(depth)], custom_masks=[mask], logits="all",
    )
    tree_logits = runner.forward(verify).logits
    for node in range(6):
        path = [tree_tokens[j] for j in torch.nonzero(mask[node]).flatten().tolist()]
        ref = hf_logits(tiny_dirs["llama"], prompt + path)[-1]
        assert (tree_logits[node] - ref).abs().max().item() < 1e-3


def test_capture_layers_returns_hidden_states_entering_layers(tiny_dirs):
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(RunnerConfig(str(tiny_dirs["llama"]), "cpu", "float32",
                                      max_total_tokens=64))
    ids = list(range(5, 17))
    batch = ForwardBatch.build(ForwardMode.EXTEND, [ids], [torch.arange(1, 13)], [0],
                               capture_layers=(0, 1, 2))
    out = runner.forward(batch, return_final_hidden=True)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    # HF: hidden_states[i] enters layer i; the last one is after the final norm
    for i in (0, 1):
        torch.testing.assert_close(out.captured[i], hs[i][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.final_hidden, hs[2][0], atol=1e-4, rtol=1e-4)
    assert set(out.captured) == {0, 1, 2}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_stays_close_to_fp32(tiny_dirs, dtype):
    ids = list(range(3, 40))
    ref = run_prefill_then_decode(
        ModelRunner(RunnerConfig(str(tiny_dirs["qwen2"]), "cpu", "float32", max_total_tokens=64)),
        ids, split=30,
    )
    runner = ModelRunner(RunnerConfig(str(tiny_dirs["qwen2"]), "cpu", dtype, max_total_tokens=64))
    assert runner.kv_pool.k[0].dtype == getattr(torch, dtype)
    ours = run_prefill_then_decode(runner, ids, split=30)
    assert ours.dtype == torch.float32 and torch.isfinite(ours).all()
    # half precision: logits agree to ~1e-2 relative; argmax mostly agrees
    assert (ours - ref).abs().max().item() < 0.1 * ref.abs().max().item()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
