"""service.runtime.heap: glibc's malloc_trim, for real, and the loop that calls it."""

from __future__ import annotations

import asyncio
import platform
from pathlib import Path

import pytest

from service.runtime.heap import heap_trimmer, trim_heap_every

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="needs glibc"
)


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@glibc
def test_malloc_trim_returns_the_free_pages_between_live_chunks() -> None:
    """200 MiB in 4 KB chunks, 15 of every 16 freed: malloc keeps those pages (a live chunk
    above them pins the heap's top), RSS stays; malloc_trim gives them back."""
    trim = heap_trimmer()
    assert trim is not None
    trim()  # from a clean start
    blocks = [bytearray(4000) for _ in range(50_000)]
    kept = blocks[::16]
    del blocks
    before = rss_mib()
    assert trim() == 1  # it released memory
    assert before - rss_mib() > 100
    assert len(kept) == 3125  # (alive until here)


def test_the_trim_runs_every_period_on_a_worker_thread_until_cancelled() -> None:
    periods: list[float] = []
    calls: list[bool] = []

    def trim() -> int:
        try:  # a worker thread has no running loop
            asyncio.get_running_loop()
            calls.append(False)
        except RuntimeError:
            calls.append(True)
        return 1

    async def sleep(seconds: float) -> None:
        periods.append(seconds)
        if len(periods) > 3:
            raise asyncio.CancelledError

    async def main() -> None:
        with pytest.raises(asyncio.CancelledError):
            await trim_heap_every(15.0, trim, sleep=sleep)

    asyncio.run(main())
    assert periods == [15.0] * 4
    assert calls == [True] * 3


def test_a_failing_trim_is_logged_and_tried_again(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def trim() -> int:
        calls.append(1)
        raise OSError("no")

    async def sleep(seconds: float) -> None:
        if len(calls) >= 2:
            raise asyncio.CancelledError

    async def main() -> None:
        with pytest.raises(asyncio.CancelledError):
            await trim_heap_every(1.0, trim, sleep=sleep)

    asyncio.run(main())
    assert len(calls) == 2
    assert caplog.text.count("malloc_trim failed") == 2
