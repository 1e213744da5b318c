"""The per-request speculation trace (`return_spec_trace`) and the per-request opt-out
(`disable_speculation`), on a tiny target in-process: every trace message crosses msgpack as
the processes send it, the trace accounts for every output token, each tree is a tree whose
accepted path is a path of it, and asking for neither changes nothing."""

from __future__ import annotations

import msgspec
import pytest
import torch

from specserve.runtime.messages import TO_TOKENIZER, BatchResult, GenerateReq, TokenOut
from specserve.runtime.model_loader.default_model import resolve_model_path
from specserve.runtime.model_loader.tokenizer import load_tokenizer
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.runtime.tokenizer.spec_trace import TokenPieces
from specserve.speculative.tree import DraftTree
from tests.unit.test_scheduler import prompts, reference, tiny  # noqa: F401
from tests.unit.test_spec_scheduler import (
    ChainOracleDrafter,
    OracleMixDrafter,
    chain_oracle_harness,
    spec_harness,
)

NEW = 24


class Wire:
    """The scheduler's messages to the front end, encoded and decoded as the IPC does, and
    the runner's results likewise; keeps every trace step per request."""

    def __init__(self, h) -> None:
        self.h = h
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder(TO_TOKENIZER)
        self.steps: dict[str, list] = {}
        self.token_outs: list[TokenOut] = []
        self.results: list[BatchResult] = []
        run = h.sched.run_batch

        def run_batch(msg):
            res = msgspec.msgpack.Decoder(BatchResult).decode(self.enc.encode(run(msg)))
            self.results.append(res)
            return res

        h.sched.run_batch = run_batch
        h.sched.emit = self.emit

    def emit(self, msg) -> None:
        msg = self.dec.decode(self.enc.encode(msg))
        if isinstance(msg, TokenOut):
            self.token_outs.append(msg)
            for rid, steps in zip(msg.rids, msg.spec_trace or [None] * len(msg.rids)):
                if steps:
                    self.steps.setdefault(rid, []).extend(steps)
        self.h.emit(msg)

    def submit(self, rid, ids, spec_trace=False, disable_speculation=False, **params):
        p = SamplingParams(**{"temperature": 0.0, "max_new_tokens": 12, **params})
        self.h.sched.handle(GenerateReq(rid=rid, input_ids=ids, sampling_params=p,
                                        spec_trace=spec_trace,
                                        disable_speculation=disable_speculation))


def check_trace(steps, prompt: list[int], output: list[int]) -> int:
    """Asserts the trace of one request against its output; returns the drafts it accepted."""
    assert [t for s in steps for t in s.output] == output, "the steps' tokens are the output"
    accepted = 0
    for k, s in enumerate(steps):
        assert s.start == sum(len(x.output) for x in steps[:k]), "steps are contiguous"
        assert s.output and s.step_s > 0 and s.batch_size >= 1
        if s.tree is None:
            assert len(s.output) == 1, "a plain step gives one token"
            continue
        t = s.tree
        n = len(t.tokens)
        assert n >= 2 and len(t.parents) == n and t.parents[0] == -1
        assert all(0 <= t.parents[i] < i for i in range(1, n)), "topological order"
        history = prompt + output[: s.start]
        assert t.tokens[0] == history[-1], "the root is the last verified token"
        path = t.accepted
        assert path[0] == 0 and len(set(path)) == len(path)
        assert all(t.parents[b] == a for a, b in zip(path, path[1:])), "a path of the tree"
        drafts = [t.tokens[u] for u in path[1:]]
        full = [*drafts, t.bonus]
        # a stop may cut the step's tokens short, never change them
        assert s.output == full[: len(s.output)]
        # greedy: the bonus is the target's token after the path, no child of it matches
        kids = [t.tokens[u] for u in range(n) if t.parents[u] == path[-1]]
        assert t.bonus not in kids
        accepted += len(drafts)
    return accepted


def test_trace_accounts_for_every_token_and_each_accepted_path_is_a_tree_path(tiny):  # noqa: F811
    ps = prompts(6, seed=21)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=NEW)
    truth = {tuple(p): r for p, r in zip(ps, ref)}
    h = spec_harness(tiny, lambda c, r: OracleMixDrafter(c, r, truth, 3),
                     max_running_requests=4, chunked_prefill_size=32)
    w = Wire(h)
    for i, p in enumerate(ps):
        # every other request asks; one stops on a token inside an accepted run
        stop = [ref[i][9]] if i == 2 else []
        w.submit(f"r{i}", p, spec_trace=i % 2 == 0, ignore_eos=True, max_new_tokens=NEW,
                 stop_token_ids=stop)
    h.run()
    accepted = 0
    for i, p in enumerate(ps):
        out = h.outputs[f"r{i}"]
        expect = ref[i][: ref[i].index(ref[i][9]) + 1] if i == 2 else ref[i]
        assert out == expect
        if i % 2:
            assert f"r{i}" not in w.steps, "a request that did not ask gets no trace"
            continue
        accepted += check_trace(w.steps[f"r{i}"], p, out)
    assert accepted > 0, "the oracle's drafts must be accepted somewhere"
    assert any(s.tree is None for s in w.steps["r0"]), "the prefill's token is a plain step"
    h.sched.check_no_leak()


