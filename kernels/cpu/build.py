"""`python -m kernels.cpu.build`: compile the CPU extension now (the Makefile's set-up step) and
print which kernels this CPU runs; exits 0 with a warning when it cannot be built, since the
torch reference engine still works."""

from __future__ import annotations

import logging
import sys

from kernels import cpu


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ok, what = cpu.available()
    if ok:
        print(f"CPU kernels ready: {what} ({cpu.build_dir()})")
    else:
        print(f"WARNING: CPU kernels unavailable, the torch reference engine will be used: {what}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
