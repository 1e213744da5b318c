"""Latency of one static batch: prefill, decode, and the verify-cost curve, per engine.

    python -m benchmark.bench_one_batch --batch-sizes 1,8 --engines auto,torch --compare-hf

- engines: `--engines` lists weight formats (`auto` = the CPU engine on the checkpoint's own
  format, `torch` = the fp32 reference engine, or f32|bf16|f16|q8_0|q4_0|q4_1), each optionally
  `:D` for D activation digits (e.g. `auto:1`), `@ISA` for the CPU engine's instruction set
  (`auto@avx512`, `auto@amx`: `SPECSERVE_CPU_ISA` for that engine) and `/KV` for its KV cache
  dtype (`auto/float16`); all are measured in the same run;
- prefill: one EXTEND over `--input-len` tokens per request;
- decode: tokens/s of steady-state decode steps at each batch size (`--output-len` steps);
- verify-cost curve: one TARGET_VERIFY forward of n chain nodes on a `--verify-prefix`-token
  prefix, n = 1..64, and T(n)/T(1) — what a speculative step costs against a plain decode;
- `--compare-hf`: Hugging Face transformers greedy `generate` on the same prompt, same run,
  and the end-to-end tokens/s ratio.
Prints a table last and writes JSON (`--output`); `--plot PNG` draws the verify-cost curve.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
from tqdm import tqdm

from benchmark.common import (
    format_table,
    machine_info,
    median_time,
    parse_engine_spec,
    write_json,
)
from specserve.kernels.cpu import DEFAULT_ACTIVATION_DIGITS
from specserve.runtime.model_loader.default_model import resolve_model_path
from specserve.runtime.model_runner.local_generator import GenerateTimings, LocalGenerator
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.runtime.verify_cost import measure_verify_times


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def random_prompts(batch_size: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (batch_size, length), generator=gen).tolist()


def bench_decode(runner: ModelRunner, bs: int, args) -> dict:
    gen = LocalGenerator(runner)
    prompts = random_prompts(bs, args.input_len, runner.vocab_size, args.seed)
    params = SamplingParams(max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    gen.generate(prompts, params)  # warm-up
    runs = []
    for _ in range(args.reps):
        t = GenerateTimings()
        gen.generate(prompts, params, timings=t)
        runs.append(t)
    runs.sort(key=lambda t: t.decode_s)
    t = runs[len(runs) // 2]
    step_s = t.decode_s / max(t.decode_steps, 1)
    return {
        "batch_size": bs, "input_len": args.input_len, "output_len": args.output_len,
        "prefill_s": t.prefill_s, "decode_step_s": step_s,
        "decode_tokens_per_s": bs / step_s,
        "e2e_tokens_per_s": bs * args.output_len / (t.prefill_s + t.decode_s),
    }


def bench_verify_curve(runner: ModelRunner, args) -> list[dict]:
    """The curve the server measures at start-up (specserve/runtime/verify_cost.py), with more
    reps."""
    times = measure_verify_times(runner, args.verify_prefix, tuple(args.verify_ns),
                                 args.verify_reps, warmup=2)
    base = times[min(times)]
    return [{"n": n, "time_s": t, "ratio_to_n1": t / base} for n, t in sorted(times.items())]


def bench_hf(model_dir: str, args) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    ids = torch.tensor(random_prompts(1, args.input_len, vocab, args.seed))
    n = args.output_len

    def run():
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                        min_new_tokens=n, do_sample=False, pad_token_id=0)

    e2e = median_time(run, args.reps, warmup=1)
    return {"batch_size": 1, "e2e_s": e2e, "e2e_tokens_per_s": n / e2e}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None, help="HF dir, .gguf, or default")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-sizes", type=ints, default=[1, 8])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--verify-prefix", type=int, default=512)
    p.add_argument("--verify-ns", type=ints, default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--verify-reps", type=int, default=7)
    p.add_argument("--no-pack", action="store_true", help="disable oneDNN weight prepacking")
    p.add_argument("--engines", default="auto,torch",
                   help="comma-separated weight formats, each optionally :DIGITS (see above)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--compare-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="results/bench_one_batch.json")
    p.add_argument("--plot", default=None, help="PNG path for the verify-cost curve")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = str(resolve_model_path(args.model_path))
    result = {"machine": machine_info(), "args": vars(args), "model_dir": model_dir,
              "engines": [], "hf": None}
    for spec in tqdm(args.engines.split(","), desc="engines"):
        fmt, digits, isa, kv = parse_engine_spec(spec)
        # the CPU engine reads its instruction set when it is built (specserve/kernels/cpu:
        # pick_isa)
        saved_isa = os.environ.get("SPECSERVE_CPU_ISA")
        if isa:
            os.environ["SPECSERVE_CPU_ISA"] = isa
        runner = ModelRunner(RunnerConfig(
            model_dir, args.device, args.dtype,
            max_total_tokens=max(args.verify_prefix + 128, max(args.batch_sizes)
                                 * (args.input_len + args.output_len + 8)),
            pack_weights=not args.no_pack, weight_format=fmt,
            activation_digits=digits or DEFAULT_ACTIVATION_DIGITS, kv_cache_dtype=kv or "auto",
        ))
        if isa:
            if saved_isa is None:
                del os.environ["SPECSERVE_CPU_ISA"]
            else:
                os.environ["SPECSERVE_CPU_ISA"] = saved_isa
        eng = {"engine": spec, "kind": runner.engine,
               "isa": getattr(getattr(runner, "model", None), "isa", None),
               "dtype": str(runner.dtype),
               "decode": [bench_decode(runner, bs, args) for bs in args.batch_sizes],
               "verify_curve": bench_verify_curve(runner, args)}
        result["engines"].append(eng)
        del runner
    if args.compare_hf:
        t0 = time.perf_counter()
        result["hf"] = bench_hf(model_dir, args)
        logging.info("HF baseline measured in %.0fs", time.perf_counter() - t0)
    path = write_json(args.output, result)
    if args.plot:
        from benchmark.plots import plot_verify_curve

        print(f"plot: {plot_verify_curve(result, args.plot)}")

    rows = []
    for eng in result["engines"]:
        rows += [[eng["engine"], f"bs={d['batch_size']}", d["prefill_s"] * 1e3,
                  d["decode_step_s"] * 1e3, d["decode_tokens_per_s"], d["e2e_tokens_per_s"]]
                 for d in eng["decode"]]
    if result["hf"]:
        ours = result["engines"][0]["decode"][0]
        rows.append(["HF generate", "bs=1", "-", "-", "-", result["hf"]["e2e_tokens_per_s"]])
        rows.append([f"{result['engines'][0]['engine']} / HF", "bs=1", "-", "-", "-",
                     ours["e2e_tokens_per_s"] / result["hf"]["e2e_tokens_per_s"]])
    print(f"\nJSON: {path}\n")
    curves = [e["verify_curve"] for e in result["engines"]]
    head = ["verify n"] + [f"{e['engine']} {c}" for e in result["engines"]
                           for c in ("T(n) ms", "T(n)/T(1)")]
    print(format_table(head, [[row[0]["n"]] + [v for r in row for v in (r["time_s"] * 1e3,
                                                                          r["ratio_to_n1"])]
                              for row in zip(*curves)]))
    print()
    print(format_table(["engine", "batch", "prefill ms", "step ms", "decode tok/s", "e2e tok/s"],
                       rows))
    return result


if __name__ == "__main__":
    main()
