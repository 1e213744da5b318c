"""How close each engine's logits and greedy text stay to the float32 torch reference engine.

    python -m benchmark.bench_engine_quality --num-prompts 20 --max-new-tokens 128 \\
        --engines auto:3,auto:2,auto:1

On held-out ShareGPT chat prompts the reference engine (`--weight-format torch`: the same
weights in float32) answers greedily; every other engine then
- reads prompt + that answer (teacher forcing): max and 99th-percentile |logit - reference|
  over all answer positions, and how often its argmax differs from the reference's;
- answers greedily itself: tokens until its answer first differs from the reference's, and
  whether that first difference is a near-tie of the reference's own logits (top-two gap
  <= 1e-4), i.e. a token either engine could rightly pick.
Prints a table last and writes JSON (`--output`).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from tqdm import tqdm

from benchmark.common import format_table, machine_info, parse_engine_spec, write_json
from specserve.corpora.datasets import chat_prompt_ids, sample_requests
from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.model_loader.default_model import resolve_model_path
from specserve.runtime.model_loader.tokenizer import load_tokenizer
from specserve.runtime.model_runner.local_generator import LocalGenerator
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from specserve.runtime.sampling.sampling_params import SamplingParams

NEAR_TIE = 1e-4


def make_runner(model_dir: str, spec: str, capacity: int) -> ModelRunner:
    """An engine from `FMT[:DIGITS][/KV]` (e.g. `auto:3`, `auto:3/float16`)."""
    fmt, digits, _, kv = parse_engine_spec(spec)
    kw = {"activation_digits": digits} if digits else {}
    return ModelRunner(RunnerConfig(model_dir, "cpu", "float32", max_total_tokens=capacity,
                                    weight_format=fmt, kv_cache_dtype=kv or "auto", **kw))


def answer_logits(runner: ModelRunner, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """[len(answer), V]: the logits that predict each answer token (teacher forcing)."""
    ids = prompt + answer
    slots = torch.arange(1, len(ids) + 1)
    out = runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [ids], [slots], [0],
                                            logits="all")).logits
    return out[len(prompt) - 1 : len(ids) - 1]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--engines", default="auto:3,auto:2,auto:1")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="results/bench_engine_quality.json")
    args = p.parse_args(argv)
    model_dir = str(resolve_model_path(args.model_path))
    tok = load_tokenizer(model_dir)
    reqs = sample_requests("sharegpt", args.num_prompts, tok, args.seed, args.max_new_tokens,
                           split="heldout")
    prompts = [chat_prompt_ids(tok, r.messages) for r in reqs]
    capacity = max(len(x) for x in prompts) + args.max_new_tokens + 16
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0,
                            ignore_eos=True)

    ref_runner = make_runner(model_dir, "torch", capacity)
    gen = LocalGenerator(ref_runner)
    ref_answers, ref_logits = [], []
    for ids in tqdm(prompts, desc="reference answers"):
        ans = gen.generate([ids], params)[0].output_ids
        ref_answers.append(ans)
        ref_logits.append(answer_logits(ref_runner, ids, ans))
    del gen, ref_runner

    rows = []
    for spec in args.engines.split(","):
        runner = make_runner(model_dir, spec, capacity)
        gen = LocalGenerator(runner)
        diffs, flips, total, agree, ties = [], 0, 0, [], 0
        for ids, ans, ref in tqdm(list(zip(prompts, ref_answers, ref_logits)), desc=spec):
            ours = answer_logits(runner, ids, ans)
            diffs.append((ours - ref).abs().amax(dim=-1))  # [len(ans)] per position
            flips += int((ours.argmax(-1) != ref.argmax(-1)).sum())
            total += len(ans)
            free = gen.generate([ids], params)[0].output_ids
            first = next((i for i, (a, b) in enumerate(zip(free, ans)) if a != b), len(ans))
            agree.append(first)
            if first < len(ans):
                top2 = ref[first].topk(2).values
                ties += int(float(top2[0] - top2[1]) <= NEAR_TIE)
        d = torch.cat(diffs)
        diverged = sum(a < args.max_new_tokens for a in agree)
        rows.append({
            "engine": spec, "kind": runner.engine, "max_abs_logit_diff": float(d.max()),
            "p99_abs_logit_diff": float(d.quantile(0.99)),
            "argmax_flip_rate": flips / total, "prompts": len(prompts),
            "greedy_identical": len(prompts) - diverged, "diverged_at_near_tie": ties,
            "median_tokens_before_divergence": statistics.median(agree),
        })
        del gen, runner
    path = write_json(args.output, {"machine": machine_info(), "args": vars(args),
                                    "rows": rows})
    print(f"\nJSON: {path}\n")
    print(format_table(
        ["engine", "max |dlogit|", "p99 |dlogit|", "argmax flips", "greedy = fp32",
         "diverged at near-tie", "median tokens to divergence"],
        [[r["engine"], f"{r['max_abs_logit_diff']:.2e}", f"{r['p99_abs_logit_diff']:.2e}",
          f"{100 * r['argmax_flip_rate']:.2f}%", f"{r['greedy_identical']}/{r['prompts']}",
          r["diverged_at_near_tie"], r["median_tokens_before_divergence"]] for r in rows]))
    return {"rows": rows}


if __name__ == "__main__":
    main()
