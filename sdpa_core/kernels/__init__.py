"""The flash path's kernels: which exist in this process, why one is missing, and building them.

Two kernels compute a tile of attention and every RowStats field in one pass over the keys
(FlashAttention's online softmax with the statistics' accumulators beside it):

- "triton" (triton_flash.py): CUDA tensors; CPU tensors only under Triton's interpreter
  (TRITON_INTERPRET=1, how the tests run it without a GPU);
- the CPU kernel (cpu_flash.py, CPU_KERNEL): a C++ extension built by compile_kernels() at a
  service's warm-up, never on a request.

Both expose the same two functions (the kernel contract: available() -> (ok, why) and
flash_tile(q, k, v, *, scale, q_start, causal_shift, key_lengths, visible, bias, sink_tokens)
-> (output, stats)); attention() asks flash_kernel(device) for the one that runs tensors on a
device, and flash_kernels() says what each is and why not. The modules are imported on first
use: importing sdpa_core loads neither Triton nor the C++ toolchain.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final

import torch

from sdpa_core.stats_kernel import KernelStats
from sdpa_core.stats_kernel import compile_kernels as compile_stats_kernel

log = logging.getLogger(__name__)

TRITON_KERNEL: Final = "triton"
CPU_KERNEL: Final = "cpu_flash"
FLASH_KERNEL_NAMES: Final = (TRITON_KERNEL, CPU_KERNEL)

# The contract's flash_tile, as attention() calls it.
FlashTile = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

_MODULES: Final = {
    TRITON_KERNEL: "sdpa_core.kernels.triton_flash",
    CPU_KERNEL: "sdpa_core.kernels.cpu_flash",
}


@dataclass(frozen=True, slots=True)
class FlashKernelState:
    """One flash kernel in this process: its name, the device type whose tensors it takes
    ("cuda" or "cpu"), whether it can run now, and why not ("" when it can)."""

    name: str
    device: str
    available: bool
    reason: str

    def as_dict(self) -> dict[str, object]:
        return {"device": self.device, "available": self.available, "reason": self.reason}


class _Loaded:
    """The kernel modules, imported once (an import that failed is remembered with its
    reason: retrying it on every call would cost an import each time)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.modules: dict[str, ModuleType | None] = {}
        self.errors: dict[str, str] = {}

    def get(self, name: str) -> tuple[ModuleType | None, str]:
        module = self.modules.get(name)
        if module is not None or name in self.modules:
            return module, self.errors.get(name, "")
        with self.lock:
            if name not in self.modules:
                try:
                    self.modules[name] = importlib.import_module(_MODULES[name])
                except Exception as exc:  # triton absent, a broken install
                    self.modules[name] = None
                    self.errors[name] = f"cannot import {_MODULES[name]}: {exc}"[:300]
        return self.modules[name], self.errors.get(name, "")


_LOADED = _Loaded()
_ONLY: ContextVar[str | None] = ContextVar("sdpa_core_flash_kernel", default=None)


@contextlib.contextmanager
def use_kernel(name: str | None) -> Iterator[None]:
    """Inside this context the flash path takes only kernel `name` (None: whichever runs):
    tests and benchmarks compare the kernels in one process. A name no kernel has is a
    ValueError."""
    if name is not None and name not in FLASH_KERNEL_NAMES:
        raise ValueError(f"unknown flash kernel {name!r}: {' | '.join(FLASH_KERNEL_NAMES)}")
    token = _ONLY.set(name)
    try:
        yield
    finally:
        _ONLY.reset(token)


