"""Scheduler + in-process runner worker on a tiny model: batching must not change outputs."""

from __future__ import annotations

import random

import pytest

from specserve.runtime.messages import AbortReq, FlushCacheReq, GenerateReq, TokenOut
from specserve.runtime.model_loader.tokenizer import load_tokenizer
from specserve.runtime.model_runner.local_generator import LocalGenerator
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.runtime.scheduler.scheduler import Scheduler, SchedulerConfig
from specserve.runtime.scheduler.stop import StopChecker
from specserve.runtime.verify_cost import stored_verify_cost
from specserve.speculative.controller import SpecController
from specserve.speculative.planning import TreeSizes
from tests.helpers.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = write_tiny_model(tmp_path_factory.mktemp("sched") / "m", "llama", seed=3)
    runner = ModelRunner(RunnerConfig(str(d), "cpu", "float32", max_total_tokens=4096))
    return d, runner


class Harness:
    """A scheduler over a real runner, in process. `num_draft_tokens` > 1 gives it a
    speculation controller (tests then set `h.worker` to a speculative runner worker): fixed
    draft sizes, every request its cap every step, unless `load_aware=True` (the controller
    plans: specserve/speculative/controller.py) — speculative tests check what a draft of a given
    size does, the controller's own tests what size it picks. `max_draft_tokens` / `deep_for_all`
    are the controller's `TreeSizes.alone` / `deep_for_all`; `tree_sizes` gives the controller those
    sizes instead (a controller for JUMP_FORWARD: TreeSizes(1, 1))."""

    def __init__(self, tiny, capacity=4096, num_draft_tokens=1, load_aware=False,
                 max_draft_tokens=None, deep_for_all=False, tree_sizes=None, **cfg):
        model_dir, runner = tiny
        self.worker = RunnerWorker(runner)
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, dict] = {}
        self.meta: dict[str, dict] = {}
        stop = StopChecker(load_tokenizer(model_dir), [2], 256)
        spec = None
        if num_draft_tokens > 1 or tree_sizes is not None:
            sizes = tree_sizes or TreeSizes(num_draft_tokens,
                                            max_draft_tokens or num_draft_tokens,
                                            deep_for_all=deep_for_all)
            spec = SpecController(sizes, stored_verify_cost("cpu"), adaptive=load_aware)
        self.sched = Scheduler(SchedulerConfig(**cfg), capacity, stop,
                               lambda msg: self.worker.run(msg), self.emit, spec)

    def traffic_off(self, global_interval: int = 64) -> None:
        """The controller (`load_aware=True`) as on traffic where drafting does not pay, and
        stays so whatever the probes accept: only server-wide probes, every
        `global_interval` steps (as after a few probes that did not pay)."""
        assert self.sched.spec.adaptive, "traffic_off needs load_aware=True"
        self.sched.spec.prior = [0.0, 1e9]
        self.sched.spec.global_interval = global_interval
        self.sched.spec.learn_cost = False  # (a cost learned lower would bring probes back)

    def emit(self, msg):
        if isinstance(msg, TokenOut):
            for rid, toks, fin, meta in zip(msg.rids, msg.new_token_ids, msg.finish_reasons,
                                            msg.meta_infos):
                self.outputs.setdefault(rid, []).extend(toks)
                if fin is not None:
                    self.finish[rid] = fin
                    self.meta[rid] = meta

    def submit(self, rid, ids, priority=None, **params):
        p = SamplingParams(**{"temperature": 0.0, "max_new_tokens": 12, **params})
        self.sched.handle(GenerateReq(rid=rid, input_ids=ids, sampling_params=p,
                                      priority=priority))

    @property
    def finished_order(self) -> list[str]:
        return list(self.finish)  # (dicts keep insertion order: the order requests finished)

    def run(self, max_steps=10_000):
        for _ in range(max_steps):
            if not self.sched.step():
                return
        raise AssertionError("scheduler did not go idle")


def prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(2, 60))] for _ in range(n)]


