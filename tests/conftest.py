from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see specserve/__init__.py

import pytest  # noqa: E402
import torch  # noqa: E402

# Without CUDA, Triton kernels run under Triton's interpreter. Triton fixes compile-or-interpret
# when a kernel is decorated, so this must be set before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session):
    """The CPU extension is built (or found) before any test runs. If it cannot be, the test run
    stops with the build's report, unless SPECSERVE_ALLOW_NO_CPU_EXT=1 allowed running without
    it: only then do the tests that need it skip and the lossless checks excuse the torch
    engine's near-ties (tests/helpers/near_tie.py)."""
    from specserve.kernels import cpu

    try:
        cpu.load()
    except cpu.CpuExtensionUnavailable as exc:
        if not cpu.fallback_allowed():
            pytest.exit(cpu.failure_report(exc), returncode=pytest.ExitCode.USAGE_ERROR)


def _skip_without_the_extension():
    """A hook wrapper's body: under SPECSERVE_ALLOW_NO_CPU_EXT=1, a test that needs the missing
    extension (it raised CpuExtensionUnavailable) is skipped, saying why."""
    from specserve.kernels import cpu

    try:
        return (yield)
    except cpu.CpuExtensionUnavailable as exc:
        if not cpu.fallback_allowed():
            raise
        pytest.skip(f"needs the CPU extension ({cpu.ALLOW_NO_CPU_EXT} is set): {exc}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _skip_without_the_extension())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _skip_without_the_extension())


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
