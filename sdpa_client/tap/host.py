"""Copies of a sampled call's tensors in host memory: the only work the tap does on the forward's
thread, beyond a few attribute reads.

On the CPU a copy is one memcpy per tensor (a clone: the model may write into its tensors
afterwards, as a KV cache does). On CUDA the copy goes into pinned host memory with
non_blocking=True on a side stream that first waits for the model's stream, so the forward
never waits for it; the sender waits on the recorded event before it reads the bytes, and
record_stream keeps the caching allocator from handing the source's memory to the model before
the copy is done.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class HostTensors:
    """q, k, v and masks in host memory, and what to wait on before reading them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None
    key_padding_mask: torch.Tensor | None
    ready: torch.cuda.Event | None  # None: already complete (CPU sources)

    def wait(self) -> None:
        """Block until the copies are complete (on the sender's thread)."""
        if self.ready is not None:
            self.ready.synchronize()


def nbytes(*tensors: torch.Tensor | None) -> int:
    """Bytes the host copies of these tensors take."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class HostCopier:
    """Makes HostTensors; one side stream per CUDA device, created on first use."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def copy(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
    ) -> HostTensors:
        if q.device.type != "cuda":
            return HostTensors(
                _cpu_copy(q), _cpu_copy(k), _cpu_copy(v),
                _optional(_cpu_copy, attn_mask), _optional(_cpu_copy, key_padding_mask), None,
            )  # fmt: skip
        stream = self._stream(q.device)
        stream.wait_stream(torch.cuda.current_stream(q.device))
        with torch.cuda.stream(stream):

            def pinned(t: torch.Tensor) -> torch.Tensor:
                return _pinned_copy(t, stream)

            copies = HostTensors(
                pinned(q), pinned(k), pinned(v),
                _optional(pinned, attn_mask), _optional(pinned, key_padding_mask),
                torch.cuda.Event(),  # type: ignore[no-untyped-call]
            )  # fmt: skip
            assert copies.ready is not None
            copies.ready.record(stream)
        return copies

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            if index not in self._streams:
                self._streams[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
            return self._streams[index]


def _optional(
    copy: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor | None
) -> torch.Tensor | None:
    return None if t is None else copy(t)


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cpu":  # a mask on another device than q (unusual, but legal)
        return t.detach().to("cpu", copy=True).contiguous()
    return t.detach().clone(memory_format=torch.contiguous_format)


def _pinned_copy(t: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
    if t.device.type != "cuda":
        return _cpu_copy(t)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t.detach(), non_blocking=True)
    t.record_stream(stream)
    return host
