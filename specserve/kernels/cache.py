"""Where specserve keeps what it builds once: converted models, the compiled CPU extension."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The root of specserve's cache: `$SPECSERVE_CACHE_DIR` or `~/.cache/specserve`."""
    configured = os.environ.get("SPECSERVE_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "specserve"
