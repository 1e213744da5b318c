"""Requests decoded by the real NGRAM or SUFFIX drafter and the speculation controller without
a model: greedy acceptance follows from the known outputs, and each step's target forward is
timed on a "true" verify-cost curve (with noise), as the runner reports it. The controller may
start from a distorted prior, as a start-up measurement taken beside busy neighbours is."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from benchmark.replay_ngram import true_path
from specserve.launch.server_args import ServerArgs
from specserve.runtime.verify_cost import VerifyCost
from specserve.speculative.base import RunnerReq, create_drafter
from specserve.speculative.controller import MAX_PROBE_INTERVAL, SpecController
from specserve.speculative.registry import ALGORITHMS
from specserve.speculative.verify import verify_greedy

# T(n)/T(1) of the CPU engine measured alone (Zen 4, 7.5 ms a one-row forward)
TRUE = VerifyCost((1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64),
                  (1.0, 1.03, 1.14, 1.24, 1.32, 1.40, 1.65, 2.45, 3.25, 4.8, 6.3, 9.4, 12.4),
                  "alone", 0.0075)


def distorted(curve: VerifyCost, factor: float = 1.6, beyond: int = 2) -> VerifyCost:
    """`curve` with every ratio past `beyond` rows multiplied by `factor`, and T(1) too (the
    start-up timing beside loading neighbours)."""
    return VerifyCost(curve.rows, tuple(r * factor if n > beyond else r
                                        for n, r in zip(curve.rows, curve.ratios)),
                      f"x{factor} beyond {beyond} rows", curve.t1_s * 1.4)


def repeated_output(seed: int, n: int = 300, edit_every: float = 12.0
                    ) -> tuple[list[int], list[int]]:
    """A prompt quoting a passage and an answer that repeats it with an edit every
    ~`edit_every` tokens (a rewrite)."""
    rng = random.Random(seed)
    passage = [rng.randrange(100, 5000) for _ in range(n)]
    out = [t if rng.random() > 1 / edit_every else rng.randrange(100, 5000) for t in passage]
    return [1, 2, 3, *passage, 4], out


@dataclass
class Replay:
    """Per step: the rows verified, the tokens gained (over the batch), the batch size, and
    whether the controller planned it with drafting on for the traffic."""

    rows: list[int] = field(default_factory=list)
    gained: list[int] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    on: list[bool] = field(default_factory=list)
    controller: SpecController | None = None

    def first_on(self) -> int | None:
        """The step (1-based) from which drafting stays on to the end; None: never."""
        k = len(self.on)
        while k > 0 and self.on[k - 1]:
            k -= 1
        return k + 1 if k < len(self.on) else None

    def accept_length(self, start: int = 1) -> float:
        """Tokens per request per verify step from step `start` (1-based) on."""
        return sum(self.gained[start - 1:]) / sum(self.batch[start - 1:])


@dataclass
class _Stream:
    rid: str
    history: list[int]
    out: list[int]
    pos: int = 1
    state: object = None


def replay(algorithm: str, prior: VerifyCost, learn_cost: bool = True, batch: int = 1,
           seed: int = 0, edit_every: float = 12.0, noise: float = 0.05,
           outliers: float = 0.05, switched_off: bool = False, **options) -> Replay:
    """`batch` repeated-output requests decoded together (see the module docstring): every
    forward takes TRUE's time times lognormal noise, and one in 1 / `outliers` takes 3x (a
    neighbour's burst). `switched_off`: the controller arrives as after traffic that drafting
    did not pay for (a low server-wide estimate, server-wide probes backed off to the most);
    else as a fresh server."""
    spec = ServerArgs(speculative_algorithm=algorithm, **options).resolve().spec_config()
    drafter = create_drafter(spec, runner=None)
    ctl = SpecController(ALGORITHMS[algorithm].tree_sizes(spec), prior, learn_cost=learn_cost)
    drafter.verify_cost = ctl.curve  # as the worker has it from start-up
    if switched_off:
        ctl.prior, ctl.global_interval = [1.0, 20.0], MAX_PROBE_INTERVAL
    rng = random.Random(seed)
    streams = []
    for i in range(batch):
        prompt, out = repeated_output(seed * 100 + i, edit_every=edit_every)
        s = _Stream(f"r{i}", prompt + out[:1], out, state=ctl.new_request())
        drafter.observe(s.rid, prompt, len(prompt))
        drafter.observe(s.rid, s.history, 1)
        streams.append(s)
    res = Replay(controller=ctl)
    while streams:
        _step(ctl, drafter, streams, rng, noise, outliers, res)
        streams = [s for s in streams if s.pos < len(s.out)]
    return res


def _step(ctl: SpecController, drafter, streams: list[_Stream], rng: random.Random,
          noise: float, outliers: float, res: Replay) -> None:
    plan = ctl.plan([s.state for s in streams])
    sent = ctl.curve_update()
    if sent is not None:  # as RunBatch.verify_cost reaches the runner's drafter
        drafter.verify_cost = sent
    reqs = []
    for i, s in enumerate(streams):
        r = RunnerReq.drafting(s.rid, s.history, plan.sizes[i], confident_only=plan.confident[i])
        r.explore = bool(plan.explore and plan.explore[i])
        reqs.append(r)
    trees = drafter.propose(reqs)
    infos, rows, gained = [], 0, 0
    for s, tree in zip(streams, trees):
        accepted = _accepted(tree, s.out[s.pos:])
        infos.append({"drafted": tree.num_nodes - 1, "accepted": accepted, "draft_s": 0.0})
        rows += tree.num_nodes
        g = min(accepted + 1, len(s.out) - s.pos)
        s.history.extend(s.out[s.pos:s.pos + g])
        s.pos += g
        drafter.observe(s.rid, s.history, g)
        gained += g
    t = TRUE.t1_s * TRUE(rows) * math.exp(rng.gauss(0.0, noise))
    t *= 3.0 if rng.random() < outliers else 1.0
    ctl.observe([s.state for s in streams], infos, t + 0.0003 * len(streams), (rows, t))
    res.rows.append(rows)
    res.gained.append(gained)
    res.batch.append(len(streams))
    res.on.append(not plan.traffic_off)


def _accepted(tree, truth: list[int]) -> int:
    """Drafts greedy verification accepts when the target's argmax continues `truth`."""
    return len(verify_greedy(tree, true_path(tree, truth)[0]).accepted_tokens)