def reference(tiny, ps, **params):
    gen = LocalGenerator(tiny[1])
    p = SamplingParams(**{"temperature": 0.0, "max_new_tokens": 12, **params})
    return [r.output_ids for r in gen.generate(ps, [p] * len(ps))]


def test_continuous_batching_with_chunked_prefill_matches_one_at_a_time(tiny):
    ps = prompts(10)
    ref = reference(tiny, ps, ignore_eos=True)
    h = Harness(tiny, chunked_prefill_size=16, max_running_requests=4)
    for i, p in enumerate(ps[:5]):
        h.submit(f"r{i}", p, ignore_eos=True)
    for _ in range(3):  # let some decode before the rest arrive
        h.sched.step()
    for i, p in enumerate(ps[5:], start=5):
        h.submit(f"r{i}", p, ignore_eos=True)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(10)] == ref
    assert all(h.finish[f"r{i}"]["type"] == "length" for i in range(10))
    h.sched.check_no_leak()


def test_retraction_under_tiny_kv_keeps_outputs(tiny):
    ps = prompts(6, seed=1)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=40)
    h = Harness(tiny, capacity=160, chunked_prefill_size=64, decode_reserve_ratio=0.0)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=40)
    h.run()
    assert h.sched.totals["retracted"] > 0, "capacity was meant to force retractions"
    assert [h.outputs[f"r{i}"] for i in range(6)] == ref
    h.sched.check_no_leak()


def test_radix_cache_reports_cached_tokens_and_keeps_output(tiny):
    base = list(range(10, 50))
    h = Harness(tiny)
    h.submit("a", base + [7, 8])
    h.run()
    h.submit("b", base + [9])
    h.run()
    assert h.meta["a"]["cached_tokens"] == 0
    assert h.meta["b"]["cached_tokens"] >= len(base)
    assert h.outputs["b"] == reference(tiny, [base + [9]])[0]
    h.sched.check_no_leak()
    h.sched.handle(FlushCacheReq(req_id="f"))
    assert h.sched.allocator.num_free == h.sched.allocator.capacity


def test_a_running_requests_prompt_is_cached_once_prefilled(tiny):
    """A request with the same prompt (another sample of it) or a longer one, admitted while
    the first still decodes, prefills only what the first did not: its prompt went to the
    cache after its prefill, not at its end. Outputs as alone; no slot leaked."""
    base = list(range(10, 60))
    ref = reference(tiny, [base, base + [5, 6]], ignore_eos=True, max_new_tokens=30)
    h = Harness(tiny, chunked_prefill_size=16)
    h.submit("a", base, ignore_eos=True, max_new_tokens=30)
    for _ in range(6):  # 4 prefill chunks of 16, then decode steps
        h.sched.step()
    assert "a" not in h.finish and h.outputs["a"]
    h.submit("b", base, ignore_eos=True, max_new_tokens=30)
    h.submit("c", base + [5, 6], ignore_eos=True, max_new_tokens=30)
    h.run()
    assert h.meta["a"]["cached_tokens"] == 0
    assert h.meta["b"]["cached_tokens"] == len(base) - 1  # all but the last, which it computes
    assert h.meta["c"]["cached_tokens"] == len(base)
    assert [h.outputs[r] for r in "abc"] == [ref[0], ref[0], ref[1]]
    h.sched.check_no_leak()
    h.sched.handle(FlushCacheReq(req_id="f"))
    assert h.sched.allocator.num_free == h.sched.allocator.capacity


def test_requests_admitted_in_one_step_keep_their_own_prompt_slots(tiny):
    """Two requests with the same prompt prefilled side by side: the second to finish its
    prefill finds the prompt already cached by the first and keeps its own slots (freed as
    duplicates at its end), so the runner's slot table never changes under it."""
    base = list(range(10, 40))
    ref = reference(tiny, [base], ignore_eos=True, max_new_tokens=20)[0]
    h = Harness(tiny, chunked_prefill_size=256, shared_prefill_min_tokens=0)
    h.submit("a", base, ignore_eos=True, max_new_tokens=20)
    h.submit("b", base, ignore_eos=True, max_new_tokens=20)
    h.run()
    assert h.outputs["a"] == h.outputs["b"] == ref
    assert h.meta["b"]["cached_tokens"] == 0
    h.sched.check_no_leak()
    h.sched.handle(FlushCacheReq(req_id="f"))
    assert h.sched.allocator.num_free == h.sched.allocator.capacity


