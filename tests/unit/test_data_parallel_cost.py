"""`--dp-size` start-up does not depend on the order replicas come up: with a verify-cost curve
to time, the first replica starts alone and every other replica (and every restart) starts
from the curve it timed, passed as `--speculative-verify-cost <file>`. No process starts here."""

from __future__ import annotations

import os

import pytest

from specserve.launch import data_parallel
from specserve.launch.data_parallel import DataParallel
from specserve.launch.server_args import parse_args
from specserve.runtime.verify_cost import VerifyCost, load_verify_cost

CURVE = VerifyCost((1, 4, 8), (1.0, 1.24, 1.65), "measured at start-up: alone", 0.0075)


class _Info:
    status_code = 200

    def json(self) -> dict:
        return {"verify_cost_prior": CURVE.to_dict()}


def start(argv: list[str], monkeypatch) -> tuple[DataParallel, list[list[tuple]]]:
    """`DataParallel._start` up to the router, the replicas' starts recorded: per group started
    together, each replica's name and the command it started with."""
    given = parse_args(argv)
    dp = DataParallel(given, given.resolve())
    groups: list[list[tuple]] = []
    monkeypatch.setattr(dp, "_start_and_wait",
                        lambda rs: groups.append([(r.name, list(r.argv)) for r in rs]))
    monkeypatch.setattr(dp.http, "get", lambda url, timeout=None: _Info())
    monkeypatch.setattr(data_parallel, "spawn", lambda *a, **k: None)
    monkeypatch.setattr(data_parallel, "RouterClient", lambda *a, **k: type(
        "Router", (), {"wait_workers": lambda self, *a, **k: None, "close": lambda self: None})())
    dp._start()
    return dp, groups


def shared_curve(argv: list[str]) -> str | None:
    flag = "--speculative-verify-cost"
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_the_first_replica_times_the_curve_alone_and_the_others_start_from_it(monkeypatch):
    dp, groups = start(["--dp-size", "3", "--speculative-algorithm", "NGRAM"], monkeypatch)
    assert [[name for name, _ in g] for g in groups] == [["replica0"], ["replica1", "replica2"]]
    assert shared_curve(groups[0][0][1]) is None  # the first one times it
    for _, argv in groups[1]:
        assert load_verify_cost(shared_curve(argv)).ratios == CURVE.ratios
    # a restart of any replica, the first one too, takes the shared curve
    assert all(shared_curve(r.argv) == shared_curve(groups[1][0][1]) for r in dp.replicas)
    path = shared_curve(dp.replicas[0].argv)
    dp._shutdown()
    assert not os.path.exists(path)


@pytest.mark.parametrize("extra", [[], ["--speculative-algorithm", "NGRAM",
                                        "--speculative-verify-cost", "table"]])
def test_replicas_with_no_curve_to_time_start_together(monkeypatch, extra):
    dp, groups = start(["--dp-size", "2", *extra], monkeypatch)
    assert [[name for name, _ in g] for g in groups] == [["replica0", "replica1"]]
    assert all(shared_curve(r.argv) in (None, "table") for r in dp.replicas)
    dp._shutdown()
