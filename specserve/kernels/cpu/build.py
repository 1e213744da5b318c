"""`python -m specserve.kernels.cpu.build`: compile the CPU extension now (the Makefile's set-up
step) and print which kernels this CPU runs. When it cannot be built it prints what failed, the
compiler's last lines and how to proceed, and exits 1, so `make serve` / `make test` stop there;
with SPECSERVE_ALLOW_NO_CPU_EXT=1 it warns and exits 0 (the torch reference engine will serve)."""

from __future__ import annotations

import logging
import sys

from specserve.kernels import cpu


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        isa = cpu.load().isa_name()
    except cpu.CpuExtensionUnavailable as exc:
        if not cpu.fallback_allowed():
            print(cpu.failure_report(exc), file=sys.stderr)
            return 1
        print(f"WARNING: CPU extension unavailable, going on without it ({cpu.ALLOW_NO_CPU_EXT} "
              f"is set): the torch reference engine will serve, NGRAM and SUFFIX are "
              f"unavailable: {exc}", file=sys.stderr)
        return 0
    print(f"CPU kernels ready: {isa} ({cpu.build_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