@pytest.mark.parametrize(("min_tokens", "chunk"), [(32, 32), (32, 512), (0, 512)])
def test_a_burst_behind_one_long_prefix_prefills_it_once(tiny, min_tokens, chunk):
    """Requests that arrive together behind one 80-token prefix (a system prompt, the samples
    of one prompt): the first prefills it (in 32-token chunks, or at once), the others wait
    until it is cached and prefill only their own tails; a request sharing nothing is admitted
    at once, past them. With the check off (0) they prefill side by side. Outputs as alone
    either way; no slot leaked."""
    rng = random.Random(3)
    base = [rng.randrange(3, 300) for _ in range(80)]
    ps = [base + [5], base + [6, 7], base, base + [8], [9, 10, 11]]
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=8)
    h = Harness(tiny, chunked_prefill_size=chunk, shared_prefill_min_tokens=min_tokens)
    rec = Recorder(h)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=8)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(5)] == ref
    cached = [h.meta[f"r{i}"]["cached_tokens"] for i in range(5)]
    lens = {f"r{i}": len(p) for i, p in enumerate(ps)}
    prefilled = sum(min(len(e.new_token_ids), lens[e.rid] - e.prefix_len)
                    for b in rec.batches for e in b.reqs if e.prefix_len < lens[e.rid])
    assert h.sched.info()["shared_prefill_waits"] == (3 if min_tokens else 0)
    if min_tokens:
        assert cached == [0, 80, 79, 80, 0]
        first = {}
        for k, b in enumerate(rec.batches):
            for e in b.reqs:
                first.setdefault(e.rid, k)
        assert first["r4"] < first["r1"] <= first["r2"] <= first["r3"]  # r4 went past them
        assert h.meta["r4"]["cached_tokens"] == 0
    else:
        assert cached == [0] * 5
    assert h.sched.totals["cached_tokens"] == sum(cached)
    assert prefilled == sum(lens.values()) - sum(cached)  # each prompt token computed once
    h.sched.check_no_leak()
    h.sched.handle(FlushCacheReq(req_id="f"))
    assert h.sched.allocator.num_free == h.sched.allocator.capacity


def _ran_in(rec: Recorder, rid: str) -> list[int]:
    return [k for k, b in enumerate(rec.batches) if any(e.rid == rid for e in b.reqs)]


@pytest.mark.parametrize("low_first", [False, True])
def test_priority_preempts_the_least_urgent_running_request(tiny, low_first):
    """Two long low-priority requests fill both seats; a request 20 levels more urgent arrives
    and is admitted in the very next step, in the seat of the later low one, which goes back to
    the queue and resumes (from the prefix cache) when a seat frees. Every output is what it
    is alone; nothing leaks. `low_first`: the same with SGLang's
    --schedule-low-priority-values-first (-20 is then the more urgent)."""
    ps = prompts(3, seed=11)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=30)
    sign = -1 if low_first else 1
    h = Harness(tiny, max_running_requests=2, chunked_prefill_size=64,
                enable_priority_scheduling=True, low_priority_values_first=low_first)
    rec = Recorder(h)
    h.submit("low0", ps[0], priority=0, ignore_eos=True, max_new_tokens=30)
    h.submit("low1", ps[1], priority=0, ignore_eos=True, max_new_tokens=30)
    for _ in range(4):
        h.sched.step()
    assert len(h.outputs["low1"]) >= 2
    h.submit("high", ps[2], priority=20 * sign, ignore_eos=True, max_new_tokens=30)
    arrived = len(rec.batches)
    h.sched.step()
    assert _ran_in(rec, "high")[0] == arrived  # admitted at once
    assert {r.rid for r in h.sched.running} == {"low0", "high"}
    assert [r.rid for r in h.sched.waiting] == ["low1"]
    h.run()
    assert [h.outputs[r] for r in ("low0", "low1", "high")] == ref
    assert h.sched.totals["preempted"] == 1 and h.sched.totals["retracted"] == 1
    assert h.finished_order.index("high") < h.finished_order.index("low1")
    assert h.meta["low1"]["cached_tokens"] == 0  # (reported for its first admission only)
    h.sched.check_no_leak()
    h.sched.handle(FlushCacheReq(req_id="f"))
    assert h.sched.allocator.num_free == h.sched.allocator.capacity


