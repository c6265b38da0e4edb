"""The chunked path's per-block statistics as one compiled CPU kernel (torch.compile, inductor).

The chunked path (chunked.py) updates an online softmax and eight row statistics for every
(query tile x key block) of scores. In eager torch that is about twenty passes over the score
tile, each a separate torch call: on the CPU the statistics then cost two to four times the
output itself. Here the whole update (the score moments, the running max, the exponentials,
the "rest" power sums, the merge into the running state) is one function that inductor turns
into a few C++ loops over the tile, beside the two matmuls, which stay torch's own.

The function is the same math as the eager loop in chunked.py (same formulas, same order of
merges), so both give the float64 reference's numbers within the same tolerances; the eager
loop stays the path wherever this one does not apply.

Compiling costs seconds (tens on a cold cache), so it never happens on a request:
compile_kernels() compiles the three variants (every key visible; a causal edge; an edge and
a mask tile) once per process, at a service's warm-up, with dynamic shapes. Afterwards every
call goes through a run-only handle (torch._dynamo.run): a call whose guards would miss (a
size that inductor specialized, a grad mode it did not see) runs the same function eagerly
instead of compiling. Without compile_kernels(), or when it failed (no C++ compiler, an
unsupported torch), the chunked path runs its eager loop.

Checked on torch 2.13 (CPU). The kernel is CPU-only: on CUDA compiling would need Triton, and
no GPU was at hand to measure whether it pays there (the eager loop runs on CUDA).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeAlias

import torch

log = logging.getLogger(__name__)


class BlockState(NamedTuple):
    """The online state of R query rows after some key blocks; every field is [R] (float32).

    m: running max of the scores (relative to ref), -inf while a row has seen no visible key;
    denom: sum of e^(s - m); t: the shifted first moment sum e^(s - m) (s - m); rest1..3: power
    sums of e^(s - m) over every visible key but one row max (chunked.py explains why);
    keys (the visible keys seen), mean, m2, abs_max: the score moments, in scaled units;
    ref: the per-row shift of the scores (the mean of the row's first visible block).
    """

    m: torch.Tensor
    denom: torch.Tensor
    t: torch.Tensor
    rest1: torch.Tensor
    rest2: torch.Tensor
    rest3: torch.Tensor
    keys: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor
    abs_max: torch.Tensor
    ref: torch.Tensor


def initial_state(rows: int, *, device: torch.device) -> BlockState:
    """The state of rows that have seen no key (the update's neutral element)."""
    # Distinct tensors, not one shared zero: the compiled kernel's guards would tell aliased
    # inputs from distinct ones and need a graph for each.
    zeros = torch.zeros(10, rows, dtype=torch.float32, device=device).unbind(0)
    return BlockState(torch.full((rows,), -math.inf, dtype=torch.float32, device=device), *zeros)


def block_update(
    s: torch.Tensor,
    limit: torch.Tensor | None,
    add: torch.Tensor | None,
    state: BlockState,
) -> tuple[BlockState, torch.Tensor, torch.Tensor]:
    """One key block's update of the online state -> (new state, alpha [R], e [R, w]).

    s: [R, w] float32 scores already multiplied by the scale. limit: None (no causal edge in
    this block), or [R] float32, the last key of the block each row may see (a causal mask's
    edge, computed here from the index instead of read from a mask tile). add: None, or
    [R, w] float32, the rest of the mask tile as an addend: 0 or a float mask's bias where
    visible, -inf where not. e = exp(s - ref + add - m_new) (the un-normalized weights
    relative to the new max, for the caller's e @ v) and alpha = e^(m - m_new), the factor on
    the caller's running e @ v. The formulas are chunked.attend_tiles_steps' (see its module
    docstring); a first block meets a neutral state and reduces to the eager loop's
    first-block branch. Without limit and add every entry is visible, and the kernel skips
    the masked selects (which double its cost in inductor's CPU code).
    """
    fmin = torch.finfo(torch.float32).min
    keep: torch.Tensor | None = None
    if limit is not None:
        cols = torch.arange(s.shape[-1], device=s.device, dtype=torch.float32)
        keep = cols <= limit.unsqueeze(-1)  # [R, w]
    if add is not None:
        # A NaN bias entry stays visible (as on the other paths), its NaN reaching the row.
        visible = add != -math.inf
        keep = visible if keep is None else keep & visible
    if keep is None:
        cnt = torch.full_like(state.m, float(s.shape[-1]))
        shift = s.sum(-1) / cnt  # [R]
        dev = s - shift.unsqueeze(-1)
        bmax = s.abs().amax(-1)
    else:
        cnt = keep.to(torch.float32).sum(-1)
        shift = torch.where(keep, s, 0.0).sum(-1) / cnt.clamp(min=1.0)
        dev = torch.where(keep, s - shift.unsqueeze(-1), 0.0)
        bmax = torch.where(keep, s.abs(), 0.0).amax(-1)
    cnt_safe = cnt.clamp(min=1.0)
    resid = dev.sum(-1)
    bm2 = ((dev * dev).sum(-1) - resid * resid / cnt_safe).clamp(min=0.0)
    has = cnt > 0
    bmean = torch.where(has, shift + resid / cnt_safe, 0.0)
    bm2 = torch.where(has, bm2, 0.0)
    # Chan's merge of (count, mean, M2); a first block (count 0) takes the block's own.
    n_new = state.keys + cnt
    frac = cnt / n_new.clamp(min=1.0)
    delta = bmean - state.mean
    m2 = state.m2 + bm2 + delta * delta * state.keys * frac
    mean = state.mean + delta * frac
    abs_max = torch.maximum(state.abs_max, torch.where(has, bmax, 0.0))
    # One shift per row for the softmax, fixed by the row's first visible block.
    ref = torch.where(state.keys > 0, state.ref, shift)

    st = s - ref.unsqueeze(-1)
    if add is not None:
        st = st + add
    if limit is not None:
        st = torch.where(keep, st, -math.inf)  # type: ignore[arg-type]
    blk_max = st.amax(-1)  # [R]
    m_new = torch.maximum(state.m, blk_max)
    m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
    alpha = torch.exp(state.m - m_safe)  # 0 while the row has seen nothing
    sp = st - m_safe.unsqueeze(-1)  # <= 0; -inf where not visible
    e = torch.exp(sp)
    # The "rest" sums leave out the entries equal to 1 (the row max and its exact ties),
    # counted apart in n_ones: floor(e) is 1 exactly there.
    ones = torch.floor(e)
    rest_e = e - ones
    n_ones = ones.sum(-1)
    rest_blk = rest_e.sum(-1)
    t_blk = (sp.clamp(min=fmin) * rest_e).sum(-1)
    sq = rest_e * rest_e
    a2_blk = sq.sum(-1)
    a3_blk = (sq * rest_e).sum(-1)

    holds = (blk_max == m_new) & (state.m < m_new)  # this block holds the new max
    had = state.denom > 0
    joins = (holds & had).to(torch.float32)  # the old max joins the rest
    back = n_ones - holds.to(torch.float32)  # ties of the max go to the rest
    gap = torch.where(had, state.m - m_safe, 0.0)
    alpha2 = alpha * alpha
    new = BlockState(
        m=m_new,
        denom=alpha * state.denom + rest_blk + n_ones,
        t=alpha * (state.t + state.denom * gap) + t_blk,
        rest1=alpha * (state.rest1 + joins) + rest_blk + back,
        rest2=alpha2 * (state.rest2 + joins) + a2_blk + back,
        rest3=alpha2 * alpha * (state.rest3 + joins) + a3_blk + back,
        keys=n_new,
        mean=mean,
        m2=m2,
        abs_max=abs_max,
        ref=ref,
    )
    return new, alpha, e


UpdateFn = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor | None, BlockState],
    tuple[BlockState, torch.Tensor, torch.Tensor],
]


