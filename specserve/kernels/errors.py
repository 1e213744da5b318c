"""The project's root error, on the floor every package may import (kernels imports nothing of
ours, so the runtime's typed errors derive from this one)."""

from __future__ import annotations


class SpecserveError(Exception):
    """Base class of every error this project raises on purpose."""
