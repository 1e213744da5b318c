"""GGUF files of the Llama family (llama.cpp's `llama`, `qwen2`, `qwen3`), tiny and random,
written in the test as llama.cpp's converter lays them out (tests/helpers/tiny_gguf.py): on both
engines the logits of transformers' own reading of the same file (its config, dequantization and
tensor mapping), in F32, 4/5/8-bit blocks (untied and tied head) and K-quants; the CPU engine
runs the file's own blocks; greedy output is transformers' token for token; NGRAM's, SUFFIX's,
LOOKAHEAD's and EARLY_EXIT's output equals plain decoding's with drafts accepted. Llama 3.1's
`rope_freqs` become transformers' `llama3` rope. Misreading a family's q / k row order is caught
(negative controls). The tokenizer is transformers' reading of the file; the chat template the
file's, else the one passed."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from specserve.kernels import cpu
from specserve.runtime.errors import ModelLoadError
from specserve.runtime.model_loader import gguf_llama
from specserve.runtime.model_loader.config import ModelConfig
from specserve.runtime.model_loader.gguf_convert import convert_gguf
from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.speculative.base import SpecConfig, create_drafter
from specserve.speculative.worker import SpeculativeWorker
from tests.helpers.tiny_gguf import FAMILIES, transformers_gguf_model, write_family_gguf
from tests.unit.test_cpu_engine import PROMPT, prefill_logits, runner
from tests.unit.test_scheduler import Harness, prompts, reference

OK, WHY = cpu.available()
MIXED = {"q_proj": "Q5_0", "k_proj": "Q5_0", "v_proj": "Q8_0", "o_proj": "Q4_1",
         "gate_proj": "Q4_0", "up_proj": "Q4_0", "down_proj": "Q5_1"}
# a Q4_K_M file's choice: Q4_K, with Q6_K for v, down and the head
# (o_proj: Q5_K_M's type, so that each K-quant is met)
KQUANT = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q5_K",
          "gate_proj": "Q4_K", "up_proj": "Q4_K", "down_proj": "Q6_K"}
LAYOUTS = {
    "f32": dict(),
    "blocks": dict(linear_type=MIXED, embed_type="Q8_0"),
    "blocks_tied": dict(linear_type=MIXED, embed_type="Q8_0", tied=True),
    "kquants": dict(linear_type=KQUANT, embed_type="Q6_K", hidden_size=256,
                    intermediate_size=256),
}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(arch, layout) -> (GGUF path, converted directory)."""
    root = tmp_path_factory.mktemp("gguf_families")
    out = {}
    for arch in FAMILIES:
        for name, kw in LAYOUTS.items():
            path = root / f"{arch}-{name}.gguf"
            write_family_gguf(path, arch, seed=len(out), **kw)
            out[arch, name] = path, str(convert_gguf(path, root / f"{arch}-{name}",
                                                     progress=False))
    return out


def transformers_logits(path, ids) -> torch.Tensor:
    with torch.no_grad():
        return transformers_gguf_model(path)(torch.tensor([ids])).logits[0].double()


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", FAMILIES)
def test_both_engines_give_transformers_logits_on_the_same_gguf(files, arch, layout):
    path, model_dir = files[arch, layout]
    ref = transformers_logits(path, PROMPT)
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.architecture == gguf_llama.FAMILIES[arch].hf_architecture
    assert cfg.tie_word_embeddings is (layout == "blocks_tied")
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.attention_bias is (arch == "qwen2") and cfg.qk_norm is (arch == "qwen3")
    # the same dequantized weights in float32: only the summation order differs
    assert rel_err(prefill_logits(runner(model_dir, "torch"), PROMPT).logits, ref) < 5e-5
    if not OK:
        pytest.skip(WHY)
    fast = runner(model_dir)
    # the file's own blocks, activations rounded to ~22 bits
    assert rel_err(prefill_logits(fast, PROMPT).logits, ref) < 1e-4
    if layout != "f32":  # (mixed q / k / v: Q5_0 + Q8_0 fused as Q8_0, which holds both
        # exactly; Q4_K q / k beside a Q6_K v kept as two parts in their own formats)
        kept = {"q4_0", "q4_1", "q5_1", "q8_0"} if "blocks" in layout else {"q4_k", "q5_k",
                                                                              "q6_k"}
        assert set(fast.weight_formats) == kept, fast.weight_formats


@pytest.mark.parametrize(("arch", "permuted"), [("llama", False), ("qwen2", True)])
def test_misreading_the_qk_row_order_is_caught(files, tmp_path, monkeypatch, arch, permuted):
    """Negative control: read a llama file's rows as unpermuted, or a qwen2 file's as llama's,
    and the logits part from transformers'."""
    path, _ = files[arch, "f32"]
    fam = dataclasses.replace(gguf_llama.FAMILIES[arch], permuted_qk=permuted)
    monkeypatch.setitem(gguf_llama.FAMILIES, arch, fam)
    wrong = convert_gguf(path, tmp_path / "wrong", progress=False)
    assert rel_err(prefill_logits(runner(str(wrong), "torch"), PROMPT).logits,
                   transformers_logits(path, PROMPT)) > 1e-2


@pytest.mark.skipif(not OK, reason=f"CPU extension unavailable: {WHY}")
@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_output_is_transformers_token_for_token(files, arch):
    path, model_dir = files[arch, "blocks"]
    hf = transformers_gguf_model(path)
    r = runner(model_dir)
    ps = prompts(3, seed=5)
    ours = reference((model_dir, r), ps, ignore_eos=True, max_new_tokens=16)
    for p, out in zip(ps, ours):
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=16,
                                 min_new_tokens=16)[0, len(p):].tolist()
        assert out == theirs