@dataclass(frozen=True, slots=True)
class KernelStats:
    """What the compiled kernel did in this process: compiled (ready), the seconds compiling
    took, the calls handed to it, and why it is not ready (None when it is)."""

    compiled: bool
    compile_s: float
    calls: int
    reason: str | None


class _Kernels:
    """The compiled kernel, once per process (compiling is the expensive, one-time part)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kernel: UpdateFn | None = None  # the run-only handle: it never compiles
        self.compile_s = 0.0
        self.calls = 0  # approximate under threads: a statistic, never a decision
        self.reason: str | None = "compile_kernels() was not called"


_KERNELS = _Kernels()
# Warm-up shapes: distinct sizes above 1, so that dynamic shapes get one symbol each (torch
# specializes sizes 0 and 1, and "duck-sizes" equal ones into one symbol).
_WARM_ROWS, _WARM_KEYS = 24, 40


def compile_kernels() -> KernelStats:
    """Compile the three variants of block_update for the CPU (idempotent; thread-safe). Returns
    kernel_stats(); on failure the chunked path keeps its eager loop and reason says why.

    Calls afterwards go through torch._dynamo.run's handle, which uses the graphs compiled here
    and never compiles: a call whose guards would miss runs the same function eagerly, with no
    process-wide setting changed (torch.compiler.set_stance is global, and threads calling
    under it raced; checked on torch 2.13)."""
    with _KERNELS.lock:
        if _KERNELS.kernel is not None:
            return kernel_stats()
        started = time.perf_counter()
        try:
            import torch._inductor.config as inductor_config

            compiled = torch.compile(block_update, dynamic=True, fullgraph=True)
            gen = torch.Generator().manual_seed(0)
            s = torch.randn(_WARM_ROWS, _WARM_KEYS, generator=gen)
            limit = torch.arange(_WARM_ROWS, dtype=torch.float32)
            add = torch.zeros_like(s)
            add[:, _WARM_KEYS // 2 :] = -math.inf
            # Its C++ builds in this thread, one after another: with more compile threads,
            # inductor starts a pool of them that lives as long as the process (AsyncCompile.pool,
            # torch 2.13), idle after this, and a server's clean exit saw its idle, non-daemon
            # worker as a thread still busy. The variants compile one after another anyway.
            with torch.no_grad(), inductor_config.patch(compile_threads=1):
                # The three variants: every key visible, a causal edge, an edge and a mask.
                for edge, mask in ((None, None), (limit, None), (limit, add)):
                    state = initial_state(_WARM_ROWS, device=s.device)
                    for _ in range(2):  # a first block and a merge: the same graph
                        state, _, _ = compiled(s, edge, mask, state)
            run_only: UpdateFn = torch._dynamo.run(compiled)
        except Exception as exc:  # no C++ compiler, an inductor bug: keep the eager loop
            _KERNELS.reason = f"compiling failed: {type(exc).__name__}: {exc}"[:500]
            log.warning("diagnostics kernel: %s; the eager loop runs instead", _KERNELS.reason)
            return kernel_stats()
        _KERNELS.kernel = run_only
        _KERNELS.compile_s = time.perf_counter() - started
        _KERNELS.reason = None
        log.info("diagnostics kernel compiled in %.1f s", _KERNELS.compile_s)
        return kernel_stats()


def kernel_stats() -> KernelStats:
    """The compiled kernel's state and counters in this process."""
    k = _KERNELS
    return KernelStats(
        compiled=k.kernel is not None, compile_s=k.compile_s, calls=k.calls, reason=k.reason
    )


