"""EAGLE / EAGLE3 speculation through the real scheduler and runner worker on a tiny target:
greedy output equals plain decoding token for token (random heads, and heads steered toward the
known continuation so deep trees get accepted), the head's KV mirrors the target's committed
slots, and no KV leaks."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.launch.server_args import ServerArgs
from specserve.runtime.forward_batch import ForwardBatch, ForwardMode
from specserve.runtime.model_runner.model_runner import ModelRunner, RunnerConfig
from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.speculative.base import SpecConfig, create_drafter
from specserve.speculative.drafters.eagle import Eagle3Drafter, EagleDrafter
from specserve.speculative.models.base import HeadOutput
from specserve.speculative.worker import SpeculativeWorker
from tests.helpers.eagle_checkpoints import write_eagle1_checkpoint, write_eagle3_checkpoint
from tests.helpers.tiny_models import write_tiny_model
from tests.unit.test_scheduler import Harness, prompts, reference

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = write_tiny_model(tmp_path_factory.mktemp("eagle_w") / "t", "llama", seed=3,
                         num_hidden_layers=4)  # EAGLE-3 captures the states entering 2, 2, 1
    return d, ModelRunner(RunnerConfig(str(d), "cpu", "float32", max_total_tokens=4096))


@pytest.fixture(scope="module")
def truth(target):
    ps = prompts(50, seed=21)
    return ps, reference(target, ps, ignore_eos=True, max_new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def heads(target, truth, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle_heads")
    ps, ref = truth
    # EAGLE-3's reduced vocabulary: the ids these runs use (so steering can reach them); ids
    # 0-2 and 300+ are left out, so draft id d != target id
    hot = torch.tensor(sorted({t for p, r in zip(ps, ref) for t in p + r}))
    return {"EAGLE": write_eagle1_checkpoint(root / "e1", target[0], seed=1),
            "EAGLE3": write_eagle3_checkpoint(root / "e3", target[0], seed=2,
                                              draft_vocab_size=hot.numel(), hot_ids=hot)}


class Steered:
    """Makes the known next token likely (top, or second) in most head rows. Keys are
    (position, input token) of the head row; the truth of every prompt is merged, so a
    collision only makes a draft wrong. Only logits change: KV and hidden stay the head's."""

    hints: dict[tuple[int, int], int]

    def _run_head(self, batch, hidden, fused):
        out = super()._run_head(batch, hidden, fused)
        rows = batch.logits_indices
        logits = out.logits.clone()
        pos, tok = batch.positions[rows].tolist(), batch.input_ids[rows].tolist()
        for i, (p, x) in enumerate(zip(pos, tok)):
            want = self.hints.get((p, x))
            if want is None or (p + x) % 4 == 3:  # a quarter of the rows stay unsteered
                continue
            d = want
            if self.to_target is not None:  # EAGLE-3: its draft id, if it has one
                found = (self.to_target == want).nonzero().flatten()
                if found.numel() == 0:
                    continue
                d = int(found[0])
            others = logits[i].clone()
            others[d] = float("-inf")
            best, rival = others.max(dim=0)
            # a confident head: the hint takes most of the mass, alone or shared with a rival
            # that outranks it (then the right draft is the second child)
            logits[i, d] = best + 6.0
            if (p + x) % 4 == 2:
                logits[i, rival] = best + 6.01
        return HeadOutput(logits, out.hidden)


class SteeredEagle(Steered, EagleDrafter):
    pass


class SteeredEagle3(Steered, Eagle3Drafter):
    pass


def hints_of(ps, outs) -> dict[tuple[int, int], int]:
    hints = {}
    for p, r in zip(ps, outs):
        seq = p + r
        for t in range(len(seq) - 2):  # head row t: (token t+1, hidden t) → token t+2
            hints[(t, seq[t + 1])] = seq[t + 2]
    return hints


