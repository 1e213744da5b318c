"""The near-tie excuse is narrow: only the top two at the first difference, within the gap,
counted, and switchable off (tests/helpers/near_tie.py)."""

from __future__ import annotations

import pytest

from specserve.runtime.model_runner.local_generator import LocalGenerator
from specserve.runtime.sampling.sampling_params import SamplingParams
from tests.helpers import near_tie
from tests.helpers.near_tie import NearTieJudge, decision_scores
from tests.unit.test_scheduler import tiny  # noqa: F401

PROMPT = [5, 17, 99, 240, 31, 8]


def outputs(runner, params: SamplingParams) -> list[int]:
    return LocalGenerator(runner).generate([PROMPT], params)[0].output_ids


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_new_tokens=8, repetition_penalty=1.3, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_new_tokens=8, ignore_eos=True),
])
def test_only_the_top_two_within_the_gap_are_excused_and_counted(tiny, params,  # noqa: F811
                                                                 monkeypatch):
    model_dir, runner = tiny
    monkeypatch.setattr(near_tie, "ALLOW_NEAR_TIES", True)  # the rule itself (torch engine)
    judge = NearTieJudge(str(model_dir))
    a = outputs(runner, params)
    assert judge.check(PROMPT, a, list(a), params) == (True, "identical")
    # the request's own scores at token 3 reproduce its choice there
    scores = decision_scores(str(model_dir), PROMPT, a[:3], params)
    ranked = scores.argsort(descending=True).tolist()
    assert ranked[0] == a[3]
    second, third = ranked[1], ranked[2]
    ok, why = judge.check(PROMPT, a, a[:3] + [second], params)
    assert not ok and "gap" in why  # a real gap: not a tie
    monkeypatch.setattr(near_tie, "TIE_EPS", 1e9)  # now every gap is "small"
    assert not judge.check(PROMPT, a, a[:3] + [third], params)[0], "third is never excused"
    assert judge.check(PROMPT, a, a[:3] + [second], params)[0]
    assert not judge.check(PROMPT, a, a[:3], params)[0], "a shorter output is not a tie"
    assert len(judge.excused) == 1 and judge.checked == 5
    with pytest.warns(UserWarning, match="excused 1 of 5"):
        judge.report()
    monkeypatch.setattr(near_tie, "ALLOW_NEAR_TIES", False)
    assert not judge.check(PROMPT, a, a[:3] + [second], params)[0], "the switch turns it off"
