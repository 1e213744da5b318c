"""Logprobs: the row computation, the payload helpers, and the scheduler + runner path on a
tiny model (prefill chunks, mixed batches, retraction, speculation, stops)."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.runtime.errors import InvalidRequestError
from specserve.runtime.messages import GenerateReq, TokenOut
from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.runtime.sampling import logprobs as lp
from specserve.runtime.sampling.logprobs import LogprobOptions, logprob_rows
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.speculative.base import SpecConfig, create_drafter
from specserve.speculative.worker import SpeculativeWorker
from tests.unit.test_scheduler import Harness, prompts, tiny  # noqa: F401


def test_logprob_rows_are_log_softmax_with_sorted_alternatives():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    logits[2, 7] = logits[2, 9] = 30.0  # a tie at the top: lower id first
    tokens = [3, 0, 9, 49]
    out = logprob_rows(logits, tokens, 5)
    ref = torch.log_softmax(logits.double(), dim=-1)
    for r, t in enumerate(tokens):
        assert math.isclose(out["lp"][r], float(ref[r, t]), abs_tol=1e-5)
        assert out["top_lp"][r] == sorted(out["top_lp"][r], reverse=True)
        assert out["top_ids"][r][0] == int(ref[r].argmax()) or r == 2
        assert set(out["top_ids"][r]) == set(ref[r].topk(5).indices.tolist())
    assert out["top_ids"][2][:2] == [7, 9]
    assert "top_ids" not in logprob_rows(logits, tokens, 0)


def test_a_rows_logprobs_do_not_depend_on_the_other_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 4000, generator=g)
    whole = logprob_rows(logits, list(range(9)), 3)
    for r in range(9):
        one = logprob_rows(logits[r : r + 1], [r], 3)
        assert one["lp"] == whole["lp"][r : r + 1] and one["top_lp"] == whole["top_lp"][r:r + 1]


def test_the_engines_stats_give_the_same_logprobs_as_log_softmax():
    """logprob_rows from the CPU engine's per-row log-sum-exp and top entries (LogitStats)
    agrees with log_softmax + topk to float rounding, with the same alternatives in the same
    order; rows are picked by index; a row whose lse is NaN takes the torch way."""
    ext = pytest.importorskip("specserve.kernels.cpu").load()
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 3000, generator=g) * 3
    logits[4, 10] = logits[4, 2000] = 20.0  # a tie at the top
    _, lse, vals, ids = ext.logit_stats(logits, 4, 2, "")
    stats = lp.LogitStats(lse, vals, ids)
    rows, tokens = [5, 0, 4, 4], [1, 2, 3, 2000]
    fast = logprob_rows(logits, tokens, 3, rows=rows, stats=stats)
    slow = logprob_rows(logits[rows], tokens, 3)
    assert _close(fast["lp"], slow["lp"]) and fast["top_ids"] == slow["top_ids"]
    assert all(_close(a, b) for a, b in zip(fast["top_lp"], slow["top_lp"]))
    assert fast["top_ids"][2][:2] == [10, 2000]
    assert "top_ids" not in logprob_rows(logits, tokens, 0, rows=rows, stats=stats)
    bad = lp.LogitStats(lse.clone(), vals, ids)
    bad.lse[0] = float("nan")  # (row 0, the second asked for: a row the engine could not do)
    mixed = logprob_rows(logits, tokens, 3, rows=rows, stats=bad)
    for key in ("lp", "top_ids", "top_lp"):  # that row the torch way, the others unchanged
        assert mixed[key][1] == slow[key][1]
        assert [mixed[key][i] for i in (0, 2, 3)] == [fast[key][i] for i in (0, 2, 3)]
    # more alternatives than the engine found: the torch way
    assert logprob_rows(logits, tokens, 5, rows=rows, stats=stats) == logprob_rows(
        logits[rows], tokens, 5)


def test_payload_concat_and_head():
    a = {"in_pos": 3, "in_lp": [-1.0], "lp": [-0.5]}
    b = {"lp": [-0.25, -0.125]}
    both = lp.concat([a, b])
    assert both == {"in_pos": 3, "in_lp": [-1.0], "lp": [-0.5, -0.25, -0.125]}
    assert a == {"in_pos": 3, "in_lp": [-1.0], "lp": [-0.5]}  # inputs untouched
    assert lp.head(both, 1) == {"in_pos": 3, "in_lp": [-1.0], "lp": [-0.5]}


@pytest.mark.parametrize(("opts", "field"), [
    (LogprobOptions(21), "top_logprobs_num"), (LogprobOptions(-1), "top_logprobs_num"),
    (LogprobOptions(0, -1), "logprob_start_len"), (LogprobOptions(0, 5), "logprob_start_len"),
])
def test_options_out_of_range_are_invalid_requests(opts, field):
    with pytest.raises(InvalidRequestError) as err:
        opts.validate(prompt_len=5)
    assert err.value.field == field


class LogprobHarness(Harness):
    """The scheduler harness, keeping each request's logprob payloads."""

    def __init__(self, tiny, **cfg):  # noqa: F811
        super().__init__(tiny, **cfg)
        self.logprobs: dict[str, dict] = {}

    def emit(self, msg):
        super().emit(msg)
        if isinstance(msg, TokenOut) and msg.logprobs is not None:
            for rid, payload in zip(msg.rids, msg.logprobs):
                if payload is not None:
                    lp.extend(self.logprobs.setdefault(rid, {}), payload)

    def submit_lp(self, rid, ids, opts: LogprobOptions | None, **params):
        p = SamplingParams(**{"temperature": 0.0, "max_new_tokens": 12, **params})
        self.sched.handle(GenerateReq(rid=rid, input_ids=ids, sampling_params=p,
                                      logprobs=opts))


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(a, b))


