from __future__ import annotations

import pytest

from tests.helpers.lossless import shared_plain_reference


@pytest.fixture(scope="session")
def plain_reference(tmp_path_factory, request):
    """Plain outputs of the default model on the lossless tests' 52 prompts
    (tests/helpers/lossless.py), computed once per pytest run: xdist workers share the run's
    base temp directory (the parent of their own), a run without workers uses its own."""
    base = tmp_path_factory.getbasetemp()
    worker = hasattr(request.config, "workerinput")  # a pytest-xdist worker
    return shared_plain_reference(base.parent if worker else base)