def eagle_harness(target, ckpt, algo, *, hints=None, steps=3, topk=4, n=8, **sched):
    runner = target[1]
    cfg = SpecConfig(algo, n, draft_model_path=str(ckpt), num_steps=steps, eagle_topk=topk,
                     disable_adaptive=True)
    if hints is None:
        drafter = create_drafter(cfg, runner)
    else:
        drafter = {"EAGLE": SteeredEagle, "EAGLE3": SteeredEagle3}[algo](cfg, runner)
        drafter.hints = hints
    h = Harness(target, num_draft_tokens=n, **sched)
    h.worker = RunnerWorker(runner, SpeculativeWorker(cfg, drafter, runner))
    h.sched.run_batch = h.worker.run
    return h, drafter


def force_sizes(h, sizes_of) -> None:
    """The harness's controller plans as before, then `sizes_of(states, plan_sizes)` decides
    each request's tree nodes (the step neither idle nor off)."""
    from specserve.runtime.speculation import StepPlan

    ctl = h.sched.spec

    def plan(states, full=ctl.plan):
        sizes = sizes_of(states, full(states).sizes)
        return StepPlan(sizes, [False] * len(states), False, False)

    ctl.plan = plan


def head_rows_run(monkeypatch, drafter) -> list[int]:
    """The row counts of the drafter's draft-extend head forwards (target features in), as
    they run."""
    rows_run = []
    real_head = drafter._run_head

    def spy(batch, hidden, fused):
        if fused:
            rows_run.append(batch.num_tokens)
        return real_head(batch, hidden, fused)

    monkeypatch.setattr(drafter, "_run_head", spy)
    return rows_run


