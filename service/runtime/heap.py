"""Freed heap memory given back to the OS: glibc's malloc_trim(0), every TRIM_EVERY_S.

Why: a soak (bench/soak.py, mixed traffic) grew the server's RSS by 12 to 26 MiB a minute,
and glibc's own counters (mallinfo2, sampled 265 s apart) said what it was: memory in use +12
MiB, memory malloc held free inside its arenas +90 MiB. Request bodies, decoded arrays and
tensors of every size, freed by several threads (the event loop, anyio's workers, the device
thread), leave free pages between live chunks; malloc gives back only the top of each heap on
its own. malloc_trim(0) also returns every whole free page inside (madvise MADV_DONTNEED).
Measured on that soak: 13 to 33 ms a call, the RSS slope from 12 to 4 MiB a minute over five
minutes, throughput unchanged. (A fixed mmap threshold, MALLOC_MMAP_THRESHOLD_=131072, kept
RSS lower still, but the one five-minute run of it served about 40% fewer requests: every
large buffer an mmap of its own, and its pages faulted in anew.)

Outside glibc (musl, macOS) there is no malloc_trim: heap_trimmer() is None and nothing runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

# Often enough that fragmentation never builds up for long. Each call is tens of ms on a
# worker thread; it holds each arena's lock while it trims that arena, so an allocation in it
# (the event loop's, the device thread's) may wait that long, once every TRIM_EVERY_S.
TRIM_EVERY_S = 15.0


def heap_trimmer() -> Callable[[], int] | None:
    """glibc's malloc_trim(0) as a call (1 if it released memory), or None without glibc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols: libc's among them
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def trim_heap() -> int:
        return int(trim(0))

    return trim_heap


async def trim_heap_every(
    seconds: float,
    trim: Callable[[], int],
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Call `trim` on a worker thread every `seconds`, until cancelled."""
    while True:
        await sleep(seconds)
        try:
            await asyncio.to_thread(trim)
        except Exception:  # never the service's: logged, tried again next time
            logger.exception("malloc_trim failed")
