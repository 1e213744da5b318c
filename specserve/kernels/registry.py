"""A tiny op registry: one op name, one signature, several implementations.

Each implementation names its backend ("torch" for the reference, "sgl_kernel", "flashinfer",
"cpu_ext", ...), the device types it runs on (None = any device) and an `available()` probe that
is called at lookup time (so an optional dependency that fails to import just drops out).
`get(op, device)` picks, in order: an available implementation registered for that device type
(first registered first), then an available device-agnostic one (the torch reference).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specserve.kernels.errors import SpecserveError

# Modules whose import registers the built-in implementations: the torch references everywhere,
# the Triton ops where CUDA is (importing them elsewhere would fix Triton's compile-or-interpret
# choice before a test can set TRITON_INTERPRET); under TRITON_INTERPRET=1 they load on the CPU.
_BUILTIN_MODULES = ("specserve.kernels.reference",) + (
    ("specserve.kernels.triton_ops",)
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1" else ())


class KernelNotFoundError(SpecserveError, LookupError):
    """No implementation of the op (or of the requested backend) can run here."""


def _always() -> bool:
    return True


@dataclass(frozen=True, slots=True)
class OpImpl:
    backend: str
    fn: Callable[..., Any]
    available: Callable[[], bool]
    device_types: tuple[str, ...] | None  # None: runs on any device


class OpRegistry:
    """Op name -> implementations. Module functions below use the process-wide default one."""

    def __init__(self, builtin_modules: tuple[str, ...] = ()) -> None:
        self._ops: dict[str, list[OpImpl]] = {}
        self._pending = list(builtin_modules)

    def _load_builtins(self) -> None:
        while self._pending:
            importlib.import_module(self._pending.pop(0))

    def register(
        self,
        op_name: str,
        backend: str,
        fn: Callable[..., Any],
        available: Callable[[], bool] = _always,
        device_types: tuple[str, ...] | None = None,
    ) -> None:
        """Add an implementation; registering the same (op, backend) twice is a bug."""
        impls = self._ops.setdefault(op_name, [])
        if any(i.backend == backend for i in impls):
            raise ValueError(f"op {op_name!r} already has a {backend!r} implementation")
        impls.append(OpImpl(backend, fn, available, device_types))

    def get(
        self,
        op_name: str,
        device: torch.device | str = "cpu",
        backend: str | None = None,
    ) -> Callable[..., Any]:
        """Best available implementation of `op_name` for `device` (or exactly `backend`)."""
        self._load_builtins()
        impls = self._ops.get(op_name)
        if not impls:
            known = ", ".join(sorted(self._ops)) or "none"
            raise KernelNotFoundError(f"unknown op {op_name!r}; registered ops: {known}")
        dev = torch.device(device).type
        runs_here = [i for i in impls if i.device_types is None or dev in i.device_types]
        if backend is not None:
            runs_here = [i for i in runs_here if i.backend == backend]
        specific = [i for i in runs_here if i.device_types is not None]
        generic = [i for i in runs_here if i.device_types is None]
        for impl in specific + generic:
            if impl.available():
                return impl.fn
        tried = ", ".join(i.backend for i in impls)
        want = f" with backend {backend!r}" if backend else ""
        raise KernelNotFoundError(
            f"no available implementation of {op_name!r}{want} on {dev}; registered: {tried}"
        )

    def list_ops(self) -> dict[str, list[str]]:
        """Op name -> backend names, in registration order."""
        self._load_builtins()
        return {name: [i.backend for i in impls] for name, impls in sorted(self._ops.items())}


REGISTRY = OpRegistry(_BUILTIN_MODULES)


def register(
    op_name: str,
    backend: str,
    fn: Callable[..., Any],
    available: Callable[[], bool] = _always,
    device_types: tuple[str, ...] | None = None,
) -> None:
    REGISTRY.register(op_name, backend, fn, available, device_types)


def get(
    op_name: str, device: torch.device | str = "cpu", backend: str | None = None
) -> Callable[..., Any]:
    return REGISTRY.get(op_name, device, backend)


def list_ops() -> dict[str, list[str]]:
    return REGISTRY.list_ops()