def count_moves(monkeypatch, runner) -> list[int]:
    moves = []
    real = runner.kv_pool.move

    def spy(src, dst):
        moves.append(src.numel())
        real(src, dst)

    monkeypatch.setattr(runner.kv_pool, "move", spy)
    return moves


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("steered", [False, True])
def test_greedy_eagle_equals_plain_decoding_on_50_prompts(target, truth, heads, monkeypatch,
                                                          algo, concurrency, steered):
    ps, ref = truth
    moves = count_moves(monkeypatch, target[1])
    h, _ = eagle_harness(target, heads[algo], algo, hints=hints_of(ps, ref) if steered else None,
                         max_running_requests=concurrency)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=NEW_TOKENS)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(len(ps))] == ref
    info = h.sched.info()
    # every step verified a full dynamic tree: 7 drafts over up to 3 levels
    assert info["spec_decode_num_draft_tokens"] == 7 * info["spec_verify_steps"]
    if steered:
        per_pos = info["spec_decode_num_accepted_tokens_per_pos"]
        assert info["avg_spec_accept_length"] > 2.0, info
        assert len(per_pos) == 3 and per_pos[2] > 50, per_pos  # depth-3 drafts accepted
        assert len(moves) > 50, "accepted paths off the first branches move their KV"
    h.sched.check_no_leak()


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_chunked_prefill_radix_hits_retraction_and_stops_keep_greedy_output(target, heads,
                                                                            algo):
    rng = random.Random(4)
    shared = [rng.randrange(3, 300) for _ in range(30)]
    ps = [shared + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 12))] for _ in range(8)]
    ref = reference(target, ps, ignore_eos=True, max_new_tokens=30)
    h, _ = eagle_harness(target, heads[algo], algo, hints=hints_of(ps, ref), capacity=150,
                         chunked_prefill_size=16, decode_reserve_ratio=0.0)
    for i, p in enumerate(ps):
        stop = [ref[i][9]] if i % 3 == 0 else []
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=30, stop_token_ids=stop)
    h.run()
    for i in range(len(ps)):
        expect = ref[i][: ref[i].index(ref[i][9]) + 1] if i % 3 == 0 else ref[i]
        assert h.outputs[f"r{i}"] == expect, i
    totals = h.sched.totals
    assert totals["retracted"] > 0 and totals["cached_tokens"] > 0, totals
    assert h.sched.info()["avg_spec_accept_length"] > 1.5
    h.sched.check_no_leak()


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_head_kv_after_spec_steps_equals_one_draft_extend_of_the_history(target, heads, algo):
    """Mirror layout: after prefill chunks and verify commits (with moves), once its pending rows
    are caught up (the head runs lazily, `draft_extend`), the head's KV at the request's
    committed slots and its kept hidden equal one head pass over the whole history."""
    ps = prompts(1, seed=33)
    ps[0] = (ps[0] * 3)[:45]
    ref = reference(target, ps, ignore_eos=True, max_new_tokens=40)
    h, drafter = eagle_harness(target, heads[algo], algo, hints=hints_of(ps, ref),
                               chunked_prefill_size=16)
    h.submit("r", ps[0], ignore_eos=True, max_new_tokens=40)
    while len(h.outputs.get("r", [])) < 20:
        assert h.sched.step()
    req = h.sched.running[0]
    length, fill, slots = req.kv_len, req.fill_ids, req.kv_slots
    with torch.inference_mode():
        drafter._catch_up(["r"])
    assert len(fill) == length + 1
    runner = target[1]
    fresh = h.sched.allocator.alloc(length)
    out = runner.forward(ForwardBatch.build(
        ForwardMode.EXTEND, [fill[:length]], [fresh], [0], capture_layers=drafter.capture_layers,
    ), return_final_hidden=drafter.needs_final_hidden)
    base = EagleDrafter._run_head(  # the unsteered head, rows written to the fresh slots
        drafter, ForwardBatch.build(ForwardMode.DRAFT_EXTEND, [fill[1 : length + 1]], [fresh],
                                    [0]), drafter.head.target_hidden(out), True)
    pool = drafter.head.kv_pool
    for cache in (pool.k[0], pool.v[0], runner.kv_pool.k[-1]):
        torch.testing.assert_close(cache[slots], cache[fresh], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(drafter.reqs["r"].state.hidden, base.hidden[-1], atol=1e-4,
                               rtol=1e-4)
    h.sched.allocator.free(fresh)
    h.run()
    assert h.outputs["r"] == ref[0]
    h.sched.check_no_leak()


def test_server_args_choose_the_eagle_tree_and_check_it(target, heads):
    base = {"model_path": str(target[0]), "device": "cpu", "speculative_algorithm": "eagle",
            "speculative_draft_model_path": str(heads["EAGLE"])}
    args = ServerArgs(**base).resolve()
    assert (args.speculative_num_steps, args.speculative_eagle_topk,
            args.speculative_num_draft_tokens) == (2, 2, 4)  # the CPU default
    cfg = args.spec_config()
    assert (cfg.algorithm, cfg.num_steps, cfg.eagle_topk, cfg.num_draft_tokens) == (
        "EAGLE", 2, 2, 4)
    chain = ServerArgs(**base, speculative_num_steps=5, speculative_eagle_topk=1,
                       speculative_num_draft_tokens=16).resolve()
    assert chain.speculative_num_draft_tokens == 6  # k = 1 is a chain of num_steps
    with pytest.raises(ValueError, match="exceeds the 7 nodes"):
        ServerArgs(**base, speculative_num_steps=2, speculative_eagle_topk=2,
                   speculative_num_draft_tokens=8).resolve()
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        ServerArgs(**{**base, "speculative_draft_model_path": None}).resolve()
    wrong = SpecConfig("EAGLE3", 8, draft_model_path=str(heads["EAGLE"]), num_steps=3,
                       eagle_topk=4)
    with pytest.raises(ValueError, match="needs a eagle3 head"):
        create_drafter(wrong, target[1])


def test_a_request_that_does_not_draft_runs_the_head_in_batches_not_per_step(target, heads,
                                                                               monkeypatch):
    """The head runs lazily: a request kept from drafting (budget 1 every step, as the
    controller does) stores its committed rows' features and the head goes over them in one
    forward per MAX_PENDING_ROWS rows, and at release; a drafting request catches up before
    it drafts."""
    ps = prompts(2, seed=7)
    h, drafter = eagle_harness(target, heads["EAGLE3"], "EAGLE3", chunked_prefill_size=16)
    force_sizes(h, lambda states, sizes: [1] * len(states))  # nobody drafts
    calls = []
    real = drafter._run_head

    def spy(batch, hidden, fused):
        calls.append((fused, batch.num_tokens))
        return real(batch, hidden, fused)

    monkeypatch.setattr(drafter, "_run_head", spy)
    monkeypatch.setattr(drafter, "MAX_PENDING_ROWS", 64)
    monkeypatch.setattr(drafter, "IDLE_STEPS", 10**9)  # never idle: every row goes through
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=100)
    h.run()
    for i in range(len(ps)):
        h.worker.spec.release(f"r{i}")  # as the next batch's released_rids would
    rows = sum(len(p) + 100 for p in ps)
    assert all(fused for fused, _ in calls)  # extends only, no draft step
    assert sum(n for _, n in calls) >= rows - 2  # every committed row, once
    assert len(calls) <= rows // 64 + 2 * len(ps), calls  # in batches, not one per step
    assert not drafter.reqs  # released: nothing kept
    h.sched.check_no_leak()


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_an_idle_request_drops_its_rows_and_stays_exact_when_it_drafts_again(
        target, truth, heads, algo, monkeypatch):
    """A request kept plain for IDLE_STEPS steps stops running the head over its rows (they
    are dropped, all but the last, at MAX_PENDING_ROWS and at release); when it drafts again
    its head KV has a stale stretch, which costs acceptance only: the output is still plain
    greedy decoding's."""
    ps = truth[0][:4]
    ref = reference(target, ps, ignore_eos=True, max_new_tokens=60)
    h, drafter = eagle_harness(target, heads[algo], algo)
    monkeypatch.setattr(drafter, "MAX_PENDING_ROWS", 16)
    monkeypatch.setattr(drafter, "IDLE_STEPS", 4)
    rows_run = head_rows_run(monkeypatch, drafter)
    worker = h.worker.spec
    steps: dict[int, int] = {}

    def sizes_of(states, sizes):  # plain for 30 steps, then drafting
        for st in states:
            steps[id(st)] = steps.get(id(st), 0) + 1
        return [1 if steps[id(st)] <= 30 else n for st, n in zip(states, sizes)]

    force_sizes(h, sizes_of)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=60)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(len(ps))] == ref
    assert drafter.dropped_rows > 0
    assert sum(rows_run) < sum(len(p) + 60 for p in ps) - 20  # rows skipped, not run
    assert h.sched.info()["spec_decode_num_draft_tokens"] > 0  # it drafted again, verified
    for i in range(len(ps)):
        worker.release(f"r{i}")
    assert not drafter.reqs  # every request's rows and state dropped at release
    h.sched.check_no_leak()


