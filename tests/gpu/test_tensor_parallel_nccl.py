"""`--tp-size 2` on two GPUs: NCCL carries the partial sums and the logits, gloo the commands
(specserve/runtime/distributed.py); greedy output equals one GPU's but for near-ties of the bf16
sums. Needs two CUDA devices."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.engine_runs import run_concurrent

GREEDY = {"max_new_tokens": 32, "temperature": 0}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "List three colours:", "Translate to French: good morning", "2 + 2 ="]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_serve_what_one_serves():
    from specserve.launch import Engine

    with Engine(log_level="warning", device="cuda") as one:
        ids = [one.tm.tokenize(p) for p in PROMPTS]
        want = [o["output_ids"] for o in run_concurrent(one, ids, [GREEDY] * len(ids), 3)]
    with Engine(log_level="warning", device="cuda", tp_size=2) as two:
        got = [o["output_ids"] for o in run_concurrent(two, ids, [GREEDY] * len(ids), 3)]
    same = sum(a == b for a, b in zip(want, got))
    assert same >= len(PROMPTS) - 2, (want, got)
