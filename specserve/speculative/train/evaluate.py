"""Stage 4 of training: mean accept length through the REAL speculative worker.

An `Engine` with `--speculative-algorithm EAGLE3 --speculative-draft-model-path <head>` (or
STANDALONE with a draft model, EARLY_EXIT with an exit adapter) answers
held-out ShareGPT prompts (`split="heldout"`: conversations the regen stage never used); the
accept length is SGLang's definition, completion tokens / verify steps, summed over requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger(__name__)


# The tree every evaluation uses, whatever the device's serving default: accept length grows with
# the tree, so a fixed one keeps the curve over training comparable across runs.
EVAL_TREE = {"speculative_num_steps": 3, "speculative_eagle_topk": 4,
             "speculative_num_draft_tokens": 8}

# Chain drafters (STANDALONE, EARLY_EXIT): chains of 3 that draft on every step (no adaptation), so
# the accept length measures the draft, not the policy.
CHAIN_EVAL = {"speculative_num_steps": 3, "speculative_eagle_topk": 1,
              "speculative_num_draft_tokens": 4, "speculative_disable_adaptive": True}


def evaluate_head(
    head_dir: str | Path, target_model: str = "default", num_prompts: int = 24,
    max_new_tokens: int = 128, temperature: float = 0.0, concurrency: int = 4, seed: int = 0,
    algorithm: str = "EAGLE3", extra_server_args: dict | None = None,
) -> dict:
    """{"accept_length", "verify_steps", "completion_tokens", "accept_rate_per_pos", ...}."""
    from specserve.corpora.datasets import chat_prompt_ids, load_bench_tokenizer, sample_requests
    from specserve.speculative.plugin import speculative_engine

    tokenizer = load_bench_tokenizer(None if target_model == "default" else target_model)
    reqs = sample_requests("sharegpt", num_prompts, tokenizer, seed=seed, split="heldout",
                           max_new_tokens=max_new_tokens)
    prompts = [chat_prompt_ids(tokenizer, r.messages) for r in reqs]
    options = {"draft_model_path": str(head_dir), **EVAL_TREE, **(extra_server_args or {})}
    engine = speculative_engine(algorithm, options, model_path=target_model,
                                max_running_requests=concurrency, log_level="warning")
    t0 = time.monotonic()
    try:
        outs = asyncio.run(_run(engine, prompts, reqs, temperature, seed, concurrency))
        info = engine.server_info()
    finally:
        engine.shutdown()
    steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    tokens = sum(len(o["output_ids"]) for o in outs)
    hist: list[int] = []
    for o in outs:
        for k, c in enumerate(o["meta_info"].get("spec_accept_histogram") or []):
            hist += [0] * (k + 1 - len(hist))
            hist[k] += c
    per_pos = [sum(hist[k:]) / max(steps, 1) for k in range(1, len(hist))]
    return {
        "head": str(head_dir), "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "temperature": temperature, "completion_tokens": tokens, "verify_steps": steps,
        "accept_length": tokens / steps if steps else None, "accept_rate_per_pos": per_pos,
        "server_avg_spec_accept_length": (info or {}).get("avg_spec_accept_length"),
        "wall_s": round(time.monotonic() - t0, 1),
    }


async def _run(engine, prompts, reqs, temperature, seed, concurrency) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(prompts), desc="eval accept length", unit="req", dynamic_ncols=True)

    async def one(i: int) -> dict:
        async with sem:
            params = {"max_new_tokens": reqs[i].max_new_tokens, "temperature": temperature,
                      "seed": seed * 7919 + i}
            out = await engine.async_generate(input_ids=prompts[i], sampling_params=params)
            bar.update(1)
            return out

    outs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    bar.close()
    return list(outs)


def evaluate_snapshots(output: str | Path, every: int = 1, **kwargs) -> list[dict]:
    """Accept length of each exported snapshot (`snapshots/tokens-*`), appended to
    `train/eval_worker.jsonl` (snapshots already there are skipped)."""
    out = Path(output)
    log = out / "train" / "eval_worker.jsonl"
    seen = set()
    if log.exists():
        seen = {json.loads(x)["head"] for x in log.read_text().splitlines() if x.strip()}
    all_snaps = sorted((out / "snapshots").glob("tokens-*"))
    snaps = all_snaps[::-1][::max(every, 1)][::-1]  # every N-th, counted back from the last
    results = []
    for snap in snaps:
        if str(snap) in seen:
            continue
        res = evaluate_head(snap, **kwargs)
        res["train_tokens"] = int(snap.name.split("-")[1])
        logger.info("%s: accept length %.3f", snap.name, res["accept_length"] or 0)
        with log.open("a") as fh:
            fh.write(json.dumps(res) + "\n")
        results.append(res)
    return results
