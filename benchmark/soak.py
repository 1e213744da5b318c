"""Soak: many concurrent clients against one server for minutes, mixing greedy, sampled,
aborted and disconnecting requests; every completed greedy output must equal the same
prompt's single-request run, memory must stay flat and the KV must come back.

    python -m benchmark.soak --duration 600 --streams 64 \\
        --server-args "--speculative-algorithm NGRAM --max-running-requests 64"

1. Start the server; run each greedy prompt alone (one at a time): the references. Then
   /flush_cache, so the load starts from a cold prefix cache.
2. `--streams` clients loop for `--duration` seconds; each request is greedy (non-streamed, the
   output compared token for token), sampled (T = 0.8, half seeded), aborted (streamed, then
   /abort_request after its first chunk) or disconnected (streamed, connection dropped).
3. RSS of the server's process tree after the warm-up minute and at the end (growth < 5%),
   per process as well, each taken idle: the clients pause until nothing is in flight and
   `--idle-wait` s pass, so the model runner has handed its freed heap back (HeapTrimmer) and
   RSS is the memory in use. Under load the runner's RSS also holds the allocator's freed
   buffers (~0.5 GB, refilled within seconds of a trim: docs/benchmarks.md, "Admission, soak
   and fuzz"); those in-load
   figures and a time series every `--rss-every` s are in the JSON too. Then /flush_cache
   and `kv_free == kv_capacity` from /server_info.
Prints the summary last and writes JSON; exit 0 only when every check holds.

`--mode grammar-abort`: instead, abort under grammars and speculation (benchmark/soak_abort.py):
`--streams` concurrent streamed chat requests shaped by JSON schemas and forced tool calls, a
third disconnected mid-stream; afterwards nothing is held (KV, the runner's records, grammar
matchers, drafter state) and the rest completed with valid JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from benchmark.common import machine_info, stop_children_on_sigterm, write_json
from benchmark.soak_abort import grammar_abort
from benchmark.sweep_serving import server
from specserve.corpora.datasets import chat_prompt_ids, load_bench_tokenizer, sample_requests

KINDS = ("greedy", "sampled", "abort", "disconnect")
WEIGHTS = (0.55, 0.25, 0.1, 0.1)


def tree_rss_kb(url_port: int) -> dict[str, int]:
    """RSS (KiB) of the process listening on the port and of each descendant, by process name
    (the server names its children specserve-run / specserve-sched); "total" is their sum."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    parent, rss, names, root = {}, {}, {}, 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            status = Path(f"/proc/{pid}/status").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            names[pid] = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        parent[pid] = int(stat[1])
        rss[pid] = next((int(line.split()[1]) for line in status.splitlines()
                         if line.startswith("VmRSS:")), 0)
        if b"launch_server" in b" ".join(cmd) and str(url_port).encode() in cmd:
            root = pid
    assert root, f"no launch_server process on port {url_port}"
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        for c, pp in parent.items():
            if pp == p and c not in tree:
                tree.add(c)
                frontier.append(c)
    out: dict[str, int] = {}
    for p in tree:
        name = "front end" if p == root else names.get(p, str(p))
        out[name] = out.get(name, 0) + rss.get(p, 0)
    out["total"] = sum(rss.get(p, 0) for p in tree)
    return out


async def generate(client: httpx.AsyncClient, ids: list[int], params: dict,
                   priority: int | None = None) -> dict:
    body = {"input_ids": ids, "sampling_params": params}
    if priority is not None:
        body["priority"] = priority
    r = await client.post("/generate", json=body)
    r.raise_for_status()
    return r.json()


async def streamed(client: httpx.AsyncClient, ids: list[int], params: dict, kind: str,
                   priority: int | None = None) -> None:
    rid = f"soak-{uuid.uuid4().hex}"
    body = {"input_ids": ids, "sampling_params": params, "stream": True, "rid": rid}
    if priority is not None:
        body["priority"] = priority
    async with client.stream("POST", "/generate", json=body) as r:
        r.raise_for_status()
        lines = r.aiter_lines()  # one iterator: a response's stream can be read only once
        async for line in lines:
            if not line.startswith("data: "):
                continue
            if kind == "abort":
                (await client.post("/abort_request", json={"rid": rid})).raise_for_status()
                async for _ in lines:  # the rest of the same stream must still end cleanly
                    pass
            return  # disconnect: leave the context with the stream open


