"""Every benchmark script imports (a refactor that moves a module breaks scripts no other test
runs: `benchmark.soak` and `benchmark.sweep_serving` once imported a module that had moved)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

SCRIPTS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "benchmark").glob("*.py")
                 if p.stem != "__init__")


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_script_imports(name):
    module = importlib.import_module(f"benchmark.{name}")
    assert module.__doc__, f"benchmark.{name} has no docstring saying what it measures"