KernelMode: TypeAlias = Literal["auto", "always", "off"]
_MODE: ContextVar[KernelMode] = ContextVar("sdpa_core_kernel_mode", default="auto")
# Scores of one sequence's (query tile x key block) below which "auto" runs the eager loop even
# where the kernel is compiled: a compiled call costs about 0.1 ms before any work (its guards;
# torch 2.13, one thread of a 2-core machine), which the eager loop's few small torch calls
# undercut on small tiles ([1, 4, 64, 64], 2^14 scores: eager 1.68 ms, kernel 1.90 ms,
# bench/diagnostics_cost.py).
KERNEL_MIN_SCORES = 1 << 15


@contextlib.contextmanager
def kernel_mode(mode: KernelMode) -> Iterator[None]:
    """Where the compiled kernel runs inside this context: "auto" (tiles of at least
    KERNEL_MIN_SCORES scores per sequence), "always" (any tile it can take) or "off" (the eager
    loop). Tests and benchmarks compare the two routes in one process."""
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


def kernel_ready(device: torch.device, *, scores: int) -> bool:
    """Whether the compiled kernel runs on `device` for tiles of `scores` scores per sequence:
    compiled, a CPU, the mode (kernel_mode) lets it, and its guards would hold: not inside
    inference_mode (the graphs were compiled outside it: every call would miss them and run
    eagerly, slower than the eager loop) nor inside a caller's own torch.compile region
    (tracing through a compiled handle is not allowed there; the eager loop traces)."""
    mode = _MODE.get()
    if mode == "off" or device.type != "cpu" or _KERNELS.kernel is None:
        return False
    if torch.is_inference_mode_enabled() or torch.compiler.is_compiling():
        return False
    return mode == "always" or scores >= KERNEL_MIN_SCORES


def run_update(
    s: torch.Tensor, limit: torch.Tensor | None, add: torch.Tensor | None, state: BlockState
) -> tuple[BlockState, torch.Tensor, torch.Tensor]:
    """block_update, compiled when compile_kernels() succeeded, else eagerly (the same numbers
    up to the order of float reductions)."""
    if add is not None and limit is None:  # one variant for masks with and without an edge
        limit = torch.full_like(state.m, float(s.shape[-1]))
    kernel = _KERNELS.kernel
    with torch.no_grad():  # the graphs' grad mode
        # Sizes 0 and 1 are specialized by torch's dynamic shapes: such a tile would miss.
        if kernel is not None and min(s.shape) > 1:
            _KERNELS.calls += 1
            return kernel(s, limit, add, state)
        return block_update(s, limit, add, state)
