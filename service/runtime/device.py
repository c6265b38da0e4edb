"""Which torch device the service computes on, and copies to and from it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sdpa_core import RowStats


def resolve_device(spec: str) -> torch.device:
    """'auto' -> cuda when available else cpu; 'cpu'; 'cuda' / 'cuda:N' (must exist).

    Raises:
        RuntimeError: the device asked for does not exist here (start-up fails with it).
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {spec!r} requested but CUDA is not available")
        index = device.index if device.index is not None else 0
        if index >= torch.cuda.device_count():
            raise RuntimeError(
                f"device {spec!r} requested but only {torch.cuda.device_count()} CUDA devices"
            )
    elif device.type != "cpu":
        raise RuntimeError(f"unsupported device {spec!r} (auto, cpu, cuda or cuda:N)")
    return device


def keep_intra_op_threads(threads: int) -> None:
    """Called on the device thread: keep `threads` of torch's intra-op (OpenMP) threads for
    this thread, whatever the process default becomes after.

    torch takes a thread's count from the process default at the thread's first torch call
    (a lazy, per-thread initialization that would overwrite a count set before it), so that
    call comes first here.
    """
    torch.get_num_threads()
    torch.set_num_threads(threads)


# Copies through pinned (page-locked) host memory up to this size: torch's caching host
# allocator keeps pinned blocks for reuse and never hands them back to the OS, so a rare huge
# answer must not pin its size for the life of the process.
PINNED_COPY_MAX_BYTES = 64 << 20


def _pinnable(x: torch.Tensor) -> bool:
    return x.numel() * x.element_size() <= PINNED_COPY_MAX_BYTES


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """x on `device`. A host tensor bound for a GPU is staged in pinned memory and copied
    with non_blocking=True: the DMA runs while the host goes on queueing kernels (the kernels
    that read it are ordered after it on the same stream)."""
    if device.type != "cuda" or x.device.type != "cpu" or not _pinnable(x):
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def to_host(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Device tensors on the CPU (None stays None): each copied into pinned memory with
    non_blocking=True, then one wait for the stream, rather than one synchronizing .cpu()
    per tensor. CPU tensors are returned as they are."""
    hosted: list[torch.Tensor | None] = []
    streams: set[torch.device] = set()
    for t in tensors:
        if t is None or t.device.type != "cuda" or not _pinnable(t):
            hosted.append(None if t is None else t.cpu())
            continue
        copy = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        copy.copy_(t, non_blocking=True)
        streams.add(t.device)
        hosted.append(copy)
    for device in streams:
        torch.cuda.current_stream(device).synchronize()  # the copies have landed
    return hosted


def results_on_host(
    output: torch.Tensor, weights: torch.Tensor | None, row_stats: RowStats | None
) -> tuple[torch.Tensor, torch.Tensor | None, RowStats | None]:
    """An attention result's tensors on the CPU, in one to_host() (one wait)."""
    names = [] if row_stats is None else list(row_stats.as_dict())
    rows = [] if row_stats is None else list(row_stats.as_dict().values())
    host_output, host_weights, *host_rows = to_host([output, weights, *rows])
    assert host_output is not None
    if row_stats is None:
        return host_output, host_weights, None
    fields = {name: t for name, t in zip(names, host_rows, strict=True) if t is not None}
    return host_output, host_weights, RowStats(**fields)
