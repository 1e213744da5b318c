"""One CPU-engine matmul at a time: the median time of a single linear call at the default model's
shapes, for each row count M and each instruction-set table, in one run.

    python -m benchmark.bench_gemm --rows 1,8,32,256 --isa amx,avx512
    python -m benchmark.bench_gemm --rows 256 --shapes gate_up,down --reps 100

A whole forward (`benchmark.profile_cpu_engine`) moves 5-10% between runs of the same build on
these machines; a single call repeated and timed by its median moves ~3%, which is what an A/B
of a kernel change needs. Each call quantizes its M rows of activations (three digits unless
`--digits`), multiplies every tile of the weight on the engine's thread pool (`--threads`) and
writes the output with the layer's epilogue (gate_up: silu(gate) * up). Weights are random, in
the default model's formats (layers Q4_1, the tied LM head Q8_0; `--layer-format`), one copy
per layer, and the calls go through the copies in turn as a forward does (one copy would sit in
cache however large the call); times do not depend on the values. The table gives ms per call,
then what the model's linears add up to per forward (every layer's four and the LM head) and
per row. A call from Python costs ~10 us more than the same matmul inside a forward (at M = 1
that is most of a small layer's time). `--quantize` also times the activation digits alone (the
`quantize` op on one thread, the part of each call before its barrier) at the same shapes.
Writes JSON (`--output`).

    python -m benchmark.bench_gemm --rows 32,256 --isa amx --quantize
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from benchmark.common import format_table, machine_info, median_time, write_json
from specserve.kernels import cpu
from specserve.kernels.cpu.packing import Fmt, pack_blocks, quantize
from specserve.runtime.model_loader.default_model import resolve_model_path

EPI_STORE, EPI_SILU_MUL = 0, 2


def model_shapes(config: dict) -> dict[str, tuple[int, int, int]]:
    """name -> (output rows N, inputs K, epilogue) of the model's linears."""
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    d = config.get("head_dim", h // heads)
    inter = config["intermediate_size"]
    return {
        "qkv": ((heads + 2 * kv) * d, h, EPI_STORE),
        "o_proj": (h, heads * d, EPI_STORE),
        "gate_up": (2 * inter, h, EPI_SILU_MUL),
        "down": (h, inter, EPI_STORE),
        "lm_head": (config["vocab_size"], h, EPI_STORE),
    }


def packed(fmt: Fmt, n: int, k: int, seed: int, copies: int) -> list:
    """`copies` packed linears of one random [n, k] weight, each in its own memory."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    data = torch.from_numpy(pack_blocks(quantize(fmt, w)))
    return [cpu.load().PackedLinear(int(fmt), k, n, data.clone()) for _ in range(copies)]


def time_call(ws: list, x: torch.Tensor, y: torch.Tensor, digits: int, threads: int, isa: str,
              epilogue: int, reps: int) -> float:
    """Median ms of one call, the calls cycling through the copies `ws`."""
    ext = cpu.load()
    copies = itertools.cycle(ws)
    return median_time(lambda: ext.linear(next(copies), x, digits, threads, isa, epilogue, y),
                       reps, warmup=3) * 1e3


def time_quantize(x: torch.Tensor, digits: int, isa: str, reps: int) -> float:
    """Median ms of quantizing the rows of x alone (the `quantize` op, one thread)."""
    ext = cpu.load()
    return median_time(lambda: ext.quantize(x, digits, isa), reps, warmup=3) * 1e3


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="model dir for the shapes (default model)")
    p.add_argument("--rows", default="1,8,32,256", help="row counts M, comma-separated")
    p.add_argument("--isa", default="auto",
                   help="tables to time, comma-separated (amx, avx512, avx2, generic; auto: the "
                        "engine's choice); ones this CPU lacks are skipped")
    p.add_argument("--shapes", default="qkv,o_proj,gate_up,down,lm_head")
    p.add_argument("--layer-format", default="Q4_1", choices=["Q4_0", "Q4_1", "Q8_0"])
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--quantize", action="store_true",
                   help="also time quantizing each call's rows alone (one thread)")
    p.add_argument("--output", default="results/bench_gemm.json")
    args = p.parse_args(argv)

    ok, what = cpu.available()
    if not ok:
        raise SystemExit(f"CPU kernels unavailable: {what}")
    ext = cpu.load()
    model_dir = Path(resolve_model_path(args.model_path))
    config = json.loads((model_dir / "config.json").read_text())
    layers = config["num_hidden_layers"]
    shapes = {k: v for k, v in model_shapes(config).items() if k in args.shapes.split(",")}
    rows = [int(m) for m in args.rows.split(",") if m]
    isas = []
    for name in args.isa.split(","):
        got = ext.isa_name("" if name == "auto" else name)
        if name in ("auto", got) and got not in isas:
            isas.append(got)
    weights = {}
    for i, (name, (n, k, _)) in enumerate(shapes.items()):
        head = name == "lm_head"
        fmt = Fmt.Q8_0 if head else Fmt[args.layer_format]
        weights[name] = packed(fmt, n, k, seed=i, copies=1 if head else layers)

    results = []
    with tqdm(total=len(isas) * len(rows) * len(shapes), desc="matmuls", unit="shape") as bar:
        for isa in isas:
            for m in rows:
                cell = {"isa": isa, "rows": m, "ms": {}}
                for name, (n, k, epi) in shapes.items():
                    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                    y = torch.zeros(m, n // 2 if epi == EPI_SILU_MUL else n)
                    cell["ms"][name] = time_call(weights[name], x, y, args.digits, args.threads,
                                                 isa, epi, args.reps)
                    if args.quantize:
                        cell.setdefault("quantize_ms", {})[name] = time_quantize(
                            x, args.digits, isa, args.reps)
                    bar.update()
                per_layer = sum(v for kk, v in cell["ms"].items() if kk != "lm_head")
                cell["per_forward_ms"] = per_layer * layers + cell["ms"].get("lm_head", 0.0)
                cell["per_row_ms"] = cell["per_forward_ms"] / m
                if args.quantize:
                    cell["quantize_per_forward_ms"] = sum(
                        v * (1 if kk == "lm_head" else layers)
                        for kk, v in cell["quantize_ms"].items())
                results.append(cell)

    headers = ["isa", "M", *shapes, "per forward", "per row"]
    table = [[c["isa"], c["rows"], *(f"{c['ms'][s]:.3f}" for s in shapes),
              f"{c['per_forward_ms']:.2f}", f"{c['per_row_ms']:.3f}"] for c in results]
    report = {"args": vars(args), "machine": machine_info(), "layers": layers,
              "shapes": shapes, "results": results}
    out = write_json(args.output, report)
    print(f"\nJSON: {out}\n")
    print(f"ms per call (median of {args.reps}), {args.digits} digits, {args.threads} threads; "
          f"per forward = {layers} layers x the layer shapes + lm_head")
    print(format_table(headers, table))
    if args.quantize:
        print(f"\nquantizing the rows alone: ms per call, one thread (median of {args.reps})")
        print(format_table(["isa", "M", *shapes, "per forward"],
                           [[c["isa"], c["rows"], *(f"{c['quantize_ms'][s]:.3f}" for s in shapes),
                             f"{c['quantize_per_forward_ms']:.2f}"] for c in results]))
    return report


if __name__ == "__main__":
    main()
