"""Imports run down the layers only, and no module imports itself back through others.

Packages (rooms of `specserve.`), top to bottom: `launch` (wires the system: server args with the
speculative options, the engine, the launcher) and `benchmark` (tools on top); `speculative`
(drafters, the worker, the controller, trainers), which may use the runtime's shared types;
`runtime` (the serving machinery, which reaches speculation only through `runtime/speculation.py`'s
interfaces, handed a `Speculation` by the launcher); `corpora` (data); `kernels` (ops and the CPU
engine), which imports nothing of ours. Inside `runtime`, the model's layers and models sit below
the runner, scheduler and front end. Every import counts, function-level (lazy) ones included;
imports under `if TYPE_CHECKING:` are for type checkers only and do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NS = "specserve"
OURS = ("benchmark", NS)
_ROOMS = ("launch", "speculative", "runtime", "corpora", "kernels")
_LAUNCH, _SPEC, _RT, _CORPORA, _KERNELS = (f"{NS}.{room}" for room in _ROOMS)
_RT_FRONT = tuple(f"{_RT}.{m}" for m in ("model_runner", "scheduler", "tokenizer", "entrypoints"))
# package -> the packages (or runtime sub-packages) it must not import
FORBIDDEN = {
    _KERNELS: (_LAUNCH, "benchmark", _SPEC, _RT, _CORPORA),
    _CORPORA: (_LAUNCH, "benchmark", _SPEC),
    _RT: (_LAUNCH, "benchmark", _SPEC),
    _SPEC: (_LAUNCH, "benchmark"),
    f"{_RT}.layers": (*_RT_FRONT, f"{_RT}.engine", f"{_RT}.processes"),
    f"{_RT}.models": (*_RT_FRONT, f"{_RT}.engine", f"{_RT}.processes"),
    f"{_RT}.mem_cache": (*_RT_FRONT, f"{_RT}.layers", f"{_RT}.models"),
    f"{_RT}.sampling": (*_RT_FRONT, f"{_RT}.layers", f"{_RT}.models"),
}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Line numbers of statements under `if TYPE_CHECKING:`."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def imported_modules(path: Path) -> list[str]:
    """Every module `path` imports (absolute names; relative imports resolved), lazy ones
    included, type-checking-only ones not. `from a.b import c` counts as `a.b.c` when that is
    a module of ours, else as `a.b`."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1]) \
        if path.is_relative_to(ROOT) else ""
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(p for p in (*parts, base) if p)
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append(sub if _module_path(sub) is not None else base)
    return out


def _module_path(name: str) -> Path | None:
    p = ROOT.joinpath(*name.split("."))
    if p.with_suffix(".py").is_file():
        return p.with_suffix(".py")
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    return None


def _our_modules() -> dict[str, Path]:
    mods = {}
    for pkg in OURS:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


def _violations(prefix: str, banned: tuple[str, ...], modules: dict[str, Path]) -> list[str]:
    bad = []
    for name, path in modules.items():
        if name != prefix and not name.startswith(prefix + "."):
            continue
        for mod in imported_modules(path):
            if any(mod == b or mod.startswith(b + ".") for b in banned):
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    return bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_runs_back_up_the_layers(package):
    bad = _violations(package, FORBIDDEN[package], _our_modules())
    assert not bad, "\n".join(bad)


def import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Cycles of the graph 'module imports module' over our modules (an edge to a package
    means its `__init__`; a package's own import of its submodules is an edge too)."""
    graph = {name: sorted({m for m in imported_modules(path) if m in modules and m != name})
             for name, path in modules.items()}
    cycles, state, stack = [], {}, []

    def visit(u: str) -> None:  # depth-first search, reporting each back edge's cycle
        state[u] = 1
        stack.append(u)
        for v in graph[u]:
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for name in graph:
        if name not in state:
            visit(name)
    return cycles


def test_no_import_cycles_lazy_ones_included():
    cycles = import_cycles(_our_modules())
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_a_back_import_added_on_purpose(tmp_path, monkeypatch):
    """The negative control: a runtime module that imports speculative lazily, inside a
    function, and a pair of modules importing each other, are both caught."""
    bad = ROOT / NS / "runtime" / "_layering_probe.py"
    monkeypatch.setattr(Path, "read_text", _reading({
        bad: "def f():\n    from specserve.speculative.worker import SpeculativeWorker\n",
    }))
    mods = {**_our_modules(), f"{_RT}._layering_probe": bad}
    assert _violations(_RT, FORBIDDEN[_RT], mods) == [
        "specserve/runtime/_layering_probe.py imports specserve.speculative.worker"]
    a, b = ROOT / NS / "kernels" / "_probe_a.py", ROOT / NS / "kernels" / "_probe_b.py"
    monkeypatch.setattr(Path, "read_text", _reading({
        a: "import specserve.kernels._probe_b\n",
        b: "def g():\n    import specserve.kernels._probe_a\n"}))
    cycles = import_cycles({f"{_KERNELS}._probe_a": a, f"{_KERNELS}._probe_b": b})
    assert cycles and set(cycles[0]) == {f"{_KERNELS}._probe_a", f"{_KERNELS}._probe_b"}


def test_type_checking_imports_do_not_count(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                 "    from specserve.launch.server_args import ServerArgs\nimport os\n")
    assert imported_modules(f) == ["typing.TYPE_CHECKING", "os"] or \
        "specserve.launch.server_args" not in " ".join(imported_modules(f))


def _reading(fake: dict[Path, str]):
    real = Path.read_text

    def read_text(self, *args, **kwargs):
        return fake[self] if self in fake else real(self, *args, **kwargs)

    return read_text
