"""A tiny GGUF of each Llama-family architecture served by `python -m launch_server --model-path
FILE.gguf` (real processes): greedy text over /generate equal to transformers' greedy on the same
weights, chat rendered with the file's template (or `--chat-template` for a file without one),
NGRAM output equal to plain with drafts accepted, the target's own file as a GGUF STANDALONE
draft accepted everywhere, and a draft GGUF with another vocabulary stopping the server at
start-up with one line. The files:
- qwen2: 4/5/8-bit blocks, q / k / v biases, its ChatML template;
- qwen3: K-quants (Q4_K, Q5_K, Q6_K), q / k norms, no template in the file;
- llama: Llama 3.1-style `rope_freqs`, float32 (transformers' GGUF reader skips `rope_freqs`,
  so the reference is the float model the file was written from).
Tied heads are covered in tests/unit/test_gguf_families.py (a tiny random model with one
repeats its last token, which shows little here).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from benchmark.common import free_port
from specserve.kernels import cpu
from specserve.kernels.cache import cache_dir
from tests.helpers.server_proc import ROOT, ServerProcess
from tests.helpers.tiny_gguf import transformers_gguf_model, write_family_gguf
from tests.helpers.tiny_models import CHATML_TEMPLATE
from tests.unit.test_gguf_families import KQUANT, LLAMA3_ROPE, MIXED

OK, WHY = cpu.available()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not OK, reason=f"CPU extension unavailable: {WHY}")]
FILES = {
    "qwen2": dict(linear_type=MIXED, embed_type="Q8_0"),
    "qwen3": dict(linear_type=KQUANT, embed_type="Q6_K", hidden_size=256, intermediate_size=256,
                  chat_template=False),
    "llama": dict(rope_scaling=LLAMA3_ROPE),
}
# every family in `make test-all`; one proves the served path in `make test` (the in-process
# tests in tests/unit/test_gguf_families.py cover each family there)
ARCHS = [a if a == "qwen2" else pytest.param(a, marks=pytest.mark.full) for a in FILES]
PROMPTS = ["the quick brown fox jumps over the lazy dog",
           "def add(a, b):\n    return a + b\n",
           "speculative decoding drafts tokens and the target model verifies them"]
NEW = 24


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """arch -> (GGUF, the float model it came from, a GGUF alike but for its vocabulary). The
    servers convert into a cache of the module's own; the built CPU extension is shared."""
    root = tmp_path_factory.mktemp("served")
    (cache_dir() / "cpu_ext").mkdir(parents=True, exist_ok=True)
    (root / "cache").mkdir()
    (root / "cache" / "cpu_ext").symlink_to(cache_dir() / "cpu_ext", target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSERVE_CACHE_DIR", str(root / "cache"))
        out = {}
        for seed, (arch, kw) in enumerate(FILES.items()):
            path, other = root / f"{arch}.gguf", root / f"{arch}-other-vocab.gguf"
            hf_dir = write_family_gguf(path, arch, seed=seed, **kw)
            write_family_gguf(other, arch, seed=seed, shuffle_vocab=1, **kw)
            out[arch] = path, hf_dir, other
        yield out


def server_args(arch: str, path) -> list[str]:
    template = ["--chat-template", "chatml"] if not FILES[arch].get("chat_template", True) else []
    return ["--model-path", str(path), "--log-level", "warning", *template]


def generate(srv: ServerProcess, text: str) -> dict:
    with srv.client() as c:
        r = c.post("/generate", json={"text": text, "sampling_params": {
            "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return r.json()


def run_server(args: list[str], texts: list[str]) -> tuple[list[dict], dict]:
    srv = ServerProcess(*args)
    try:
        outs = [generate(srv, t) for t in texts]
        with srv.client() as c:
            r = c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 8,
                "temperature": 0})
        assert r.status_code == 200, r.text
    finally:
        assert srv.stop() == 0, srv.read_log()[-3000:]
    return outs, r.json()


def transformers_greedy(arch: str, path, hf_dir, texts: list[str]) -> list[tuple[list, str]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = (AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
             if "rope_scaling" in FILES[arch] else transformers_gguf_model(path))
    out = []
    for text in texts:
        ids = tok.encode(text)
        with torch.no_grad():
            new = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW,
                                 min_new_tokens=NEW)[0, len(ids):].tolist()
        out.append((new, tok.decode(new, skip_special_tokens=True)))
    return out, tok


@pytest.mark.parametrize("arch", ARCHS)
def test_served_greedy_text_chat_and_ngram(files, arch):
    path, hf_dir, _ = files[arch]
    reference, tok = transformers_greedy(arch, path, hf_dir, PROMPTS)
    repeated = [p * 3 for p in PROMPTS]  # the n-gram drafter gets accepted
    outs, chat = run_server(server_args(arch, path), PROMPTS + repeated)
    plain, plain_rep = outs[:len(PROMPTS)], outs[len(PROMPTS):]
    for out, (ids, text) in zip(plain, reference):
        assert out["output_ids"] == ids and out["text"] == text
        print(f"{arch}: {out['text']!r}")
    rendered = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}],
                                       chat_template=CHATML_TEMPLATE, tokenize=True,
                                       add_generation_prompt=True, return_dict=False)
    assert chat["usage"]["prompt_tokens"] == len(rendered)  # the template was applied
    spec, _ = run_server(server_args(arch, path) + ["--speculative-algorithm", "NGRAM"],
                         repeated)
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain_rep]
    accepted = sum(o["meta_info"]["spec_num_correct_drafts"] for o in spec)
    print(f"{arch} NGRAM: {accepted} drafts accepted over {len(spec)} requests")
    assert accepted > len(spec)


def test_the_targets_own_gguf_as_standalone_draft_is_accepted_everywhere(files, tmp_path):
    path, hf_dir, _ = files["qwen2"]
    draft = tmp_path / "draft.gguf"  # another file, the same model
    draft.write_bytes(path.read_bytes())
    reference, _ = transformers_greedy("qwen2", path, hf_dir, PROMPTS)
    spec, _ = run_server(server_args("qwen2", path) + [
        "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(draft),
        "--speculative-num-steps", "3", "--speculative-disable-adaptive"], PROMPTS)
    assert [o["output_ids"] for o in spec] == [ids for ids, _ in reference]
    correct = sum(o["meta_info"]["spec_num_correct_drafts"] for o in spec)
    proposed = sum(o["meta_info"]["spec_num_proposed_drafts"] for o in spec)
    assert 0 < correct == proposed


@pytest.mark.parametrize("arch", ARCHS)
def test_a_draft_gguf_with_another_vocabulary_stops_the_server_at_start_up(files, arch):
    path, _, other = files[arch]
    r = subprocess.run([sys.executable, "-m", "launch_server", *server_args(arch, path),
                        "--speculative-algorithm", "STANDALONE",
                        "--speculative-draft-model-path", str(other), "--port", str(free_port())],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if "not vocabulary-compatible" in line]
    assert len(errors) == 1 and str(other) in errors[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    print(errors[0])
