"""The CPU engine's C++ extension: quantized batch-invariant matmuls, query-invariant attention
and the fused decoder stack (sources in `kernels/cpu/csrc/`).

It is compiled by this project on first use (`torch.utils.cpp_extension.load`, ninja + the
system g++) into `<cache>/cpu_ext/`, keyed by a hash of the sources, and reused afterwards;
`make serve` / `make test` build it during set-up (`python -m kernels.cpu.build`). The kernels
for AVX-512 (+VNNI), AVX2+FMA and plain C++ are all compiled in; the widest one the CPU has is
chosen at run time (`SPECSERVE_CPU_ISA=avx2|generic` forces a narrower one).

`load()` returns the module, or raises `CpuExtensionUnavailable` with the reason; `available()`
answers without raising (callers then fall back to the torch reference engine and say so).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

from runtime.errors import SpecserveError

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("engine.cpp", "isa_avx512.cpp", "isa_avx2.cpp", "isa_generic.cpp")
HEADERS = ("kernels.h", "pool.h")
# -ffp-contract=off: a*b+c stays two roundings unless the code asks for an FMA, so the float
# steps of a kernel are the ones written (and the same for every row). Never -ffast-math.
CFLAGS = ("-O3", "-std=c++17", "-ffp-contract=off", "-fno-fast-math", "-Wno-unused-function")


# int8 digits per activation of a block-format matmul (kernels.h): 3 carry ~22 bits (logits
# within ~1e-4 of float32), 1 is llama.cpp's int8 activations
ACTIVATION_DIGITS = (1, 2, 3)
DEFAULT_ACTIVATION_DIGITS = 3


class CpuExtensionUnavailable(SpecserveError, RuntimeError):
    """The C++ extension could not be built or loaded here (the message says why)."""


def _source_hash() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(CFLAGS).encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    import torch

    from runtime.model_loader.default_model import cache_dir

    return cache_dir() / "cpu_ext" / f"{_source_hash()}-torch{torch.__version__}"


@functools.cache
def _load():
    if os.environ.get("SPECSERVE_DISABLE_CPU_EXT"):
        raise CpuExtensionUnavailable("disabled by SPECSERVE_DISABLE_CPU_EXT")
    from torch.utils import cpp_extension

    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    fresh = not any(out.glob("*.so"))
    if fresh:
        logger.info("building the CPU kernels extension into %s (first use, ~1 min)", out)
    t0 = time.perf_counter()
    try:
        mod = cpp_extension.load(
            name="specserve_cpu",
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=list(CFLAGS),
            build_directory=str(out),
            verbose=False,
        )
    except Exception as exc:  # compiler missing, ninja missing, a build error: say which
        raise CpuExtensionUnavailable(f"building the CPU kernels failed: {exc}") from exc
    if fresh:
        logger.info("CPU kernels built in %.0fs (%s)", time.perf_counter() - t0, mod.isa_name())
    return mod


def load():
    """The compiled extension module (built on first use); raises CpuExtensionUnavailable."""
    return _load()


def available() -> tuple[bool, str]:
    """(True, isa name) when the extension loads here, else (False, why not)."""
    try:
        return True, load().isa_name()
    except CpuExtensionUnavailable as exc:
        return False, str(exc)