def test_no_trace_is_built_or_sent_unless_asked(tiny):  # noqa: F811
    ps = prompts(3, seed=22)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=NEW)
    h = spec_harness(tiny, lambda c, r: OracleMixDrafter(c, r, {tuple(p): o for p, o in
                                                             zip(ps, ref)}, 4))
    w = Wire(h)
    for i, p in enumerate(ps):
        w.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=NEW)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(3)] == ref
    assert w.results and all(r.spec_trace is None for r in w.results)
    assert all(m.spec_trace is None for m in w.token_outs)
    assert h.sched.info()["spec_decode_num_accepted_tokens"] > 0


class ProbChainDrafter(ChainOracleDrafter):
    """The oracle's chains with a drafter distribution: q at node i puts 0.75 on its child."""

    def propose(self, reqs):
        out = []
        for tree in super().propose(reqs):
            n, vocab = tree.num_nodes, self.runner.vocab_size
            q = torch.full((n, vocab), 0.25 / (vocab - 1))
            for i in range(1, n):
                q[i - 1, tree.token_list[i]] = 0.75
            out.append(DraftTree(tree.tokens, tree.parents, q))
        return out


def test_trace_reports_the_drafters_probability_of_each_node(tiny):  # noqa: F811
    ps = prompts(2, seed=23)
    ref = reference(tiny, ps, ignore_eos=True, max_new_tokens=NEW)
    truth = {tuple(p): r for p, r in zip(ps, ref)}
    h = spec_harness(tiny, lambda c, r: ProbChainDrafter(c, r, truth), num_draft_tokens=4)
    w = Wire(h)
    for i, p in enumerate(ps):
        w.submit(f"r{i}", p, spec_trace=True, ignore_eos=True, max_new_tokens=NEW)
    h.run()
    trees = [s.tree for i in range(2) for s in w.steps[f"r{i}"] if s.tree is not None]
    assert trees
    for t in trees:
        assert t.draft_probs == pytest.approx([1.0] + [0.75] * (len(t.tokens) - 1))
    h.sched.check_no_leak()


def test_disable_speculation_decodes_plainly_to_the_same_output(tiny):  # noqa: F811
    ps = prompts(2, seed=24)
    h, ref, drafters = chain_oracle_harness(tiny, ps + ps, NEW)
    w = Wire(h)
    for i, p in enumerate(ps + ps):
        w.submit(f"r{i}", p, spec_trace=True, disable_speculation=i >= 2, ignore_eos=True,
                 max_new_tokens=NEW)
    h.run()
    assert [h.outputs[f"r{i}"] for i in range(4)] == ref
    assert ref[:2] == ref[2:]
    budgets = drafters[0].budgets
    for i in (2, 3):
        assert all(b == 1 for b in budgets.get(f"r{i}", [])), "an opted-out request drafts"
        assert all(s.tree is None for s in w.steps[f"r{i}"])
        assert h.meta[f"r{i}"].get("spec_num_proposed_drafts", 0) == 0
    assert any(s.tree is not None for s in w.steps["r0"]), "the others still draft"
    h.sched.check_no_leak()


def test_disable_speculation_alone_runs_plain_steps(tiny):  # noqa: F811
    ps = prompts(1, seed=25)
    h, ref, drafters = chain_oracle_harness(tiny, ps, NEW)
    w = Wire(h)
    w.submit("r0", ps[0], disable_speculation=True, ignore_eos=True, max_new_tokens=NEW)
    h.run()
    assert h.outputs["r0"] == ref[0]
    assert not drafters[0].budgets, "the drafter was never asked"
    assert all(not r.spec_info for r in w.results), "every step was a plain one"
    assert h.sched.info()["running_requests"] == []


def test_server_info_lists_running_requests_with_their_plan(tiny):  # noqa: F811
    ps = prompts(2, seed=26)
    h, ref, _ = chain_oracle_harness(tiny, ps, NEW)
    Wire(h).submit("a", ps[0], ignore_eos=True, max_new_tokens=NEW)
    h.sched.handle(GenerateReq(rid="b", input_ids=ps[1], disable_speculation=True,
                               sampling_params=SamplingParams(temperature=0.0,
                                                              max_new_tokens=NEW,
                                                              ignore_eos=True)))
    for _ in range(4):
        h.sched.step()
    rows = {r["rid"]: r for r in h.sched.info()["running_requests"]}
    assert set(rows) == {"a", "b"}
    assert rows["a"]["planned_nodes"] > 1 and rows["a"]["spec_num_proposed_drafts"] > 0
    assert rows["b"]["planned_nodes"] == 1 and rows["b"]["disable_speculation"]
    assert rows["a"]["output_tokens"] > 0 and rows["a"]["prompt_tokens"] == len(ps[0])
    h.run()


@pytest.mark.parametrize("text", [
    "Hello, world! The quick brown fox.",
    "naïve café — 東京タワー 🚀🚀 done",
    "  spaces\n\nand\ttabs  ",
])
def test_token_pieces_concatenate_to_the_decoded_text(text):
    tok = load_tokenizer(resolve_model_path(None))
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    pieces = TokenPieces(tok)
    got = pieces.extend(ids[:3]) + pieces.extend(ids[3:])  # (split like two steps)
    assert len(got) == len(ids)
    assert "".join(got) == tok.decode(ids, skip_special_tokens=True) == text
    assert got[-1] == "", "a special token shows no text"