def test_priority_orders_the_queue_and_preempts_only_past_the_threshold(tiny):
    """One seat. A request 10 levels more urgent (not more than the threshold of 10) does not
    preempt the running one but goes ahead of the queue; one 11 levels more urgent preempts."""
    ps = prompts(4, seed=12)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=16)
    h = Harness(tiny, max_running_requests=1, enable_priority_scheduling=True)
    h.submit("a", ps[0], priority=0, ignore_eos=True, max_new_tokens=16)
    h.sched.step()
    h.submit("b", ps[1], priority=0, ignore_eos=True, max_new_tokens=16)
    h.submit("c", ps[2], priority=10, ignore_eos=True, max_new_tokens=16)
    h.sched.step()
    assert [r.rid for r in h.sched.running] == ["a"]
    assert [r.rid for r in h.sched.waiting] == ["c", "b"]
    h.submit("d", ps[3], priority=11, ignore_eos=True, max_new_tokens=16)
    h.sched.step()
    assert [r.rid for r in h.sched.running] == ["d"]
    # a (retracted, arrived first) heads its level again; c stays ahead of both
    assert [r.rid for r in h.sched.waiting] == ["c", "a", "b"]
    h.run()
    assert h.finished_order == ["d", "c", "a", "b"]
    assert [h.outputs[r] for r in "abcd"] == ref
    assert h.sched.totals["preempted"] == 1
    h.sched.check_no_leak()


def test_priority_preemption_frees_kv_for_an_urgent_prompt(tiny):
    """Seats are free but KV is not: the urgent request takes the KV of the least urgent
    running request (retracted), is admitted at once, and every output is as alone."""
    rng = random.Random(13)
    ps = [[rng.randrange(3, 300) for _ in range(50)] for _ in range(3)]
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=40)
    h = Harness(tiny, capacity=200, chunked_prefill_size=64, decode_reserve_ratio=0.0,
                enable_priority_scheduling=True, disable_radix_cache=True)
    rec = Recorder(h)
    h.submit("low0", ps[0], priority=-5, ignore_eos=True, max_new_tokens=40)
    h.submit("low1", ps[1], priority=-20, ignore_eos=True, max_new_tokens=40)
    while h.sched.allocator.num_free >= 50:
        h.sched.step()
    h.submit("high", ps[2], priority=10, ignore_eos=True, max_new_tokens=40)
    arrived = len(rec.batches)
    h.sched.step()
    assert _ran_in(rec, "high")[0] == arrived
    assert [r.rid for r in h.sched.waiting] == ["low1"]  # the least urgent, not the latest
    h.run()
    assert [h.outputs[r] for r in ("low0", "low1", "high")] == ref
    assert h.sched.totals["preempted"] >= 1
    h.sched.check_no_leak()


def test_a_request_without_a_priority_ranks_last(tiny):
    """As SGLang ranks it: behind every request that has a priority, and preempted by any of
    them, however low; but not by another request without one."""
    ps = prompts(4, seed=15)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=16)
    h = Harness(tiny, max_running_requests=1, enable_priority_scheduling=True)
    h.submit("none0", ps[0], ignore_eos=True, max_new_tokens=16)
    h.sched.step()
    h.submit("none1", ps[1], ignore_eos=True, max_new_tokens=16)
    h.sched.step()
    assert [r.rid for r in h.sched.running] == ["none0"]
    h.submit("low", ps[2], priority=-(2**31), ignore_eos=True, max_new_tokens=16)
    h.sched.step()
    assert [r.rid for r in h.sched.running] == ["low"]
    assert [r.rid for r in h.sched.waiting] == ["none0", "none1"]
    h.run()
    assert [h.outputs[r] for r in ("none0", "none1", "low")] == ref[:3]
    assert h.finished_order == ["low", "none0", "none1"]
    h.sched.check_no_leak()


