"""Where a CPU-engine forward spends its time, phase by phase (thread 0's wall clock).

    python -m benchmark.profile_cpu_engine --context 256 --tokens 1,8 --digits 3,1
    python -m benchmark.profile_cpu_engine --context 160 --tokens 1 --batch 32 \
        --layout interleaved
    python -m benchmark.profile_cpu_engine --tokens 1 --batch 32 --logit-top none,5
    python -m benchmark.profile_cpu_engine --prefill 280 --chunk 256 --batch 32 --context 200

For each (digits, tokens-per-forward) it prefills `--context` tokens for each of `--batch`
requests, then runs `--steps` forwards of n tree nodes per request (n = 1: a plain decode step)
and prints the mean milliseconds of each phase per forward (linears summed over layers) and the
total. `--layout` places the requests' KV slots: `contiguous` (each request's own run, as after
a prefill) or `interleaved` (position p of request i in slot p * batch + i, as a busy server's
decode steps hand them out). `--logit-top none,5` runs each configuration without and with the
logprob statistics (each row's log-sum-exp and top 5, found with the argmax: the lm_head
phase) that a batch asking for logprobs gets. `--prefill L` instead times a fresh prompt of L
tokens prefilled in chunks of `--chunk` (as the scheduler's prefill budget cuts it), the phases
summed over its chunks; with `--batch B` > 1 each chunk shares its forward with B - 1 decode rows
of requests holding `--context` tokens, as a busy server's mixed steps do. Writes JSON
(`--output`).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmark.common import format_table, machine_info, write_json
from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.model_loader.default_model import resolve_model_path
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig

PHASES = ("embed", "attn_norm", "qkv", "rope_kv", "attention", "o_proj", "mlp_norm", "gate_up",
          "down", "final_norm", "lm_head")


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def request_slots(batch: int, length: int, layout: str) -> list[torch.Tensor]:
    """Each request's KV slots (slot 0 is padding): its own run, or interleaved with the others'."""
    if layout == "interleaved":
        return [torch.arange(length) * batch + i + 1 for i in range(batch)]
    return [torch.arange(length) + i * length + 1 for i in range(batch)]


def timed(core, fn, steps: int) -> tuple[float, dict]:
    """fn once to warm up, then `steps` times with the engine's phase clocks on: the mean wall
    seconds per call and the engine's mean seconds per forward of each phase."""
    fn()
    core.set_profile(True)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    wall = (time.perf_counter() - t0) / steps
    phases = dict(core.profile())
    core.set_profile(False)
    return wall, phases


def profile(runner: ModelRunner, context: int, n: int, steps: int, batch: int = 1,
            layout: str = "contiguous", logit_top: int = -1) -> dict:
    core = runner.model.core
    vocab = runner.vocab_size
    gen = torch.Generator().manual_seed(0)
    # each request's prefix, then the n tokens its forwards feed (any n, longer than the prefix
    # included)
    prompts = torch.randint(100, vocab - 100, (batch, context + n), generator=gen).tolist()
    slots = request_slots(batch, context + n, layout)
    if context:
        runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [p[:context] for p in prompts],
                                          [s[:context] for s in slots], [0] * batch))
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
    mode = ForwardMode.DECODE if n == 1 else ForwardMode.TARGET_VERIFY
    kw = {} if n == 1 else dict(positions=[torch.arange(context, context + n)] * batch,
                                custom_masks=[mask] * batch, logits="all")

    def step():
        runner.forward(ForwardBatch.build(mode, [p[context:] for p in prompts], slots,
                                          [context] * batch, logit_top=logit_top, **kw))

    wall, phases = timed(core, step, steps)
    return {"tokens": n, "batch": batch, "layout": layout, "context": context,
            "logit_top": logit_top,
            "wall_ms": wall * 1e3,
            "phases_ms": {k: phases[k] * 1e3 for k in PHASES}}


