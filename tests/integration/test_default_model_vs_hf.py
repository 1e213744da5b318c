"""The default model (SmolLM2-135M-Instruct) through our runner against HF transformers."""

from __future__ import annotations

import pytest
import torch

from runtime.model_loader.default_model import resolve_model_path
from runtime.model_loader.tokenizer import apply_chat_template, load_tokenizer
from runtime.model_runner.forward_batch import ForwardBatch, ForwardMode
from runtime.model_runner.local_generator import LocalGenerator
from runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from runtime.sampling.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis in two sentences.",
    "List three tips for staying focused while studying.",
    "Translate 'good morning' into Spanish and German.",
]


@pytest.fixture(scope="module")
def model_dir():
    return str(resolve_model_path(None))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def runner(model_dir):
    return ModelRunner(RunnerConfig(model_dir, "cpu", "float32", max_total_tokens=4096))


@pytest.fixture(scope="module")
def chat_ids(model_dir):
    tok = load_tokenizer(model_dir)
    return [apply_chat_template(tok, [{"role": "user", "content": p}]) for p in CHAT_PROMPTS]


def test_default_model_logits_match_hf_within_1e_3(runner, hf_model, chat_ids):
    ids = chat_ids[1]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    slots = torch.arange(1, len(ids) + 1)
    ours = runner.forward(
        ForwardBatch.build(ForwardMode.EXTEND, [ids], [slots], [0], logits="all")
    ).logits
    assert (ours - ref).abs().max().item() < 1e-3


def first_divergence_is_a_near_tie(ours: list[int], ref: list[int], step_logits) -> bool:
    """True when the outputs agree, or differ first where the top-two logits are within 1e-4."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = step_logits[i].topk(2).values
            return float(top2[0] - top2[1]) <= 1e-4
    return len(ours) == len(ref)


def test_greedy_generation_equals_hf_for_5_chat_prompts_x_64_tokens(runner, hf_model, chat_ids):
    gen = LocalGenerator(runner)
    # both run 64 tokens straight past EOS (HF's min_new_tokens would mask EOS instead)
    params = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)
    hf_model.generation_config.eos_token_id = None
    ours = gen.generate(chat_ids, params, keep_logits=True)
    for req, ids in zip(ours, chat_ids):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=64, do_sample=False, pad_token_id=0,
            )[0, len(ids):].tolist()
        assert len(ref) == 64
        assert first_divergence_is_a_near_tie(req.output_ids, ref, req.logits), (
            f"diverged from HF: ours {req.output_ids[:20]} ref {ref[:20]}"
        )
    assert gen.allocator.num_free == gen.allocator.capacity
