"""The device thread: the one thread that drives the device.

Batches, the tiles of long items, the warm-up, the cost model's calibration and the health
monitor's idle work all run here, one at a time, in the order they were handed over, so the
event loop keeps serving HTTP while the device computes. Only the event loop hands work over;
whether the device is busy is read from the futures of the work handed over, so no flag is
written from two threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

V = TypeVar("V")


class DeviceThread:
    """A single-thread executor for device work, and whether compute is on it now."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        # The compute handed over last (a batch or a tile), while it may still run.
        self._compute: concurrent.futures.Future[object] | None = None

    @property
    def started(self) -> bool:
        return self._executor is not None

    @property
    def busy(self) -> bool:
        """True from the moment a batch or tile is handed over until it returned (after a
        drain timed out, too: it cannot be interrupted)."""
        return self._compute is not None and not self._compute.done()

    def start(self) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sdpa-device")

    def submit(self, fn: Callable[[], V], *, compute: bool = True) -> concurrent.futures.Future[V]:
        """Hand fn over (from the event loop); `compute`: it counts as the device being busy
        (idle work and warm-up do not)."""
        if self._executor is None:
            raise RuntimeError("the device thread is not started")
        future = self._executor.submit(fn)
        if compute:
            self._compute = future  # type: ignore[assignment]
        return future

    async def run(self, fn: Callable[[], V], *, compute: bool = True) -> V:
        """fn() on the device thread, awaited."""
        return await asyncio.wrap_future(self.submit(fn, compute=compute))

    def shutdown(self) -> None:
        """Stop taking work; what runs finishes in the background."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
