"""`python tests/helpers/lock_drift.py requirements.lock`: how this environment's versions differ
from the lock's (what `make test-latest` resolved), one package a line:
`name  locked -> here`. Packages only one side has are listed too."""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"([A-Za-z0-9._-]+)(\[[^\]]*\])?==(\S+)", line.split("#", 1)[0].strip())
        if m:
            pins[norm(m.group(1))] = m.group(3)
    return pins


def installed() -> dict[str, str]:
    return {norm(d.metadata["Name"]): d.version for d in md.distributions()
            if d.metadata["Name"] and norm(d.metadata["Name"]) != "specserve"}


def main(argv: list[str]) -> int:
    lock, here = locked(Path(argv[0] if argv else "requirements.lock")), installed()
    rows = [(n, lock.get(n, "-"), here.get(n, "-")) for n in sorted(lock.keys() | here.keys())
            if lock.get(n) != here.get(n)]
    print(f"versions differing from the lock ({len(rows)} of {len(here)} installed):")
    for name, was, now in rows:
        print(f"  {name:32s} {was:>14s} -> {now}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