def test_a_full_queue_drops_its_least_urgent_request_for_a_more_urgent_one(tiny):
    """--max-queued-requests 2 under priority scheduling (SGLang's rule): a newcomer more
    urgent than the least urgent queued request (the latest of equals) takes its place, which
    ends as an abort with status 503; one that is not is refused the same way. The others run
    as alone."""
    ps = prompts(6, seed=16)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=8)
    h = Harness(tiny, max_running_requests=1, enable_priority_scheduling=True,
                max_queued_requests=2)
    h.submit("run", ps[0], priority=50, ignore_eos=True, max_new_tokens=8)
    h.sched.step()
    h.submit("a", ps[1], priority=0, ignore_eos=True, max_new_tokens=8)
    h.submit("b", ps[2], priority=0, ignore_eos=True, max_new_tokens=8)
    h.submit("c", ps[3], priority=1, ignore_eos=True, max_new_tokens=8)  # b (later) goes
    assert h.finish["b"] == {"type": "abort", "status_code": 503,
                             "message": "The request is aborted by a higher priority request."}
    h.submit("d", ps[4], priority=0, ignore_eos=True, max_new_tokens=8)  # not above a: refused
    assert h.finish["d"] == {"type": "abort", "status_code": 503,
                             "message": "The request queue is full."}
    h.submit("e", ps[5], ignore_eos=True, max_new_tokens=8)  # no priority: last, refused
    assert h.finish["e"]["message"] == "The request queue is full."
    assert [r.rid for r in h.sched.waiting] == ["c", "a"]
    h.run()
    assert [h.outputs.get(r, []) for r in ("run", "a", "c")] == [ref[0], ref[1], ref[3]]
    assert all(not h.outputs.get(r) for r in "bde")
    info = h.sched.info()
    assert (info["rejected"], info["aborted"]) == (2, 1)
    h.sched.check_no_leak()


def test_without_priority_scheduling_priorities_change_nothing(tiny):
    ps = prompts(3, seed=14)
    h = Harness(tiny, max_running_requests=1)
    h.submit("a", ps[0])
    h.submit("b", ps[1], priority=-100)
    h.submit("c", ps[2], priority=100)
    h.run()
    assert h.finished_order == ["a", "b", "c"]
    assert h.sched.totals["preempted"] == 0


def test_abort_waiting_and_running_frees_kv(tiny):
    h = Harness(tiny, max_running_requests=1)
    h.submit("run", list(range(5, 30)), max_new_tokens=50, ignore_eos=True)
    h.submit("wait", list(range(5, 20)))
    h.sched.step()
    h.sched.step()
    h.sched.handle(AbortReq(rid="wait"))
    h.sched.handle(AbortReq(rid="run"))
    assert h.finish["wait"]["type"] == "abort" and h.finish["run"]["type"] == "abort"
    assert not h.sched.step()
    h.sched.check_no_leak()
    h.sched.handle(FlushCacheReq(req_id="f"))
    assert h.sched.allocator.num_free == h.sched.allocator.capacity


def test_a_second_live_request_with_the_same_id_is_refused_and_the_first_unharmed(tiny):
    ps = prompts(2, seed=7)
    ref = reference(tiny, ps[:1], ignore_eos=True, max_new_tokens=20)[0]
    h = Harness(tiny)
    h.submit("dup", ps[0], ignore_eos=True, max_new_tokens=20)
    h.sched.step()
    h.submit("dup", ps[1], ignore_eos=True, max_new_tokens=20)
    refusal = h.finish.pop("dup")  # no tokens: the refusal adds none to the first's output
    assert refusal["type"] == "abort" and "still running" in refusal["message"]
    h.run()
    assert h.outputs["dup"] == ref and h.finish["dup"]["type"] == "length"
    h.sched.check_no_leak()


