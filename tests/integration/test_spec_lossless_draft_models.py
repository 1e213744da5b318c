"""Greedy speculation equals plain greedy decoding on the default model for the algorithms that
run a draft network of their own: EAGLE3's head, STANDALONE's draft model, EARLY_EXIT's adapter
(tests/helpers/lossless.py; the other algorithms are in test_spec_lossless.py)."""

from __future__ import annotations

import pytest

from tests.helpers.lossless import GROUPS, check_greedy_spec_equals_plain


@pytest.mark.slow
@pytest.mark.parametrize("algo", GROUPS[1])
def test_default_model_greedy_spec_equals_plain_batch1_and_concurrency8(algo, plain_reference):
    check_greedy_spec_equals_plain(algo, plain_reference)
