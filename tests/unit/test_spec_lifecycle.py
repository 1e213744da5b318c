"""A speculative request's life around the verify step, in-process on tiny models: a stop string
or EOS landing inside an accepted draft (tokens, streamed text, finish reason), aborts while
speculative steps are in flight (KV and drafter state back to empty), and EAGLE drafting after a
radix-cache hit (the head's KV of the cached prefix is reused, so the drafts are the same)."""

from __future__ import annotations

import pytest
import torch

from specserve.runtime.messages import AbortReq, FlushCacheReq, TokenOut
from specserve.runtime.model_loader.tokenizer import load_tokenizer
from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.runtime.tokenizer.detokenizer import IncrementalText
from specserve.speculative.base import SpecConfig, create_drafter
from specserve.speculative.worker import SpeculativeWorker
from tests.unit.test_scheduler import Harness, prompts, reference, tiny  # noqa: F401
from tests.unit.test_spec_penalties_seeds import copy_heavy, heads  # noqa: F401
from tests.unit.test_spec_sampling_distribution import tiny_vocab  # noqa: F401
from tests.unit.test_spec_scheduler import chain_oracle_harness

NEW = 30


class Streams:
    """The tokenizer side of each request, fed with the scheduler's TokenOut messages as the
    TokenizerManager does: streamed chunks (`visible`) then the final text (`finalize`)."""

    def __init__(self, h: Harness, tokenizer, stops: dict[str, list[str]]) -> None:
        self.detok = {rid: IncrementalText(tokenizer, s) for rid, s in stops.items()}
        self.chunks: dict[str, list[str]] = {rid: [] for rid in stops}
        self.final: dict[str, str] = {}
        self.step_sizes: dict[str, list[int]] = {rid: [] for rid in stops}
        inner = h.emit

        def emit(msg):
            inner(msg)
            if not isinstance(msg, TokenOut):
                return
            for rid, ids, fin in zip(msg.rids, msg.new_token_ids, msg.finish_reasons):
                self.detok[rid].extend(ids)
                self.step_sizes[rid].append(len(ids))
                if fin is None:
                    self.chunks[rid].append(self.detok[rid].visible())
                else:
                    self.final[rid] = self.detok[rid].finalize(fin)

        h.sched.emit = emit


def boundary_stop(tokenizer, ids: list[int], draft_positions) -> tuple[str, int] | None:
    """A stop string spanning the boundary before token k (2 characters before, 1 of token k),
    for the first k in `draft_positions` where that works: (stop, k). The tiny model's text is
    noise (partial bytes, control characters); the string itself must be clean and new."""

    def text(n: int, skip: bool = True) -> str:
        return tokenizer.decode(ids[:n], skip_special_tokens=skip)

    full = text(len(ids))
    for k in draft_positions:
        a, b = text(k), text(k + 1)
        if len(a) < 2 or len(b) <= len(a) or not b.startswith(a) or text(k + 1, False) != b:
            continue
        s = b[len(a) - 2 : len(a) + 1]
        if "\ufffd" not in s and s.strip() and full.find(s) == len(a) - 2:
            return s, k
    return None


def test_stop_string_inside_an_accepted_draft_cuts_tokens_stream_and_text(tiny):  # noqa: F811
    ps = prompts(24, seed=31)
    h, ref, _ = chain_oracle_harness(tiny, ps, NEW)  # every draft right: 4 tokens per step
    tok = load_tokenizer(tiny[0])
    cases = {}
    for i, r in enumerate(ref):
        # output token k comes from the step covering 1 + 4j .. 4 + 4j: k % 4 != 0 is a draft
        found = boundary_stop(tok, r, [k for k in range(3, 25) if k % 4 != 0])
        if found:
            cases[f"r{i}"] = (ps[i], r, *found)
    assert len(cases) >= 4, "too few prompts with a usable stop string"
    streams = Streams(h, tok, {rid: [c[2]] for rid, c in cases.items()})
    for rid, (p, _, stop, _) in cases.items():
        h.submit(rid, p, ignore_eos=True, max_new_tokens=NEW, stop=[stop])
    h.run()
    for rid, (_, r, stop, k) in cases.items():
        assert h.outputs[rid] == r[: k + 1], f"{rid}: cut at the token completing {stop!r}"
        assert h.finish[rid] == {"type": "stop", "matched": stop}
        text = tok.decode(r[: k + 1])
        want = text[: text.find(stop)]
        assert streams.final[rid] == want
        for chunk in streams.chunks[rid]:
            assert want.startswith(chunk) and stop not in chunk
        # every step accepted its whole 3-token draft, the last one included: token k (not a
        # bonus position) was an accepted draft, and the step's tokens after it were dropped
        hist = h.meta[rid]["spec_accept_histogram"]
        assert sum(hist[:3]) == 0 and hist[3] >= 1, hist
        assert max(streams.step_sizes[rid]) > 1
    h.sched.check_no_leak()


def test_eos_inside_an_accepted_draft_stops_there(tiny):  # noqa: F811
    ps = prompts(8, seed=32)
    h, ref, _ = chain_oracle_harness(tiny, ps, NEW)
    eos = ref[0][6]  # token 6: the third draft of the second step
    h.sched.stop.eos = {eos}
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, max_new_tokens=NEW)
    h.run()
    stopped = 0
    for i, r in enumerate(ref):
        if eos in r:
            stopped += 1
            assert h.outputs[f"r{i}"] == r[: r.index(eos) + 1]
            assert h.finish[f"r{i}"] == {"type": "stop", "matched": eos}
        else:
            assert h.outputs[f"r{i}"] == r and h.finish[f"r{i}"]["type"] == "length"
    assert stopped >= 1 and h.meta["r0"]["spec_accept_length"] > 1
    h.sched.check_no_leak()