# the draftless methods, and the target's own first layer as the draft
SPEC = {"NGRAM": {}, "SUFFIX": {}, "LOOKAHEAD": {}, "EARLY_EXIT": {"early_exit_layer": 1}}


@pytest.mark.skipif(not OK, reason=f"CPU extension unavailable: {WHY}")
@pytest.mark.parametrize("algo", list(SPEC))
@pytest.mark.parametrize("arch", FAMILIES)
def test_speculation_equals_plain_decoding_with_drafts_accepted(files, arch, algo):
    _, model_dir = files[arch, "kquants"]
    tiny = (model_dir, runner(model_dir))
    ps = [p * 3 for p in prompts(6, seed=2)]  # repeats: the n-gram drafters get accepted
    plain = reference(tiny, ps, ignore_eos=True, max_new_tokens=24)
    h = Harness(tiny, num_draft_tokens=6, max_running_requests=4)
    cfg = SpecConfig(algo, 6, num_steps=3 if algo == "EARLY_EXIT" else None, **SPEC[algo])
    h.worker = RunnerWorker(tiny[1], SpeculativeWorker(cfg, create_drafter(cfg, tiny[1]),
                                                       tiny[1]))
    h.sched.run_batch = h.worker.run
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=24)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(len(ps))] == plain
    assert h.sched.info()["spec_decode_num_accepted_tokens"] > 0
    h.sched.check_no_leak()


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama3")
    hf_dir = write_family_gguf(root / "l3.gguf", "llama", seed=4, rope_scaling=LLAMA3_ROPE)
    return hf_dir, convert_gguf(root / "l3.gguf", root / "l3", progress=False)


def test_llama3_rope_freqs_become_transformers_llama3_rope(llama3, tmp_path):
    """Llama 3.1's scaling is in `rope_freqs`, not the metadata. transformers' GGUF reader
    skips that tensor, so the reference is the float model the file was written from."""
    from transformers import AutoModelForCausalLM

    hf_dir, model_dir = llama3
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling == LLAMA3_ROPE
    ids = PROMPT + PROMPT + PROMPT  # 51 positions: the slowed frequencies turn
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        ref = hf(torch.tensor([ids])).logits[0].double()
    assert rel_err(prefill_logits(runner(str(model_dir), "torch"), ids).logits, ref) < 5e-6
    unscaled = tmp_path / "unscaled"  # negative control: the same file without the scaling
    shutil.copytree(model_dir, unscaled)
    raw = json.loads((unscaled / "config.json").read_text())
    raw.pop("rope_scaling")
    (unscaled / "config.json").write_text(json.dumps(raw))
    assert rel_err(prefill_logits(runner(str(unscaled), "torch"), ids).logits, ref) > 1e-3


@pytest.mark.parametrize(("factor", "old"), [(8.0, 8192), (32.0, 8192), (8.0, 64)])
def test_llama3_rope_parameters_come_back_from_their_divisors(factor, old):
    """Llama 3.1 (factor 8) and 3.2 (32) at their real head size and base, and a band that
    holds a single blended frequency at a small head size."""
    from tests.helpers.tiny_gguf import llama3_rope_divisors

    head_dim = 128 if old == 8192 else 16
    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": old}
    div = llama3_rope_divisors({"rope_scaling": rope, "rope_theta": 500000.0,
                                "head_dim": head_dim})
    assert gguf_llama.llama3_rope_scaling(div, head_dim, 500000.0) == rope


def test_divisors_that_are_not_llama3s_are_refused():
    div = torch.linspace(1.0, 8.0, 64).flip(0).numpy()  # slowed most where Llama 3 keeps
    with pytest.raises(ModelLoadError, match="do not follow Llama 3"):
        gguf_llama.llama3_rope_scaling(div, 128, 500000.0)
    assert gguf_llama.llama3_rope_scaling(div * 0 + 1, 128, 500000.0) is None


def test_tokenizer_and_chat_template_come_from_the_file_else_the_flag(tmp_path):
    from transformers import AutoTokenizer

    from specserve.runtime.model_loader.tokenizer import apply_chat_template, load_tokenizer
    from tests.helpers.tiny_models import CHATML_TEMPLATE

    msgs = [{"role": "user", "content": "the quick brown fox"}]
    toks = {}
    for name, template in (("with", True), ("without", False)):
        write_family_gguf(tmp_path / f"{name}.gguf", "qwen2", chat_template=template)
        toks[name] = load_tokenizer(convert_gguf(tmp_path / f"{name}.gguf", tmp_path / name,
                                                 progress=False))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="with.gguf")
    for text in ("def add(a, b):\n    return a + b\n", "Hello, world! 1234567890 café 日本語",
                 "  a  1  x2024\n\n\n b", "<|im_start|>user\nhi<|im_end|>"):
        assert toks["with"].encode(text) == theirs.encode(text)
    assert toks["with"].eos_token == "<|im_end|>"
    rendered = apply_chat_template(toks["with"], msgs)
    assert toks["with"].decode(rendered).startswith("<|im_start|>user\nthe quick brown fox")
    assert toks["without"].chat_template is None
    with pytest.raises(ModelLoadError, match="no chat template"):
        apply_chat_template(toks["without"], msgs)
    assert apply_chat_template(toks["without"], msgs, chat_template=CHATML_TEMPLATE) == rendered
