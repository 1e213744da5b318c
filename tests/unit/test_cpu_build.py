"""`python -m specserve.kernels.cpu.build` (the Makefile's set-up step): a failed build exits
non-zero with what failed, the compiler's last lines and how to proceed, unless
SPECSERVE_ALLOW_NO_CPU_EXT=1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.kernels import cpu
from specserve.kernels.cpu import build


def _fail(monkeypatch, exc: cpu.CpuExtensionUnavailable) -> None:
    def load():
        raise exc

    monkeypatch.setattr(cpu, "load", load)


def test_a_failed_build_exits_non_zero_with_the_compiler_error_and_the_way_on(
        monkeypatch, capsys) -> None:
    monkeypatch.delenv(cpu.ALLOW_NO_CPU_EXT, raising=False)
    _fail(monkeypatch, cpu.CpuExtensionUnavailable(
        "building the CPU kernels failed (Error building extension)",
        "engine.cpp:12:10: fatal error: torch/extension.h: No such file or directory"))
    assert build.main() == 1
    err = capsys.readouterr().err
    assert "building the CPU kernels failed" in err
    assert "fatal error: torch/extension.h" in err
    assert f"{cpu.ALLOW_NO_CPU_EXT}=1" in err and "g++" in err


def test_the_flag_turns_a_failed_build_into_a_warning(monkeypatch, capsys) -> None:
    monkeypatch.setenv(cpu.ALLOW_NO_CPU_EXT, "1")
    _fail(monkeypatch, cpu.CpuExtensionUnavailable("no compiler"))
    assert build.main() == 0
    assert "WARNING" in capsys.readouterr().err


@pytest.mark.parametrize("value, allowed", [("1", True), ("yes", True), ("0", False), ("", False)])
def test_only_a_set_flag_allows_running_without_the_extension(monkeypatch, value: str,
                                                              allowed: bool) -> None:
    monkeypatch.setenv(cpu.ALLOW_NO_CPU_EXT, value)
    assert cpu.fallback_allowed() is allowed


def test_the_failure_keeps_the_whole_log_and_reports_its_short_tail(tmp_path) -> None:
    command = "c++ -MMD " + "-isystem /a/very/long/include/path " * 40 + "-c engine.cpp"
    output = "\n".join(
        ["Error building extension 'specserve_cpu': [1/6] " + command]
        + [f"note {i}" for i in range(40)]
        + ["FAILED: engine.o", command, "engine.cpp:3:1: error: 'x' was not declared",
           "ninja: build stopped: subcommand failed."])
    exc = cpu._build_failure(tmp_path, output)
    assert (tmp_path / "build.log").read_text() == output
    assert "Error building extension 'specserve_cpu';" in str(exc)
    assert str(tmp_path / "build.log") in str(exc)
    tail = exc.output_tail.splitlines()
    assert len(tail) == cpu.REPORT_LINES and tail[-1].startswith("ninja: build stopped")
    assert "engine.cpp:3:1: error" in exc.output_tail
    assert max(len(line) for line in tail) <= 240  # command lines cut to their start


def test_the_test_run_stops_without_the_extension_unless_allowed() -> None:
    """tests/conftest.py: no skipped kernel tests or excused near-ties by accident."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != cpu.ALLOW_NO_CPU_EXT}
    env["SPECSERVE_DISABLE_CPU_EXT"] = "1"  # as if it could not be built
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
           "tests/unit/test_cpu_build.py", "-k", "only_a_set_flag"]

    def run(**extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=root, env={**env, **extra}, capture_output=True,
                              text=True, timeout=300)

    stopped = run()
    assert stopped.returncode == pytest.ExitCode.USAGE_ERROR
    said = stopped.stdout + stopped.stderr
    assert "the CPU extension (specserve/kernels/cpu/csrc) is unavailable" in said
    assert run(**{cpu.ALLOW_NO_CPU_EXT: "1"}).returncode == 0