@pytest.mark.parametrize("algo", ["NGRAM", "SUFFIX", "LOOKAHEAD", "EAGLE3"])
def test_abort_mid_speculation_returns_kv_and_drafter_state(tiny_vocab, heads, algo):  # noqa: F811
    runner = tiny_vocab[1]
    ps = copy_heavy(6, seed=3)
    n = 6
    kw = {} if algo in ("NGRAM", "SUFFIX", "LOOKAHEAD") else {"draft_model_path": str(heads[algo]),
                                                 "num_steps": 2, "eagle_topk": 3}
    spec = SpecConfig(algo, n, disable_adaptive=True, **kw)
    drafter = create_drafter(spec, runner)
    h = Harness(tiny_vocab, num_draft_tokens=n, max_running_requests=4)
    h.worker = RunnerWorker(runner, SpeculativeWorker(spec, drafter, runner))
    h.sched.run_batch = h.worker.run
    ref = reference(tiny_vocab, ps, ignore_eos=True, max_new_tokens=NEW)
    for i, p in enumerate(ps):
        h.submit(f"r{i}", p, ignore_eos=True, max_new_tokens=NEW)
    while h.sched.info()["spec_decode_num_draft_tokens"] == 0 or \
            h.sched.info()["spec_verify_steps"] < 6:
        assert h.sched.step()
    waiting = [r.rid for r in h.sched.waiting]
    assert waiting, "two requests were meant to wait (max_running_requests=4)"
    aborted = [h.sched.running[0].rid, h.sched.running[2].rid, waiting[0]]
    for rid in aborted:
        h.sched.handle(AbortReq(rid=rid))
    h.run()
    for i in range(len(ps)):
        rid = f"r{i}"
        if rid in aborted:
            assert h.finish[rid] == {"type": "abort"}
        else:  # the others are unaffected
            assert h.outputs[rid] == ref[i] and h.finish[rid]["type"] == "length"
    assert h.sched.totals["aborted"] == 3
    h.sched.check_no_leak()
    h.sched.handle(FlushCacheReq(req_id="f"))
    assert h.sched.allocator.num_free == h.sched.allocator.capacity
    assert not h.worker.states
    if algo == "NGRAM":
        assert not drafter.reqs
    elif algo == "SUFFIX":  # own trees dropped (the flush also emptied the global tree)
        assert not drafter.reqs and not drafter.outputs
    elif algo == "LOOKAHEAD":  # windows dropped
        assert not drafter.reqs
    else:
        assert not drafter.reqs


def record_trees(drafter) -> list[tuple[int, list[int], list[int]]]:
    """Wrap `propose`: every tree drafted, as (history length, tokens, parents)."""
    seen = []
    propose = drafter.propose

    def spy(reqs):
        trees = propose(reqs)
        for r, t in zip(reqs, trees):
            seen.append((len(r.tokens), t.tokens.tolist(), t.parents.tolist()))
        return trees

    drafter.propose = spy
    return seen


@pytest.mark.parametrize("algo", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("lose_head_kv", [False, True])
def test_eagle_drafts_after_a_radix_hit_equal_drafts_without_one(tiny_vocab, heads, algo,  # noqa: F811
                                                                 lose_head_kv):
    """Same prompt twice: the second prefill reuses the cached prefix's target AND head KV, so
    every tree and the acceptance must be the same. Negative control: wipe the head's KV after
    the first request (a head that lost its KV on a hit) and the drafts must change."""
    runner = tiny_vocab[1]
    prompt = copy_heavy(1, seed=3)[0] * 2
    spec = SpecConfig(algo, 6, draft_model_path=str(heads[algo]), num_steps=2, eagle_topk=3,
                      disable_adaptive=True)
    drafter = create_drafter(spec, runner)
    trees = record_trees(drafter)
    h = Harness(tiny_vocab, num_draft_tokens=6)
    h.worker = RunnerWorker(runner, SpeculativeWorker(spec, drafter, runner))
    h.sched.run_batch = h.worker.run
    h.submit("first", prompt, ignore_eos=True, max_new_tokens=NEW)
    h.run()
    first = list(trees)
    trees.clear()
    if lose_head_kv:
        pool = drafter.head.kv_pool
        pool.k[0].normal_(generator=torch.Generator().manual_seed(0))
        pool.v[0].normal_(generator=torch.Generator().manual_seed(1))
    h.submit("second", prompt, ignore_eos=True, max_new_tokens=NEW)
    h.run()
    assert h.meta["second"]["cached_tokens"] >= len(prompt) - 1, "the prompt was a radix hit"
    assert h.outputs["second"] == h.outputs["first"]  # lossless either way
    same = trees == first and h.meta["second"]["spec_accept_histogram"] == \
        h.meta["first"]["spec_accept_histogram"]
    if lose_head_kv:
        assert not same, "wiping the head's KV went unnoticed: the check is blind"
    else:
        assert same, "a radix hit changed the drafts: the head's cached KV was not reused"
        assert sum(h.meta["first"]["spec_accept_histogram"][1:]) > 0, "nothing accepted"
    h.sched.check_no_leak()
