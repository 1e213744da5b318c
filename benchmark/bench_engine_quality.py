"""How close each engine's logits and greedy text stay to float32: the activation-precision study.

    python -m benchmark.bench_engine_quality --num-prompts 20 --max-new-tokens 128 \\
        --engines auto:3,auto:2,auto:1 --hf

On held-out ShareGPT chat prompts the reference engine (`--weight-format torch`: the same
weights in float32) answers greedily; every other engine then
- reads prompt + that answer (teacher forcing): max and 99th-percentile |logit - reference|
  over all answer positions, and how often its argmax differs from the reference's;
- answers greedily itself: tokens until its answer first differs from the reference's, and
  whether that first difference is a near-tie of the reference's own logits (top-two gap
  <= 1e-4), i.e. a token either engine could rightly pick;
- reads the recorded ShareGPT answers of the same held-out conversations (human-chosen text, at
  most `--ppl-tokens` tokens each, the prompt as context): perplexity, every engine and the
  reference alike;
- with `--hf`: how its greedy answers agree with transformers' own float32 model of the same
  weights (`generate`, greedy): answers identical, median tokens before the first difference.
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


def answer_nll(runner: ModelRunner, prompt: list[int], answer: list[int]) -> tuple[float, int]:
    """Summed negative log-likelihood of `answer` after `prompt`, and its token count."""
    logp = torch.log_softmax(answer_logits(runner, prompt, answer).double(), dim=-1)
    return -float(logp.gather(1, torch.tensor(answer)[:, None]).sum()), len(answer)


def perplexity(runner: ModelRunner, texts: list[tuple[list[int], list[int]]]) -> float:
    nll = [answer_nll(runner, prompt, answer) for prompt, answer in texts]
    return float(torch.tensor(sum(s for s, _ in nll) / sum(n for _, n in nll)).exp())


def hf_answers(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' float32 model of the same (dequantized) weights, greedy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for ids in tqdm(prompts, desc="transformers fp32"):
            # a plain loop rather than generate(): EOS neither stops nor is masked (ignore_eos)
            res = model(torch.tensor([ids]), use_cache=True)
            answer = []
            for _ in range(max_new_tokens):
                answer.append(int(res.logits[0, -1].argmax()))
                res = model(torch.tensor([answer[-1:]]), past_key_values=res.past_key_values,
                            use_cache=True)
            out.append(answer)
    return out


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--engines", default="auto:3,auto:2,auto:1")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ppl-tokens", type=int, default=256,
                   help="recorded answer tokens per prompt read for the perplexity")
    p.add_argument("--hf", action="store_true",
                   help="also compare greedy answers with transformers' float32 model")
    p.add_argument("--output", default="results/bench_engine_quality.json")
    args = p.parse_args(argv)
    model_dir = str(resolve_model_path(args.model_path))
    tok = load_tokenizer(model_dir)
    reqs = sample_requests("sharegpt", args.num_prompts, tok, args.seed, args.max_new_tokens,
                           split="heldout")
    prompts = [chat_prompt_ids(tok, r.messages) for r in reqs]
    texts = [(ids, tok.encode(r.extra["answer"], add_special_tokens=False)[: args.ppl_tokens])
             for ids, r in zip(prompts, reqs)]
    capacity = max(len(x) for x in prompts) + max(args.max_new_tokens, args.ppl_tokens) + 16
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0,
                            ignore_eos=True)

    ref_runner = make_runner(model_dir, "torch", capacity)
    gen = LocalGenerator(ref_runner)
    ref_answers, ref_logits = [], []
    for ids in tqdm(prompts, desc="reference answers"):
        ans = gen.generate([ids], params)[0].output_ids
        ref_answers.append(ans)
        ref_logits.append(answer_logits(ref_runner, ids, ans))
    ref_ppl = perplexity(ref_runner, texts)
    del gen, ref_runner
    hf = hf_answers(model_dir, prompts, args.max_new_tokens) if args.hf else None

    rows = []
    for spec in args.engines.split(","):
        runner = make_runner(model_dir, spec, capacity)
        gen = LocalGenerator(runner)
        diffs, flips, total, agree, ties, frees = [], 0, 0, [], 0, []
        for ids, ans, ref in tqdm(list(zip(prompts, ref_answers, ref_logits)), desc=spec):
            ours = answer_logits(runner, ids, ans)
            diffs.append((ours - ref).abs().amax(dim=-1))  # [len(ans)] per position
            flips += int((ours.argmax(-1) != ref.argmax(-1)).sum())
            total += len(ans)
            free = gen.generate([ids], params)[0].output_ids
            frees.append(free)
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
            "perplexity": perplexity(runner, texts), "reference_perplexity": ref_ppl,
        })
        if hf is not None:
            to_hf = [first_difference(f, h) for f, h in zip(frees, hf)]
            rows[-1].update(hf_identical=sum(d >= args.max_new_tokens for d in to_hf),
                            hf_median_tokens_before_divergence=statistics.median(to_hf))
        del gen, runner
    if hf is not None:
        rows.append({"engine": "torch (reference)", "kind": "torch", "perplexity": ref_ppl,
                     "prompts": len(prompts),
                     "hf_identical": sum(first_difference(a, h) >= args.max_new_tokens
                                         for a, h in zip(ref_answers, hf)),
                     "hf_median_tokens_before_divergence": statistics.median(
                         first_difference(a, h) for a, h in zip(ref_answers, hf))})
    path = write_json(args.output, {"machine": machine_info(), "args": vars(args),
                                    "rows": rows})
    print(f"\nJSON: {path}\n")
    print(format_table(
        ["engine", "max |dlogit|", "p99 |dlogit|", "argmax flips", "greedy = fp32",
         "diverged at near-tie", "median tokens to divergence", "perplexity",
         "greedy = HF fp32", "median tokens to HF divergence"],
        [[r["engine"], _fmt(r, "max_abs_logit_diff", "{:.2e}"),
          _fmt(r, "p99_abs_logit_diff", "{:.2e}"),
          _fmt(r, "argmax_flip_rate", "{:.2%}"),
          f"{r['greedy_identical']}/{r['prompts']}" if "greedy_identical" in r else "-",
          r.get("diverged_at_near_tie", "-"), r.get("median_tokens_before_divergence", "-"),
          f"{r['perplexity']:.4f}",
          f"{r['hf_identical']}/{r['prompts']}" if "hf_identical" in r else "-",
          r.get("hf_median_tokens_before_divergence", "-")] for r in rows]))
    return {"rows": rows}


def _fmt(row: dict, key: str, spec: str) -> str:
    return spec.format(row[key]) if key in row else "-"


if __name__ == "__main__":
    main()