@pytest.mark.parametrize("probes", [False, True])
def test_while_nobody_drafts_prompts_skip_the_head_until_a_probe(target, truth, heads, probes,
                                                                monkeypatch):
    """While the drafter does not pay on the traffic (`traffic_off`), a prompt's rows wait
    instead of going through the head at prefill, and a request that finishes drops them: with
    no server-wide probe due, the head never runs. A probe's warm-up steps bring a waiting
    request's rows through the head (a gap of skipped steps after them) before it drafts. The
    output is plain greedy decoding's either way."""
    ps = truth[0][:3]
    ref = reference(target, ps, ignore_eos=True, max_new_tokens=40)
    runner = target[1]
    cfg = SpecConfig("EAGLE3", 8, draft_model_path=str(heads["EAGLE3"]), num_steps=3,
                     eagle_topk=4)  # adaptive: the worker's regimes apply
    drafter = create_drafter(cfg, runner)
    monkeypatch.setattr(drafter, "MAX_PENDING_ROWS", 4)  # every prompt is over the cap
    h = Harness(target, num_draft_tokens=8, load_aware=True)
    worker = SpeculativeWorker(cfg, drafter, runner)
    # the traffic does not pay: the server-wide regime, as the steps before these requests
    # would have set it
    h.traffic_off(global_interval=24 if probes else 10**9)
    drafter.traffic_off = True
    h.worker = RunnerWorker(runner, worker)
    h.sched.run_batch = h.worker.run
    rows_run = head_rows_run(monkeypatch, drafter)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=40)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(len(ps))] == ref
    assert drafter.traffic_off
    if probes:
        assert h.sched.info()["spec_decode_num_draft_tokens"] > 0  # a probe drafted
        assert max(rows_run) >= min(len(p) for p in ps)  # a whole prompt, caught up late
    else:
        assert rows_run == []  # no prompt, no committed row went through the head
    for i in range(len(ps)):
        worker.release(f"r{i}")
    assert not drafter.reqs  # released: nothing kept
    h.sched.check_no_leak()


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
def test_runs_split_by_a_gap_go_through_the_head_in_one_batch_as_one_after_another(
        target, heads, monkeypatch, algo):
    """Rows that waited (`traffic_off`) before a gap of skipped steps stay a closed run
    (`waited`) when newer rows arrive, instead of going through the head then; the request's
    next draft runs the closed runs and the open one as entries of one batch. The head KV and
    state that gives are those of the runs going through the head one after another, and the
    gap's positions are never written."""
    from specserve.speculative.base import TargetRows

    cfg = SpecConfig(algo, 8, draft_model_path=str(heads[algo]), num_steps=3, eagle_topk=4)
    drafter = create_drafter(cfg, target[1])
    pool = drafter.head.kv_pool
    width = drafter.head.config.hidden_size * (3 if algo == "EAGLE3" else 1)
    feats = torch.randn(30, width, generator=torch.Generator().manual_seed(5))
    tokens = torch.randint(3, 200, (31,), generator=torch.Generator().manual_seed(6)).tolist()
    slots = torch.arange(100, 131)
    runs = [(0, 12), (17, 23), (23, 30)]  # positions 12..16: plain steps, nothing captured
    # the features of a step's rows stand in for its ModelOutput
    monkeypatch.setattr(drafter.head, "target_hidden", lambda out: out)
    rows_run = head_rows_run(monkeypatch, drafter)

    def head_after(one_batch: bool):
        for t in pool.k + pool.v:
            t.zero_()
        drafter.reset()
        drafter.traffic_off = True
        for s, e in runs:
            drafter.draft_extend([TargetRows("r", s, slots[:e], torch.arange(e - s),
                                             tokens[s + 1 : e + 1], tokens[s:e])], feats[s:e])
            if not one_batch:
                drafter._catch_up(["r"])
        if one_batch:
            assert rows_run == []  # nothing went through the head at the gap
            assert [(q.start, q.end) for q in drafter.reqs["r"].waited] == [(0, 12)]
            drafter._catch_up(["r"])  # as `propose` does for a request that drafts
            assert rows_run == [30 - 5]
        q = drafter.reqs["r"]
        assert q.pending is None and not q.waited
        st = q.state
        return [t[slots].clone() for t in pool.k + pool.v], st.logits.clone(), st.hidden.clone()

    kv1, logits1, hidden1 = head_after(one_batch=False)
    rows_run.clear()
    kv2, logits2, hidden2 = head_after(one_batch=True)
    for a, b in zip(kv1, kv2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert a[12:17].abs().sum() == 0 and a[:12].abs().sum() > 0
    torch.testing.assert_close(logits1, logits2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden1, hidden2, rtol=1e-5, atol=1e-5)