async def soak(url: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    timeout = httpx.Timeout(600.0, connect=30.0)
    limits = httpx.Limits(max_connections=args.streams + 8)
    greedy = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        refs = []
        for ids in prompts:  # single-request runs: the references
            refs.append((await generate(client, ids, greedy))["output_ids"])
        # the load starts from a cold prefix cache, as a fresh server's: its first requests for
        # one prompt (or a shared few-shot prefix) wait for one prefill of it, not reuse ours
        await client.post("/flush_cache")
        counts = {k: 0 for k in KINDS}
        failures: list[str] = []
        mismatches: list[int] = []
        rss: dict[str, dict[str, int]] = {}
        series: list[dict[str, Any]] = []  # (seconds, RSS by process): a leak climbs, a cache
        # filling to its bound flattens
        port = int(url.rsplit(":", 1)[1])
        t0 = time.monotonic()
        end = t0 + args.duration
        go = asyncio.Event()  # cleared while the idle RSS is taken
        go.set()

        async def drained() -> None:
            for _ in range(240):  # aborted/disconnected requests drain
                info = (await client.get("/server_info")).json()
                if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
                    return
                await asyncio.sleep(0.5)

        async def idle_rss() -> dict[str, int]:
            """RSS with nothing in flight, `--idle-wait` s after the last request: the live
            memory (the model runner hands its freed heap back once idle; HeapTrimmer)."""
            await drained()
            await asyncio.sleep(args.idle_wait)
            return tree_rss_kb(port)

        async def client_loop(worker: int) -> None:
            rng = random.Random(args.seed * 1000 + worker)
            while time.monotonic() < end:
                await go.wait()
                i = rng.randrange(len(prompts))
                kind = rng.choices(KINDS, WEIGHTS)[0]
                prio = rng.randrange(args.priority_levels) if args.priority_levels else None
                try:
                    if kind == "greedy":
                        out = await generate(client, prompts[i], greedy, prio)
                        if out["output_ids"] != refs[i]:
                            mismatches.append(i)
                    elif kind == "sampled":
                        p = {"temperature": 0.8, "max_new_tokens": args.max_new_tokens}
                        if rng.random() < 0.5:
                            p["seed"] = rng.randrange(2**32)
                        await generate(client, prompts[i], p, prio)
                    else:
                        await streamed(client, prompts[i], greedy, kind, prio)
                    counts[kind] += 1
                except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
                    failures.append(f"{kind}: {exc!r}")

        async def sampler() -> None:
            await asyncio.sleep(min(args.warmup, args.duration / 2))
            rss["warm_load"] = tree_rss_kb(port)
            go.clear()  # clients finish what they run, start nothing new
            rss["warm_idle"] = await idle_rss()
            go.set()
            while time.monotonic() < end:
                series.append({"t_s": round(time.monotonic() - t0, 1),
                               "rss_mb": {k: round(v / 1024, 1)
                                          for k, v in tree_rss_kb(port).items()}})
                await asyncio.sleep(min(args.rss_every, max(0.0, end - time.monotonic())))

        await asyncio.gather(sampler(), *(client_loop(w) for w in range(args.streams)))
        rss["end_load"] = tree_rss_kb(port)
        elapsed = time.monotonic() - t0
        rss["end_idle"] = await idle_rss()
        flushed = (await client.post("/flush_cache")).json()
        info = (await client.get("/server_info")).json()

    def mb(kb: dict[str, int]) -> dict[str, float]:
        return {k: round(v / 1024, 1) for k, v in kb.items()}

    growth = rss["end_idle"]["total"] / rss["warm_idle"]["total"] - 1.0
    return {
        "elapsed_s": elapsed, "requests": counts, "failures": failures[:20],
        "num_failures": len(failures), "greedy_mismatches": len(mismatches),
        # the check: idle (live) RSS after the warm-up against at the end
        "rss_warm_mb": rss["warm_idle"]["total"] / 1024,
        "rss_end_mb": rss["end_idle"]["total"] / 1024,
        "rss_growth": growth,
        "rss_idle_by_process_mb": {"warm": mb(rss["warm_idle"]), "end": mb(rss["end_idle"])},
        # under load, for the record: live memory plus whatever the allocators hold freed
        "rss_load_growth": rss["end_load"]["total"] / rss["warm_load"]["total"] - 1.0,
        "rss_load_by_process_mb": {"warm": mb(rss["warm_load"]), "end": mb(rss["end_load"])},
        "rss_series": series, "flush": flushed,
        "kv_free": info["kv_free"], "kv_capacity": info["kv_capacity"],
        # how much of the prompts came from the prefix cache, and how many requests waited for
        # another's prefill of a shared prefix first
        **{k: info.get(k) for k in ("prompt_tokens", "cached_tokens", "shared_prefill_waits")},
        # requests sent back to the queue: for KV, or (priority scheduling) for a more urgent one
        **{k: info.get(k) for k in ("retracted", "preempted")},
        "ok": not failures and not mismatches and growth < 0.05
        and info["kv_free"] == info["kv_capacity"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("mixed", "grammar-abort"), default="mixed",
                   help="mixed: the timed soak above; grammar-abort: one round of constrained "
                   "streamed requests, a third disconnected (--streams, --max-new-tokens)")
    p.add_argument("--duration", type=float, default=600)
    p.add_argument("--warmup", type=float, default=60, help="seconds before the first RSS")
    p.add_argument("--idle-wait", type=float, default=3.0,
                   help="seconds with nothing in flight before an idle RSS (the model runner "
                   "trims its heap after 1 s idle)")
    p.add_argument("--rss-every", type=float, default=30,
                   help="seconds between the RSS samples of the time series in the JSON")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--dataset", default="sharegpt", choices=("sharegpt", "rewrite", "schema"),
                   help="prompts (schema: few-shot prompts sharing long prefixes, so requests "
                   "also wait for a prompt being prefilled and take it from the cache)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--priority-levels", type=int, default=0,
                   help="each request gets a random `priority` in [0, N) (0: none); with "
                   "--enable-priority-scheduling in --server-args and fewer seats than "
                   "streams, urgent requests preempt running ones, whose greedy outputs are "
                   "still checked")
    p.add_argument("--seed", type=int, default=19)
    p.add_argument("--server-args",
                   default="--speculative-algorithm NGRAM --max-running-requests 64")
    p.add_argument("--output", default="results/soak.json")
    args = p.parse_args(argv)
    if args.mode == "grammar-abort":
        return run_grammar_abort(args)
    tok = load_bench_tokenizer(None)
    reqs = sample_requests(args.dataset, args.num_prompts, tok, args.seed, args.max_new_tokens)
    prompts = [r.input_ids or (chat_prompt_ids(tok, r.messages) if r.messages
                               else tok.encode(r.prompt, add_special_tokens=False))
               for r in reqs]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with server(shlex.split(args.server_args), Path(args.output).with_suffix(".server.log")) \
            as url:
        result = asyncio.run(soak(url, args, prompts))
    write_json(args.output, {"config": vars(args), "machine": machine_info(), **result})
    print(json.dumps({k: v for k, v in result.items() if k not in ("failures", "rss_series")},
                     indent=1))
    for f in result["failures"]:
        print("failure:", f)
    return 0 if result["ok"] else 1


def run_grammar_abort(args: argparse.Namespace) -> int:
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with server(shlex.split(args.server_args), Path(args.output).with_suffix(".server.log")) \
            as url:
        result = asyncio.run(grammar_abort(url, args.streams, args.max_new_tokens))
    write_json(args.output, {"config": vars(args), "machine": machine_info(), **result})
    for f in result["failures"]:
        print("failure:", f)
    print(json.dumps({k: v for k, v in result.items() if k != "failures"}, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    stop_children_on_sigterm()
    raise SystemExit(main())
