"""The CPU engine's C++ extension: quantized batch-invariant matmuls, query-invariant attention
and the fused decoder stack (sources in `specserve/kernels/cpu/csrc/`), and the NGRAM / SUFFIX
drafters' n-gram trie (`ngram_trie.cpp`, used through
`specserve.speculative.ngram_cache.NgramCache`).

It is compiled by this project on first use (`torch.utils.cpp_extension.load`, ninja + the
system g++) into `<cache>/cpu_ext/`, keyed by a hash of the sources, and reused afterwards;
`make serve` / `make test` build it during set-up (`python -m specserve.kernels.cpu.build`). The
kernels for AVX-512 (+VNNI), AVX2+FMA and plain C++ are all compiled in; the widest one the CPU has
is chosen at run time (`SPECSERVE_CPU_ISA=amx|avx512|avx2|generic` forces one the CPU has).

`load()` returns the module, or raises `CpuExtensionUnavailable` with the reason; `available()`
answers without raising. A missing extension is an error (`python -m specserve.kernels.cpu.build`
exits non-zero, the engine and the test suite refuse to start) unless SPECSERVE_ALLOW_NO_CPU_EXT=1
asks to go on without it (`fallback_allowed()`): then the torch reference engine serves, NGRAM and
SUFFIX are unavailable and the tests that need the extension skip.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

from specserve.kernels.cache import cache_dir
from specserve.kernels.errors import SpecserveError

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("engine.cpp", "isa_avx512.cpp", "isa_avx2.cpp", "isa_generic.cpp", "ngram_trie.cpp")
HEADERS = ("kernels.h", "pool.h", "shm_comm.h")
# -ffp-contract=off: a*b+c stays two roundings unless the code asks for an FMA, so the float
# steps of a kernel are the ones written (and the same for every row). Never -ffast-math.
CFLAGS = ("-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-Wno-unused-function")


# int8 digits per activation of a block-format matmul (kernels.h): 3 carry ~22 bits (logits
# within ~1e-4 of float32), 1 is llama.cpp's int8 activations
ACTIVATION_DIGITS = (1, 2, 3)
DEFAULT_ACTIVATION_DIGITS = 3


ALLOW_NO_CPU_EXT = "SPECSERVE_ALLOW_NO_CPU_EXT"
# lines of compiler output a failure report shows (the whole log stays in the build directory)
REPORT_LINES = 30


class CpuExtensionUnavailable(SpecserveError, RuntimeError):
    """The C++ extension could not be built or loaded here (the message says why;
    `output_tail` holds the end of the compiler's output when a build failed)."""

    def __init__(self, message: str, output_tail: str = "") -> None:
        super().__init__(message)
        self.output_tail = output_tail


def fallback_allowed() -> bool:
    """Whether running without the extension was asked for (SPECSERVE_ALLOW_NO_CPU_EXT=1)."""
    return os.environ.get(ALLOW_NO_CPU_EXT, "") not in ("", "0")


def failure_report(exc: CpuExtensionUnavailable) -> str:
    """What failed, the compiler's last lines, and how to proceed (for `make` and pytest)."""
    lines = [f"error: the CPU extension (specserve/kernels/cpu/csrc) is unavailable: {exc}"]
    if exc.output_tail:
        lines += [f"---- compiler output, last {REPORT_LINES} lines ----", exc.output_tail,
                  "----"]
    lines += [
        "It holds the CPU engine's kernels and the NGRAM / SUFFIX n-gram trie. Building it needs",
        "a C++17 compiler (g++) and ninja (a dependency of this package); fix the error above",
        "and run `python -m specserve.kernels.cpu.build` (or `make`) again.",
        "To go on without it instead (the torch reference engine serves, NGRAM and SUFFIX are",
        f"unavailable, tests that need it skip), set {ALLOW_NO_CPU_EXT}=1, e.g.",
        f"`make test {ALLOW_NO_CPU_EXT}=1`.",
    ]
    return "\n".join(lines)


def _read_sources() -> dict[str, bytes]:
    return {name: (CSRC / name).read_bytes() for name in SOURCES + HEADERS}


def _hash(sources: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name, data in sources.items():
        h.update(name.encode())
        h.update(data)
    h.update(" ".join(CFLAGS).encode())
    return h.hexdigest()[:16]


def _source_hash() -> str:
    return _hash(_read_sources())


def build_dir() -> Path:
    import torch


    return cache_dir() / "cpu_ext" / f"{_source_hash()}-torch{torch.__version__}"


def _import_so(path: Path):
    import importlib.util

    import torch  # noqa: F401  (the extension links against torch's libraries)

    spec = importlib.util.spec_from_file_location("specserve_cpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def _load():
    """Build once per source hash, from a snapshot of the sources taken when the hash was
    computed (so the cached library always matches its key, even if a file is edited while
    it compiles), under a file lock (so concurrent processes build it once); afterwards the
    cached library is imported directly."""
    if os.environ.get("SPECSERVE_DISABLE_CPU_EXT"):
        raise CpuExtensionUnavailable("disabled by SPECSERVE_DISABLE_CPU_EXT")
    import fcntl

    import torch


    sources = _read_sources()
    out = cache_dir() / "cpu_ext" / f"{_hash(sources)}-torch{torch.__version__}"
    done = out / "specserve_cpu.so"
    out.mkdir(parents=True, exist_ok=True)
    try:
        with open(out / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                return _build(out, sources, done)
        return _import_so(done)
    except CpuExtensionUnavailable:
        raise
    except Exception as exc:  # a corrupt cache, a missing library: say which
        raise CpuExtensionUnavailable(f"loading the CPU kernels failed: {exc}") from exc


def _build(out: Path, sources: dict[str, bytes], done: Path):
    from torch.utils import cpp_extension

    logger.info("building the CPU kernels extension into %s (first use, ~1 min)", out)
    t0 = time.perf_counter()
    src = out / "src"
    src.mkdir(exist_ok=True)
    for name, data in sources.items():
        (src / name).write_bytes(data)
    work = out / "build"
    work.mkdir(exist_ok=True)
    try:
        mod = cpp_extension.load(
            name="specserve_cpu",
            sources=[str(src / s) for s in SOURCES],
            extra_cflags=list(CFLAGS),
            build_directory=str(work),
            verbose=False,
        )
    except Exception as exc:  # compiler missing, ninja missing, a build error: say which
        raise _build_failure(out, str(exc)) from exc
    tmp = done.with_suffix(".so.tmp")
    tmp.write_bytes((work / "specserve_cpu.so").read_bytes())
    os.replace(tmp, done)  # published only when complete
    logger.info("CPU kernels built in %.0fs", time.perf_counter() - t0)
    return mod


def _build_failure(out: Path, output: str) -> CpuExtensionUnavailable:
    """The error for a failed build; torch puts the whole ninja / compiler output in its
    message: the full text goes to build.log beside the build."""
    log = out / "build.log"
    log.write_text(output)
    lines = output.strip().splitlines()
    head = lines[0].split(": [")[0] if lines else "no output"
    # compiler command lines run to kilobytes: their start says enough
    short = [ln if len(ln) <= 240 else ln[:120] + " ..." for ln in lines[-REPORT_LINES:]]
    tail = "\n".join(short) if len(lines) > 1 else ""
    return CpuExtensionUnavailable(f"building the CPU kernels failed ({head}; full log: {log})",
                                   tail)


def load():
    """The compiled extension module (built on first use); raises CpuExtensionUnavailable."""
    return _load()


def available() -> tuple[bool, str]:
    """(True, isa name) when the extension loads here, else (False, why not)."""
    try:
        return True, load().isa_name()
    except CpuExtensionUnavailable as exc:
        return False, str(exc)
