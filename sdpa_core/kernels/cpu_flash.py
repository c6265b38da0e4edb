"""The CPU flash kernel: attention and every RowStats field of a query tile in one C++ call.

FlashAttention's structure on the CPU (csrc/cpu_flash.cpp): every (batch x head, query block)
is a task of torch's intra-op pool; per key block one GEMM for the scores, one fused pass per
row for the running max, the exponentials and every statistic, one GEMM for p v. The C++ is a
torch extension built with torch's own toolchain (torch.utils.cpp_extension: a C++ compiler and
ninja), at a service's warm-up (build(), which compile_kernels() calls), never on a request.
No -march flag: the hot loops are cloned per instruction set (AVX-512, AVX2+FMA, baseline) and
chosen at load time, so one build runs on any x86-64 and an image can carry it prebuilt.

Where the built library comes from, in build()'s order:
1. PREBUILT_DIR (beside this module), where prebuild() puts it: the container image compiles
   it at image build time, so the image needs neither a compiler nor torch's C++ headers;
2. torch's extension cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), where
   cpp_extension.load compiles it on the first build() and finds it afterwards.
The library's name carries a digest of the source, the flags and torch's version, so a stale
build is never loaded.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Final

import torch

from sdpa_core.diagnostics import (
    HEAD_TABLE_FIELDS,
    HEAD_TABLE_ROWS,
    SATURATION_THRESHOLD,
    RowStats,
    set_native_head_table,
)

log = logging.getLogger(__name__)

SOURCE: Final = Path(__file__).parent / "csrc" / "cpu_flash.cpp"
PREBUILT_DIR: Final = Path(__file__).parent / "prebuilt"
# -O3 (torch's own release build uses -O2; the fused pass is written in explicit 16-lane
# vectors, so it does not wait on the auto-vectorizer either way; not measured against -O2),
# OpenMP for at::parallel_for (the library links the libgomp torch already loaded), and no
# floating-point contraction: the fused pass recomputes s - m and relies on exp(s_max - m)
# being exactly 1.
CFLAGS: Final = ("-O3", "-fopenmp", "-ffp-contract=off", "-Wno-psabi")
LDFLAGS: Final = ("-fopenmp",)
# The RowStats fields in the order the C++ returns them after the output.
FIELDS: Final = (
    "visible_keys",
    "entropy",
    "max_weight",
    "sink_share",
    "lse",
    "grad_health",
    "jacobian_fro",
    "score_mean_raw",
    "score_m2_raw",
    "score_abs_max_raw",
)


_HEAD_TABLE_DTYPES: Final = (torch.float32, torch.float64)


def library_name() -> str:
    """The extension's module name: a digest of the source, the flags and torch's version."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join((*CFLAGS, *LDFLAGS, torch.__version__)).encode())
    return f"sdpa_cpu_flash_{digest.hexdigest()[:12]}"


