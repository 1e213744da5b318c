"""What tensor parallelism costs on this machine: decode ms per step and prompt (prefill) time
at `--tp-size 1` and `--tp-size N` on the same cores (each rank gets cores / N threads), through
`specserve.launch.Engine`, rounds interleaved; optionally a speculative method at each size.

    python -m benchmark.bench_tensor_parallel --tp-sizes 1 2 --rounds 3
    python -m benchmark.bench_tensor_parallel --tp-sizes 1 2 --algorithms none NGRAM
    python -m benchmark.bench_tensor_parallel --tp-sizes 1 2 --tp-comms shm gloo

Decode ms/step at batch b: (time of b requests of 1 + S new tokens - time of b requests of 1
new token) / S, the prompts cached for both, so request overhead cancels; prefill: one request
of a P-token prompt and 1 new token. `--tp-comms shm gloo` runs each size above 1 with both
ways of exchanging partial sums. Prints the medians, the table last (ratios against the first
size in the same run), and writes JSON (`--output`).
"""

from __future__ import annotations

import argparse
import statistics
import time

from tqdm import tqdm

from benchmark.common import format_table, machine_info, write_json


def measure(tp: int, comm: str, algorithm: str | None, steps: int, prompt_len: int,
            batches: list[int]) -> dict[str, float]:
    from specserve.launch import Engine

    kw = {"speculative_algorithm": algorithm} if algorithm else {}
    if tp > 1:
        kw["tp_comm"] = comm
    with Engine(log_level="warning", tp_size=tp, **kw) as eng:
        base = eng.tm.tokenize("The history of the printing press begins in")
        filler = eng.tm.tokenize(" and the press spread across Europe" * 64)
        long_prompt = (base + filler)[:prompt_len]

        def run(batch: int, new: int) -> float:
            prompts = [base + [100 + i] for i in range(batch)]  # distinct: no shared decode
            params = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
            t0 = time.perf_counter()
            eng.generate(input_ids=prompts, sampling_params=params)
            return time.perf_counter() - t0

        out = {"threads_per_rank": eng.server_args.num_threads}
        for b in batches:
            run(b, 1 + steps)  # warm-up; the prompts are then cached for both timed runs
            first, full = run(b, 1), run(b, 1 + steps)
            out[f"decode_ms_b{b}"] = 1000 * (full - first) / steps
        eng.flush_cache()
        t0 = time.perf_counter()
        eng.generate(input_ids=long_prompt, sampling_params={"max_new_tokens": 1,
                                                             "temperature": 0})
        out["prefill_ms"] = 1000 * (time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--algorithms", nargs="+", default=["none"],
                    help="none (plain decoding) and/or speculative algorithms")
    ap.add_argument("--tp-comms", nargs="+", default=["shm"], choices=["shm", "gloo"],
                    help="how ranks exchange partial sums (sizes above 1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per request")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--output", default="results/bench_tensor_parallel.json")
    args = ap.parse_args()
    configs = [(tp, comm, None if a == "none" else a) for a in args.algorithms
               for tp in args.tp_sizes for comm in (args.tp_comms if tp > 1 else ["-"])]
    rows: dict[tuple, list[dict]] = {c: [] for c in configs}
    with tqdm(total=args.rounds * len(configs), desc="tensor-parallel rounds") as bar:
        for _ in range(args.rounds):
            for c in configs:
                rows[c].append(measure(c[0], c[1], c[2], args.steps, args.prompt_len,
                                       args.batches))
                bar.update()
    keys = [f"decode_ms_b{b}" for b in args.batches] + ["prefill_ms"]
    med = {c: {k: statistics.median(r[k] for r in rows[c]) for k in keys} for c in configs}
    table = []
    for c in configs:
        ref = next(med[d] for d in configs if d[2] == c[2])  # the first size, same method
        row = [c[2] or "none", c[0], c[1], rows[c][0]["threads_per_rank"]]
        for k in keys:
            row += [med[c][k], med[c][k] / ref[k]]
        table.append(row)
    headers = ["method", "tp", "comm", "threads/rank"]
    for k in keys:
        headers += [k.replace("decode_ms_", "ms/step ").replace("prefill_ms", "prefill ms"),
                    "x"]

    def name(c):
        return f"{c[2] or 'none'}@tp{c[0]}" + (f"-{c[1]}" if c[0] > 1 else "")

    write_json(args.output, {"machine": machine_info(), "args": vars(args),
                             "rounds": {name(c): rows[c] for c in configs},
                             "median": {name(c): med[c] for c in configs}})
    print(f"medians of {args.rounds} rounds; x = against tp {args.tp_sizes[0]} in this run "
          f"(prefill: a {args.prompt_len}-token prompt)")
    print(format_table(headers, table))


if __name__ == "__main__":
    main()
