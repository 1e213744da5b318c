"""Speculation equals plain decoding, token for token (greedy near-ties excepted only on the
torch engine, tests/helpers/near_tie.py): the tiny model in-process with NGRAM on 50 prompts,
and every algorithm on the default model through `Engine` (the shipped heads, draft model and
adapter), greedy and seeded, on the reference's strongest prompts (all 52 under `make test-all`)
(tests/helpers/lossless.py; the algorithms are shared with test_spec_lossless_draft_models.py,
so that `make test`'s two workers split them)."""

from __future__ import annotations

import random

import pytest

from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.speculative.base import SpecConfig, create_drafter
from specserve.speculative.worker import SpeculativeWorker
from tests.helpers.lossless import GROUPS, check_spec_equals_plain
from tests.unit.test_scheduler import Harness, reference, tiny  # noqa: F401


def copy_heavy_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat phrases, so the n-gram trie finds matches and drafts get accepted."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, 300) for _ in range(rng.randrange(3, 8))]
        body = []
        for _ in range(rng.randrange(2, 6)):
            body += phrase + [rng.randrange(3, 300) for _ in range(rng.randrange(0, 4))]
        out.append(body)
    return out


@pytest.mark.parametrize("concurrency", [1, 8])
def test_tiny_model_ngram_greedy_equals_plain(tiny, concurrency):  # noqa: F811
    prompts = copy_heavy_prompts(50, seed=concurrency)
    ref = reference(tiny, prompts, ignore_eos=True, max_new_tokens=20)
    h = Harness(tiny, num_draft_tokens=8, max_running_requests=concurrency)
    cfg = SpecConfig("NGRAM", 8)
    runner = tiny[1]
    h.worker = RunnerWorker(runner, SpeculativeWorker(cfg, create_drafter(cfg, runner), runner))
    h.sched.run_batch = h.worker.run
    for i, p in enumerate(prompts):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=20)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(50)] == ref
    assert h.sched.info()["spec_decode_num_accepted_tokens"] > 0
    h.sched.check_no_leak()


@pytest.mark.slow
@pytest.mark.parametrize("algo", GROUPS[0])
def test_default_model_spec_equals_plain_on_the_strongest_prompts(algo, plain_reference):
    """NGRAM, SUFFIX, LOOKAHEAD, MEDUSA, MLP_SPECULATOR and JUMP_FORWARD (the others:
    test_spec_lossless_draft_models.py)."""
    check_spec_equals_plain(algo, plain_reference)


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("algo", GROUPS[0])
def test_default_model_spec_equals_plain_on_every_prompt(algo, plain_reference):
    check_spec_equals_plain(algo, plain_reference, full=True)