class _Kernel:
    """The loaded extension, once per process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.module: ModuleType | None = None
        self.reason = "not built yet: build() was not called"
        self.source = ""  # "prebuilt" or "compiled"
        self.build_s = 0.0


_KERNEL = _Kernel()


def available() -> tuple[bool, str]:
    """(True, "") once build() loaded the kernel, else (False, why)."""
    if _KERNEL.module is not None:
        return True, ""
    return False, _KERNEL.reason


def loaded_from() -> str:
    """Where the loaded kernel came from: "prebuilt" (PREBUILT_DIR or build()'s prebuilt_dir),
    "compiled" (cpp_extension, or its cache), "" while none is loaded."""
    return _KERNEL.source


def _import_library(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        name, path, loader=importlib.machinery.ExtensionFileLoader(name, str(path))
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _toolchain() -> str:
    """Why cpp_extension cannot build here ("" when it can): it needs a C++ compiler and the
    `ninja` executable on PATH. The `ninja` package (a dependency) puts one beside the
    interpreter, which a process started as `.venv/bin/python` does not have on PATH: then
    its directory is appended to PATH (once, at warm-up)."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler} not found)"
    if shutil.which("ninja") is None:
        scripts = sysconfig.get_paths()["scripts"]
        if shutil.which("ninja", path=scripts) is None:
            return "ninja not found (pip install ninja)"
        os.environ["PATH"] = os.pathsep.join(p for p in (os.environ.get("PATH"), scripts) if p)
    include = Path(torch.__file__).parent / "include" / "torch" / "extension.h"
    if not include.exists():
        return "torch's C++ headers are not installed"
    return ""


def _compile(name: str) -> ModuleType:
    from torch.utils import cpp_extension

    module: ModuleType = cpp_extension.load(
        name=name,
        sources=[str(SOURCE)],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        verbose=False,
    )
    return module


def build(prebuilt_dir: Path = PREBUILT_DIR) -> tuple[bool, str]:
    """Load the kernel: the prebuilt library in prebuilt_dir when there is one for this
    source and torch, else compile it (seconds; cached in torch's extension directory).
    Idempotent and thread-safe; (True, "") when it can run, else (False, why): no compiler,
    no ninja, a build error. Never called on a request."""
    with _KERNEL.lock:
        if _KERNEL.module is not None:
            return True, ""
        started = time.perf_counter()
        name = library_name()
        suffix = importlib.machinery.EXTENSION_SUFFIXES[-1]  # ".so"
        prebuilt = prebuilt_dir / f"{name}{suffix}"
        try:
            if prebuilt.exists():
                _KERNEL.module = _import_library(name, prebuilt)
                _KERNEL.source = "prebuilt"
            else:
                missing = _toolchain()
                if missing:
                    _KERNEL.reason = missing
                    return False, missing
                _KERNEL.module = _compile(name)
                _KERNEL.source = "compiled"
        except Exception as exc:  # a compiler error, an unloadable library
            _KERNEL.reason = f"building failed: {type(exc).__name__}: {exc}"[:500]
            log.warning("CPU flash kernel: %s", _KERNEL.reason)
            return False, _KERNEL.reason
        _KERNEL.build_s = time.perf_counter() - started
        _KERNEL.reason = ""
        set_native_head_table(head_table)
        log.info("CPU flash kernel %s (%s) in %.1f s", name, _KERNEL.source, _KERNEL.build_s)
        return True, ""


def prebuild(directory: Path = PREBUILT_DIR) -> Path:
    """Compile the kernel and copy the library into `directory`, where build() finds it (the
    image build runs this, with a compiler and torch's headers at hand); returns its path."""
    missing = _toolchain()
    if missing:
        raise RuntimeError(missing)
    name = library_name()
    module = _compile(name)
    built = Path(str(module.__file__))
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / built.name
    shutil.copyfile(built, target)
    return target


def head_table(row_stats: RowStats) -> torch.Tensor | None:
    """diagnostics' head table in one C++ call (set_native_head_table: build() installs it),
    or None for rows it does not take: not on the CPU, or not float32/float64."""
    module = _KERNEL.module
    vis = row_stats.visible_keys
    dtype = row_stats.entropy.dtype
    if module is None or not vis.is_cpu or dtype not in _HEAD_TABLE_DTYPES:
        return None
    fields = [getattr(row_stats, name) for name in HEAD_TABLE_FIELDS]
    # What the C++ side takes, else torch's table (a hand-made RowStats may hold int32 counts
    # or broadcast shapes; no rows at all make no heads to reshape).
    if vis.dtype != torch.int64 or vis.dim() < 1 or vis.shape[-1] == 0:
        return None
    if any(f.dtype != dtype or not f.is_cpu or f.shape != vis.shape for f in fields):
        return None
    table: torch.Tensor = module.head_table(fields, vis, SATURATION_THRESHOLD)
    return table.reshape(HEAD_TABLE_ROWS, *vis.shape[:-1])


def flash_tile(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    q_start: int,
    causal_shift: int | None,
    key_lengths: torch.Tensor | None,
    visible: torch.Tensor | None,
    bias: torch.Tensor | None,
    sink_tokens: int,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The kernel contract's flash_tile (sdpa_core/kernels/__init__.py): (output [B, H, tq,
    D_v] in q.dtype, every RowStats field [B, H, tq]) in one C++ call. build() must have
    succeeded (available())."""
    module = _KERNEL.module
    if module is None:
        raise RuntimeError(f"the CPU flash kernel is not available: {_KERNEL.reason}")
    out, *stats = module.flash_tile(
        q, k, v, scale, q_start, causal_shift, key_lengths, visible, bias, sink_tokens
    )
    return out, dict(zip(FIELDS, stats, strict=True))
