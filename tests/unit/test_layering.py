"""Imports run down the layers only: `runtime/` never imports `launch/` (the launcher sits on
top of the runtime), `speculative/` never imports `benchmark/` (the trainer and the benchmarks
share `corpora/`), and nothing below `launch/` and `benchmark/` reaches up into them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"runtime": ("launch", "benchmark"), "speculative": ("launch", "benchmark"),
             "kernels": ("launch", "benchmark", "speculative"), "corpora": ("launch", "benchmark")}


def imported_modules(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_runs_back_up_the_layers(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for mod in imported_modules(path):
            if mod.split(".")[0] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_forbidden_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import os\nfrom launch.server_args import build_parser\n")
    assert "launch.server_args" in imported_modules(f)