def test_prompt_logprobs_across_chunks_equal_the_outputs_when_rescored(tiny):  # noqa: F811
    """Request a decodes; request b's prompt is a's prompt + output, scored from where a's
    output began: b's prompt logprobs (prefill rows, 16-token chunks, mixed with other
    requests' decode rows) are a's output logprobs (decode rows)."""
    ps = prompts(6, seed=5)
    h = LogprobHarness(tiny, chunked_prefill_size=16, max_running_requests=4)
    for i, p in enumerate(ps):  # every other request asks for nothing
        h.submit_lp(f"a{i}", p, LogprobOptions(2) if i % 2 == 0 else None, ignore_eos=True)
    h.run()
    for i in range(0, 6, 2):
        assert len(h.logprobs[f"a{i}"]["lp"]) == 12
        assert "in_lp" not in h.logprobs[f"a{i}"]
        assert f"a{i + 1}" not in h.logprobs
    for i in range(0, 6, 2):  # b-requests and plain decoders share the batches
        h.submit_lp(f"b{i}", ps[i] + h.outputs[f"a{i}"], LogprobOptions(2, len(ps[i])),
                    max_new_tokens=3)
        h.submit_lp(f"c{i}", ps[i + 1], None, max_new_tokens=20, ignore_eos=True)
    h.run()
    for i in range(0, 6, 2):
        a, b = h.logprobs[f"a{i}"], h.logprobs[f"b{i}"]
        assert b["in_pos"] == len(ps[i])
        assert _close(b["in_lp"], a["lp"]), (b["in_lp"], a["lp"])
        assert b["in_top_ids"] == a["top_ids"]
        assert len(b["lp"]) == 3
    h.sched.check_no_leak()


def test_retraction_neither_repeats_nor_drops_logprobs(tiny):  # noqa: F811
    ps = prompts(6, seed=1)
    h = LogprobHarness(tiny, capacity=160, chunked_prefill_size=64, decode_reserve_ratio=0.0)
    for i, p in enumerate(ps):
        h.submit_lp(f"r{i}", p, LogprobOptions(0, 0), ignore_eos=True, max_new_tokens=40)
    h.run()
    assert h.sched.totals["retracted"] > 0, "capacity was meant to force retractions"
    for i, p in enumerate(ps):
        got = h.logprobs[f"r{i}"]
        assert len(got["lp"]) == len(h.outputs[f"r{i}"]) == 40
        assert got["in_pos"] == 1 and len(got["in_lp"]) == len(p) - 1
    h.sched.check_no_leak()


def test_speculative_logprobs_equal_plain_and_stop_cuts_them(tiny):  # noqa: F811
    ps = [p * 3 for p in prompts(8, seed=2)]  # repeats: the n-gram drafter gets accepted
    opts = LogprobOptions(3)
    plain = LogprobHarness(tiny)
    for i, p in enumerate(ps):
        plain.submit_lp(f"r{i}", p, opts, ignore_eos=True, max_new_tokens=16)
    plain.run()
    spec = LogprobHarness(tiny, num_draft_tokens=6, max_running_requests=4)
    cfg = SpecConfig("NGRAM", 6)
    runner = tiny[1]
    spec.worker = RunnerWorker(runner, SpeculativeWorker(cfg, create_drafter(cfg, runner),
                                                         runner))
    spec.sched.run_batch = spec.worker.run
    for i, p in enumerate(ps):
        spec.submit_lp(f"r{i}", p, opts, ignore_eos=True, max_new_tokens=16)
    # a stop token in the middle of a verify step's tokens: the logprobs end with the tokens
    stop_at = plain.outputs["r0"][5]
    spec.submit_lp("stop", ps[0], opts, ignore_eos=True, max_new_tokens=16,
                   stop_token_ids=[stop_at])
    spec.run()
    assert spec.sched.info()["spec_decode_num_accepted_tokens"] > 0
    compared = 0
    for i in range(len(ps)):
        a, b = plain.logprobs[f"r{i}"], spec.logprobs[f"r{i}"]
        if plain.outputs[f"r{i}"] != spec.outputs[f"r{i}"]:
            continue  # (the torch engine's near-ties: tests/helpers/near_tie.py)
        assert _close(b["lp"], a["lp"]) and b["top_ids"] == a["top_ids"]
        compared += 1
    assert compared >= 6
    n = len(spec.outputs["stop"])
    assert n == plain.outputs["r0"].index(stop_at) + 1
    assert _close(spec.logprobs["stop"]["lp"], plain.logprobs["r0"]["lp"][:n])
    spec.sched.check_no_leak()


def test_select_rows_copies_only_a_strict_subset():
    x = torch.randn(4, 10)
    assert lp.select_rows(x, [0, 1, 2, 3]) is x
    assert torch.equal(lp.select_rows(x, [2, 0]), x[[2, 0]])
    assert torch.equal(lp.select_rows(x, [1, 0, 2, 3]), x[[1, 0, 2, 3]])
