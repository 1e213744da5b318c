"""Grammar masks under speculation, end to end on a 12-token target: every tree node is masked
with the grammar state its own path reaches, forbidden drafts are dropped, forced tokens are
drafted. Unseeded and seeded sampled tokens follow the *masked* target distribution at every
position (chi-square, as test_spec_sampling_distribution.py), drafts get accepted, and the
negative control — every node masked with the request's own state, as if the tree were one
step — is rejected by the same statistic.

The grammar is a toy token automaton (`ToyGrammar`): after token a, the tokens it allows are a
fixed set depending on a, and after some tokens exactly one token is allowed (forced), so the
masks differ from node to node along a path and forced chains appear. It implements the
runtime's `Matcher` interface (specserve/runtime/constrained/base.py), which is all the worker uses.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from specserve.runtime.constrained.base import GrammarBackend, Matcher
from specserve.runtime.messages import GenerateReq, GrammarPayload
from specserve.runtime.model_runner.runner_process import RunnerWorker
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.runtime.verify_cost import VerifyCost
from specserve.speculative.base import SpecConfig
from specserve.speculative.worker import SpeculativeWorker
from tests.unit.test_scheduler import Harness
from tests.unit.test_spec_sampling_distribution import (  # noqa: F401
    PARAMS,
    PROMPT,
    VOCAB,
    IIDDrafter,
    SkewedTreeDrafter,
    pair_fits,
    pair_joints,
    tiny_vocab,
)

TOKENS = 4
SAMPLES = 3000


def allowed(state: int | None) -> list[int]:
    """Tokens the toy grammar allows after `state` (None: the start of the output)."""
    if state is None:
        return [2, 4, 5, 7, 8, 10]
    if state % 4 == 1:
        return [(state * 5 + 2) % VOCAB]  # forced
    return [t for t in range(1, VOCAB) if (state * 3 + t) % 4 != 0]


class ToyBackend(GrammarBackend):
    name = "toy"

    def compile(self, spec):
        raise NotImplementedError

    def dump(self, compiled):
        raise NotImplementedError

    def load(self, data):
        return data

    def matcher(self, compiled):
        return ToyMatcher(self)

    def allocate_masks(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, 1, dtype=torch.int32)


class ToyMatcher(Matcher):
    def __init__(self, backend: ToyBackend, states: list | None = None) -> None:
        self.backend = backend
        self.states: list[int | None] = states or [None]

    def fill_mask(self, masks: torch.Tensor, row: int) -> None:
        masks[row, 0] = sum(1 << t for t in allowed(self.states[-1]))

    def accept(self, token: int) -> bool:
        if token not in allowed(self.states[-1]):
            return False
        self.states.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.states[len(self.states) - num_tokens:]

    def is_terminated(self) -> bool:
        return False

    def forced_tokens(self) -> list[int]:
        out, probe = [], self.fork()
        while len(nxt := allowed(probe.states[-1])) == 1 and len(out) < 4:
            probe.accept(nxt[0])
            out.append(nxt[0])
        return out[:-1]  # (as the real one: the last token may merge with what follows)

    def fork(self) -> ToyMatcher:
        return ToyMatcher(self.backend, list(self.states))


class ToyGrammars:
    """Stands in for the runner's `RunnerGrammars`: every request gets a fresh toy matcher."""

    def __init__(self) -> None:
        self.backend = ToyBackend()
        self.live: list[Matcher] = []  # the runner reports how many matchers are alive

    def load(self, payload) -> Future:
        f: Future = Future()
        f.set_result(payload.data)
        return f

    def matcher(self, loading: Future) -> Matcher:
        return self.backend.matcher(loading.result())


@pytest.fixture(scope="module")
def joints(tiny_vocab):  # noqa: F811
    """Exact pair joints of plain constrained sampling: the logits masked by the grammar's
    state, then penalties, then temperature / top-k / top-p (the runtime's order)."""
    return pair_joints(tiny_vocab[1], tokens=TOKENS, allowed=allowed)


def run_samples(tiny_vocab, drafter_cls, seeded: bool, budget: int = 5):  # noqa: F811
    runner = tiny_vocab[1]
    torch.manual_seed(0)
    h = Harness(tiny_vocab, capacity=60000, num_draft_tokens=budget, max_running_requests=512,
                chunked_prefill_size=4096)
    cfg = SpecConfig("TEST", budget, disable_adaptive=True)
    free_rows = VerifyCost((1, 4096), (1.0, 1.0), "free rows (test)")
    h.worker = RunnerWorker(runner, SpeculativeWorker(cfg, drafter_cls(cfg, runner), runner,
                                                      free_rows), ToyGrammars())
    h.sched.stop.eos = set()
    for i in range(SAMPLES):
        p = SamplingParams(**{**PARAMS, "max_new_tokens": TOKENS, "regex": "toy",
                              **({"seed": i} if seeded else {})})
        h.sched.handle(GenerateReq(rid=f"s{i}", input_ids=PROMPT, sampling_params=p,
                                   grammar=GrammarPayload(key="toy", kind="regex", data=b"")))
    h.run()
    h.sched.check_no_leak()
    return [h.outputs[f"s{i}"] for i in range(SAMPLES)], h.sched.info(), h.finish


ARMS = {"one_hot": (SkewedTreeDrafter, False), "iid": (IIDDrafter, False),
        "seeded": (SkewedTreeDrafter, True)}


@pytest.mark.parametrize("arm", list(ARMS))
def test_constrained_speculative_sampling_matches_the_masked_target(tiny_vocab, joints,  # noqa: F811
                                                                    arm):
    drafter_cls, seeded = ARMS[arm]
    outs, info, finish = run_samples(tiny_vocab, drafter_cls, seeded)
    assert all(f["type"] == "length" for f in finish.values())
    for row in outs:  # every output follows the grammar
        state = None
        for t in row:
            assert t in allowed(state), row
            state = t
    # drafts were accepted, deeper ones too (random drafters: most of a tree is pruned by the
    # grammar or rejected, ~0.15 accepted drafts per sample here)
    per_pos = info["spec_decode_num_accepted_tokens_per_pos"]
    assert info["spec_decode_num_accepted_tokens"] > SAMPLES // 10 and per_pos[1] > 0, info
    for k, fit in enumerate(pair_fits(torch.tensor(outs), joints)):
        assert fit.passed, f"tokens {k + 1},{k + 2}: {fit}"


def test_negative_control_masks_of_the_requests_state_are_rejected(tiny_vocab, joints,  # noqa: F811
                                                                   monkeypatch):
    """BUG on purpose: every node of a tree masked with the root's state (the request's), as a
    verifier that masks a tree like one step would."""
    import specserve.speculative.worker as worker_mod
    from specserve.runtime.constrained.tree_masks import constrain_tree

    def root_state_masks(matcher, tokens, parents):
        kept, masks, ended = constrain_tree(matcher, tokens, parents)
        return kept, masks[:1].expand_as(masks).clone(), ended

    monkeypatch.setattr(worker_mod, "constrain_tree", root_state_masks)
    outs, _, finish = run_samples(tiny_vocab, SkewedTreeDrafter, False)
    broken = sum(f["type"] != "length" for f in finish.values())  # a token its grammar refused
    if broken:
        return
    fits = pair_fits(torch.tensor(outs), joints)
    assert not all(f.passed for f in fits), "the injected bug went unnoticed: " + "; ".join(
        map(str, fits))
