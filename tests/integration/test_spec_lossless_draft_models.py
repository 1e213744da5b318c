"""Speculation equals plain decoding on the default model, greedy and seeded, for the algorithms
that run a draft network of their own: EAGLE3's head, STANDALONE's draft model, EARLY_EXIT's
adapter (tests/helpers/lossless.py; the other algorithms are in test_spec_lossless.py)."""

from __future__ import annotations

import pytest

from tests.helpers.lossless import GROUPS, check_spec_equals_plain


@pytest.mark.slow
@pytest.mark.parametrize("algo", GROUPS[1])
def test_default_model_spec_equals_plain_on_the_strongest_prompts(algo, plain_reference):
    check_spec_equals_plain(algo, plain_reference)


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("algo", GROUPS[1])
def test_default_model_spec_equals_plain_on_every_prompt(algo, plain_reference):
    check_spec_equals_plain(algo, plain_reference, full=True)
