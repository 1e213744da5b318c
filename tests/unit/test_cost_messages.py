"""The learned verify cost across the scheduler and the model runner, in process: each step's
target forward is timed in the runner and reaches the controller in `BatchResult`, the curve
the controller learns reaches the runner's drafter in `RunBatch`, and an idle server times its
prior again over scratch KV it gets back. Greedy output stays plain decoding's."""

from __future__ import annotations

from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.speculative.base import SpecConfig, create_drafter
from specserve.speculative.controller import SpecController
from specserve.speculative.planning import TreeSizes
from specserve.speculative.worker import SpeculativeWorker
from tests.helpers.cost_replay import TRUE, distorted
from tests.unit.test_scheduler import Harness, prompts, reference, tiny  # noqa: F401


def ngram_harness(tiny, prior):  # noqa: F811
    h = Harness(tiny, num_draft_tokens=4, load_aware=True, max_running_requests=4)
    runner = tiny[1]
    cfg = SpecConfig("NGRAM", 4)
    h.worker = RunnerWorker(runner, SpeculativeWorker(cfg, create_drafter(cfg, runner), runner,
                                                      prior))
    h.sched.spec = SpecController(TreeSizes(4, 8), prior)
    return h


def test_forwards_are_timed_the_curve_reaches_the_drafter_and_output_is_plain(tiny):  # noqa: F811
    ps = [p * 3 for p in prompts(4, seed=5)]  # prompts that repeat themselves
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=32)
    prior = distorted(TRUE, factor=5.0)  # far from what the tiny model's forwards cost
    h = ngram_harness(tiny, prior)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=32)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(4)] == ref
    info = h.sched.info()
    assert info["spec_decode_num_accepted_tokens"] > 0, "drafts must be accepted"
    ctl = h.sched.spec
    assert info["verify_cost_timed_forwards"] == ctl.cost.samples > 0
    assert ctl.cost.learned_rows() > 1  # verify forwards, not only decode ones
    # the drafter holds a learned curve (it is resent only once it moved by CURVE_RESEND, so
    # the controller's may have gained a bucket since)
    drafter_curve = h.worker.spec.drafter.verify_cost
    assert drafter_curve is not prior and drafter_curve.source.startswith("learned from")
    h.sched.check_no_leak()


def test_an_idle_server_times_its_prior_again_over_scratch_slots_it_gets_back(tiny):  # noqa: F811
    h = ngram_harness(tiny, distorted(TRUE))
    h.submit("a", prompts(1, seed=6)[0], ignore_eos=True, max_new_tokens=8)
    h.run()
    free = h.sched.allocator.num_free
    h.sched.spec.remeasure_rows = lambda: [1, 2, 4]
    h.sched.measure_when_idle()
    prior = h.sched.spec.cost.prior
    assert "measured again while idle" in prior.source
    assert prior.rows[:3] == (1, 2, 4) and prior.rows[-1] == TRUE.rows[-1]
    assert h.sched.allocator.num_free == free
    h.sched.check_no_leak()