def test_runner_replaces_a_stale_state_when_a_new_request_reuses_its_id(tiny):
    new = list(range(40, 80))
    ref = reference(tiny, [new], ignore_eos=True, repetition_penalty=1.3)[0]
    h = Harness(tiny)
    h.submit("x", [5, 6, 7], ignore_eos=True, max_new_tokens=2)  # a short history
    # (a request still running: a scheduler that goes idle sends its releases at once)
    h.submit("y", [8, 9], ignore_eos=True, max_new_tokens=40)
    while "x" not in h.finish:
        h.sched.step()
    # a release that has not reached the runner: its old state is still there
    h.sched.released = []
    assert "x" in h.worker.states
    h.submit("x", new, ignore_eos=True, repetition_penalty=1.3)
    h.sched.step()
    st = h.worker.states["x"]  # the new request's own history, nothing of the old one's
    assert st.prompt_ids == new and st.output_ids == h.outputs["x"][2:]
    h.run()
    assert h.outputs["x"][2:] == ref
    h.sched.check_no_leak()


def test_stop_token_ids_and_max_tokens(tiny):
    ps = prompts(1, seed=5)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=12)[0]
    h = Harness(tiny)
    h.submit("s", ps[0], ignore_eos=True, stop_token_ids=[ref[4]])
    h.run()
    cut = ref.index(ref[4]) + 1
    assert h.outputs["s"] == ref[:cut]
    assert h.finish["s"] == {"type": "stop", "matched": ref[4]}


class Recorder:
    """Wraps the harness's runner call and keeps every `RunBatch` it sends."""

    def __init__(self, h: Harness) -> None:
        self.batches = []
        self._run = h.sched.run_batch
        h.sched.run_batch = self

    def __call__(self, msg):
        self.batches.append(msg)
        return self._run(msg)


def test_prefill_never_pauses_decoding_and_mixed_batches_match_single_runs(tiny):
    rng = random.Random(5)
    short, long_ = [rng.randrange(3, 300) for _ in range(6)], \
        [rng.randrange(3, 300) for _ in range(150)]
    refs = [reference(tiny, [p], ignore_eos=True, max_new_tokens=30)[0] for p in (short, long_)]
    h = Harness(tiny, chunked_prefill_size=16)
    rec = Recorder(h)
    h.submit("short", short, ignore_eos=True, max_new_tokens=30)
    h.sched.step()  # the short prompt, then it decodes
    h.submit("long", long_, ignore_eos=True, max_new_tokens=30)
    h.run()
    assert [h.outputs["short"], h.outputs["long"]] == refs  # bit-identical to running alone
    chunks = [b for b in rec.batches if any(e.rid == "long" and len(e.new_token_ids) > 1
                                            for e in b.reqs)]
    assert len(chunks) >= 150 // 16
    for b in chunks:  # every prefill step carries the decoding request's next token
        rows = {e.rid: e for e in b.reqs}
        assert len(rows["short"].new_token_ids) == 1 and rows["short"].needs_token
        assert sum(len(e.new_token_ids) for e in b.reqs) <= 16  # one token budget for both
    h.sched.check_no_leak()


def test_runner_keeps_the_slot_table_so_steps_ship_only_new_slots(tiny):
    from specserve.runtime.messages import unpack_ints

    ps = prompts(6, seed=1)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=40)
    h = Harness(tiny, capacity=160, chunked_prefill_size=64, decode_reserve_ratio=0.0)
    rec = Recorder(h)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=40)
    h.run()
    assert h.sched.totals["retracted"] > 0, "capacity was meant to force retractions"
    assert [h.outputs[f"r{i}"] for i in range(6)] == ref
    full_lists = {}
    for b in rec.batches:
        for e in b.reqs:
            shipped = unpack_ints(e.kv_slots).numel()
            if e.slots_start == 0 and e.prefix_len > 0 or shipped > len(e.new_token_ids):
                full_lists[e.rid] = full_lists.get(e.rid, 0) + 1
            else:
                assert e.slots_start == e.prefix_len and shipped == len(e.new_token_ids)
    # a whole slot list travels only when a request is (re-)admitted over cached/other KV
    assert sum(full_lists.values()) <= h.sched.totals["retracted"]
    h.sched.check_no_leak()
