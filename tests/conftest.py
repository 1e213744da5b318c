from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see runtime/__init__.py

import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA, Triton kernels run under Triton's interpreter. Triton fixes compile-or-interpret
# when a kernel is decorated, so this must be set before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
