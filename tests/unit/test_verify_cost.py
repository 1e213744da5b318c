"""The verify-cost curve measured on this machine at start-up (specserve/runtime/verify_cost.py):
what it measures, that a server plans with it, or with a curve file handed to it."""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
import time

import pytest
import torch

from specserve.launch.server_args import parse_args
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from specserve.runtime.model_runner.runner_process import StartupQuiet
from specserve.runtime.verify_cost import (
    VERIFY_COST,
    VerifyCost,
    measure_verify_cost,
    measure_verify_times,
)
from specserve.speculative import worker as worker_mod
from specserve.speculative.base import SpecConfig
from specserve.speculative.worker import SpeculativeWorker
from tests.helpers.tiny_models import write_tiny_model


def tiny_runner(tmp_path, **kw) -> ModelRunner:
    d = write_tiny_model(tmp_path / "m", "llama", seed=3)
    return ModelRunner(RunnerConfig(str(d), "cpu", "float32", max_total_tokens=2048, **kw))


def test_measured_curve_starts_at_one_and_costs_more_for_many_rows(tmp_path):
    runner = tiny_runner(tmp_path)
    cost = measure_verify_cost(runner, prefix=64, ns=(1, 2, 4, 64, 128), reps=3)
    assert cost.rows == (1, 2, 4, 64, 128) and cost.ratios[0] == 1.0
    assert all(r > 0 for r in cost.ratios)
    # 128 rows of attention and MLP cannot cost less than one row, on any machine
    assert cost(128) > 1.0
    assert "measured" in cost.source
    assert VerifyCost.from_dict(cost.to_dict()).rows == cost.rows


def test_measurement_fits_a_short_context_and_leaves_slot_zero_alone(tmp_path):
    runner = tiny_runner(tmp_path, context_length=40)
    before = [k[0].clone() for k in runner.kv_pool.k[:1]]  # slot 0: the padding slot
    t = measure_verify_times(runner, prefix=256, ns=(1, 2, 8, 64), reps=1)
    assert sorted(t) == [1, 2, 8]  # 64 rows do not fit a 40-token context
    assert torch.equal(runner.kv_pool.k[0][0], before[0])


def test_a_server_worker_measures_unless_told_to_use_the_table(tmp_path, monkeypatch):
    runner = tiny_runner(tmp_path)
    events = []
    real = worker_mod.measure_verify_cost
    monkeypatch.setattr(worker_mod, "measure_verify_cost",
                        lambda r: events.append("measure") or real(r))
    measured = SpeculativeWorker.create(SpecConfig("NGRAM", 4), runner,
                                        before_measure=lambda: events.append("quiet"))
    assert "measured" in measured.verify_cost.source
    assert measured.drafter.verify_cost is measured.verify_cost
    assert events == ["quiet", "measure"]  # the runner process waits for its neighbours first
    table = SpeculativeWorker.create(SpecConfig("NGRAM", 4, verify_cost="table"), runner,
                                     before_measure=lambda: events.append("quiet"))
    assert table.verify_cost is VERIFY_COST[runner.engine]
    assert events == ["quiet", "measure"]  # nothing timed: nothing to wait for


def test_startup_quiet_waits_for_every_event_and_gives_up_after_its_timeout(monkeypatch):
    ctx = mp.get_context("spawn")
    a, b = ctx.Event(), ctx.Event()
    threading.Timer(0.2, a.set).start()
    threading.Timer(0.4, b.set).start()
    t0 = time.monotonic()
    StartupQuiet((a, b)).wait()
    assert a.is_set() and b.is_set() and time.monotonic() - t0 >= 0.35
    monkeypatch.setattr(StartupQuiet, "TIMEOUT_S", 0.6)
    t0 = time.monotonic()
    StartupQuiet((ctx.Event(),)).wait()  # never set: measured anyway, with a warning
    assert 0.5 <= time.monotonic() - t0 < 3.0


def test_a_curve_file_is_used_as_it_is_and_a_bad_one_is_refused(tmp_path):
    runner = tiny_runner(tmp_path)
    path = tmp_path / "curve.json"
    path.write_text(json.dumps({"rows": [1, 4], "ratios": [1.0, 1.3], "source": "replica0"}))
    worker = SpeculativeWorker.create(SpecConfig("NGRAM", 4, verify_cost=str(path)), runner,
                                      before_measure=lambda: pytest.fail("nothing to time"))
    assert worker.verify_cost.ratios == (1.0, 1.3) and "replica0" in worker.verify_cost.source
    args = ["--speculative-algorithm", "NGRAM", "--speculative-verify-cost"]
    assert parse_args([*args, str(path)]).resolve().spec_config().verify_cost == str(path)
    for bad in (str(tmp_path / "missing.json"), "fast"):
        with pytest.raises(ValueError, match="--speculative-verify-cost"):
            parse_args([*args, bad]).resolve()