def triton_interpreted() -> bool:
    """Whether Triton runs through its interpreter in this process (TRITON_INTERPRET=1):
    then the Triton kernel takes CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _available(name: str) -> tuple[bool, str]:
    module, error = _LOADED.get(name)
    if module is None:
        return False, error
    try:
        ok, why = module.available()
    except Exception as exc:  # a kernel's own check must not break attention
        return False, f"{name}.available() failed: {type(exc).__name__}: {exc}"[:300]
    return bool(ok), str(why)


def _state(name: str, device_type: str) -> FlashKernelState:
    """The state of kernel `name` for tensors on `device_type`."""
    if name == TRITON_KERNEL and device_type == "cpu" and not triton_interpreted():
        reason = "the Triton kernel takes CPU tensors only under TRITON_INTERPRET=1"
        return FlashKernelState(name, device_type, False, reason)
    if name == TRITON_KERNEL and device_type == "cuda" and not torch.cuda.is_available():
        return FlashKernelState(name, device_type, False, "no CUDA device")
    ok, why = _available(name)
    return FlashKernelState(name, device_type, ok, "" if ok else why or "not available")


def flash_kernels() -> tuple[FlashKernelState, ...]:
    """Each flash kernel's state in this process: Triton for CUDA tensors (for CPU tensors
    when TRITON_INTERPRET=1), the CPU kernel for CPU tensors."""
    triton_device = "cpu" if triton_interpreted() and not torch.cuda.is_available() else "cuda"
    return (_state(TRITON_KERNEL, triton_device), _state(CPU_KERNEL, "cpu"))


@dataclass(frozen=True, slots=True)
class FlashChoice:
    """The flash kernel for tensors on one device: its name and flash_tile, or None and why
    none runs there."""

    name: str | None
    tile: FlashTile | None
    reason: str


# Kernels found, by (device type, use_kernel's name, TRITON_INTERPRET): a kernel that runs
# keeps running, so a choice is kept once made (each check costs microseconds, twice per
# call); a missing one is asked again (compile_kernels() may build it).
_FOUND: dict[tuple[str, str | None, bool], FlashChoice] = {}


def flash_kernel(device: torch.device) -> FlashChoice:
    """The flash kernel for tensors on `device`. On the CPU the compiled kernel comes first,
    then Triton's interpreter (TRITON_INTERPRET=1); on CUDA, Triton."""
    key = (device.type, _ONLY.get(), triton_interpreted())
    found = _FOUND.get(key)
    if found is not None:
        return found
    choice = _find_kernel(device)
    if choice.tile is not None:
        _FOUND[key] = choice
    return choice


def _find_kernel(device: torch.device) -> FlashChoice:
    if device.type == "cuda":
        order: tuple[str, ...] = (TRITON_KERNEL,)
    elif device.type == "cpu":
        order = (CPU_KERNEL, TRITON_KERNEL)
    else:
        return FlashChoice(None, None, f"no flash kernel takes {device.type} tensors")
    only = _ONLY.get()
    if only is not None:
        if only not in order:
            return FlashChoice(None, None, f"{only} takes no {device.type} tensors (use_kernel)")
        order = (only,)
    reasons = []
    for name in order:
        state = _state(name, device.type)
        if state.available:
            module, _ = _LOADED.get(name)
            assert module is not None
            tile: FlashTile = module.flash_tile
            return FlashChoice(name, tile, "")
        reasons.append(f"{name}: {state.reason}")
    return FlashChoice(None, None, "; ".join(reasons))


def compile_kernels() -> KernelStats:
    """Build every kernel this machine can run (idempotent; thread-safe): the chunked path's
    compiled statistics kernel (stats_kernel.compile_kernels) and the CPU flash kernel
    (cpu_flash.build()). The service calls it at warm-up; never on a request. Returns the
    statistics kernel's KernelStats; flash_kernels() says what the flash kernels are."""
    stats = compile_stats_kernel()
    module, error = _LOADED.get(CPU_KERNEL)
    if module is None:
        log.warning("CPU flash kernel: %s; the chunked path serves diagnostics", error)
        return stats
    build: Callable[[], Any] = module.build
    try:
        build()
    except Exception as exc:  # no compiler, a toolchain error: the chunked path stays
        log.warning("CPU flash kernel: building failed (%s: %s)", type(exc).__name__, exc)
        return stats
    ok, why = _available(CPU_KERNEL)
    if not ok:
        log.warning("CPU flash kernel: %s; the chunked path serves diagnostics", why)
    return stats


__all__ = [
    "CPU_KERNEL",
    "FLASH_KERNEL_NAMES",
    "TRITON_KERNEL",
    "FlashChoice",
    "FlashKernelState",
    "FlashTile",
    "compile_kernels",
    "flash_kernel",
    "flash_kernels",
    "triton_interpreted",
    "use_kernel",
]
