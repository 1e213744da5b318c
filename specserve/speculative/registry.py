"""The registry of speculative algorithms: name -> `Drafter` subclass.

A drafter module registers its class with `@register_algorithm("NAME")` when it is imported;
importing the `speculative` package imports every built-in drafter (and the modules named in
`SPECSERVE_PLUGINS`), so any `speculative.*` import fills the registry first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

ALGORITHMS: dict[str, type] = {}


def register_algorithm(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        assert name not in ALGORITHMS, f"speculative algorithm {name} registered twice"
        assert name == name.upper(), f"algorithm names are upper case: {name}"
        ALGORITHMS[name] = cls
        cls.algorithm = name
        return cls

    return deco


def check_algorithm(name: str) -> str:
    key = name.upper()
    if key not in ALGORITHMS:
        raise ValueError(
            f"unknown --speculative-algorithm {name!r}; available: {sorted(ALGORITHMS)}"
        )
    return key


def create_drafter(cfg: Any, runner) -> Any:
    """The drafter of `cfg.algorithm` (a `SpecConfig`) over this runner."""
    return ALGORITHMS[check_algorithm(cfg.algorithm)](cfg, runner)