def profile_prefill(runner: ModelRunner, length: int, chunk: int, steps: int, batch: int = 1,
                    context: int = 0, layout: str = "contiguous") -> dict:
    """A prompt of `length` tokens prefilled in chunks of `chunk`, each chunk's forward beside
    batch - 1 decode rows (requests of `context` tokens); the phases summed over the chunks."""
    core = runner.model.core
    vocab = runner.vocab_size
    gen = torch.Generator().manual_seed(0)
    others = batch - 1
    # the decode rows' requests: slots after the prompt's; each step rewrites their last slot
    if others:
        ctx = torch.randint(100, vocab - 100, (others, context + 1), generator=gen).tolist()
        slots = [s + length for s in request_slots(others, context + 1, layout)]
        runner.forward(ForwardBatch.build(ForwardMode.EXTEND, [c[:context] for c in ctx],
                                          [s[:context] for s in slots], [0] * others))

    def prompt():
        ids = torch.randint(100, vocab - 100, (length,), generator=gen).tolist()
        slot = torch.arange(length) + 1
        for s in range(0, length, chunk):
            e = min(length, s + chunk)
            toks, kv, pre = [ids[s:e]], [slot[:e]], [s]
            if others:
                toks += [c[context:] for c in ctx]
                kv += slots
                pre += [context] * others
            runner.forward(ForwardBatch.build(ForwardMode.EXTEND, toks, kv, pre))

    wall, phases = timed(core, prompt, steps)
    chunks = -(-length // chunk)
    phases = {k: v * chunks for k, v in phases.items()}  # the engine's are per forward
    return {"prefill": length, "chunk": chunk, "tokens": length, "batch": batch,
            "layout": layout, "context": context, "logit_top": -1, "wall_ms": wall * 1e3,
            "phases_ms": {k: phases[k] * 1e3 for k in PHASES}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-path", default=None)
    p.add_argument("--weight-format", default="auto")
    p.add_argument("--digits", type=ints, default=[3])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--tokens", type=ints, default=[1, 8])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=1, help="requests per forward")
    p.add_argument("--layout", choices=("contiguous", "interleaved"), default="contiguous",
                   help="where the requests' KV slots lie (see above)")
    p.add_argument("--logit-top", type=lambda t: [-1 if x == "none" else int(x)
                                                  for x in t.split(",") if x],
                   default=[-1], help="logprob statistics per forward: none, or k: lse and "
                   "top k (see above)")
    p.add_argument("--prefill", type=ints, default=[],
                   help="prompt lengths to time as prefills instead of tree forwards (see above)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk (--prefill)")
    p.add_argument("--output", default="results/profile_cpu_engine.json")
    args = p.parse_args(argv)
    model_dir = str(resolve_model_path(args.model_path))
    runs = []
    for digits in args.digits:
        runner = ModelRunner(RunnerConfig(model_dir, "cpu",
                                          max_total_tokens=args.batch * (
                                             args.context + max(args.tokens))
                                          + max(args.prefill, default=0) + 8,
                                          weight_format=args.weight_format,
                                          activation_digits=digits))
        assert runner.engine == "cpu", "the CPU engine is not available here"
        for length in args.prefill:
            runs.append({"digits": digits, **profile_prefill(
                runner, length, args.chunk, args.steps, args.batch, args.context, args.layout)})
        for n in ([] if args.prefill else args.tokens):
            for top in args.logit_top:
                runs.append({"digits": digits, **profile(runner, args.context, n, args.steps,
                                                         args.batch, args.layout, top)})
        del runner
    path = write_json(args.output, {"machine": machine_info(), "args": vars(args), "runs": runs})
    print(f"\nJSON: {path}\n")
    head = ["phase"] + [f"d={r['digits']} "
                        + (f"prefill {r['prefill']}/{r['chunk']}" if "prefill" in r
                           else f"n={r['tokens']}")
                        + (f" bs={r['batch']}" if r["batch"] > 1 else "")
                        + (f" lp={r['logit_top']}" if r["logit_top"] >= 0 else "")
                        for r in runs]
    rows = [[ph] + [r["phases_ms"][ph] for r in runs] for ph in PHASES]
    rows.append(["sum of phases"] + [sum(r["phases_ms"].values()) for r in runs])
    wall = "wall per prompt" if args.prefill else "wall per forward"
    rows.append([wall] + [r["wall_ms"] for r in runs])
    print(format_table(head, rows))
    return {"runs": runs}


if __name__ == "__main__":
    main()
