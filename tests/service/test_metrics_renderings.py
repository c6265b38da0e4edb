"""/metrics rendered once for every scrape waiting, never older than the scrape, spaced by its
cost (service.metrics.Renderings). Deterministic: the rendering function is held on an event
until the test lets it go, and the clock is the test's.

How much this keeps a bystander's latency is a timing claim: bench/tap.py's metrics part
measures it (eight scrapers at full cardinality), BENCHMARKS.md has the figures.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from service.metrics import RENDER_GAP, Metrics, Renderings


class Held:
    """A rendering that returns its own number, once the test releases it."""

    def __init__(self) -> None:
        self.calls = 0
        self.release = threading.Event()
        self.started = threading.Event()

    def __call__(self) -> bytes:
        self.calls += 1
        self.started.set()
        assert self.release.wait(10)
        return str(self.calls).encode()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _until(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, 10)


def test_eight_concurrent_scrapes_share_one_rendering() -> None:
    async def run() -> None:
        render = Held()
        renderings = Renderings(render, clock=Clock())
        scrapes = [asyncio.create_task(renderings.latest()) for _ in range(8)]
        await _until(render.started)
        render.release.set()
        texts = await asyncio.gather(*scrapes)
        assert texts == [b"1"] * 8
        assert render.calls == renderings.count == 1

    asyncio.run(run())


def test_a_scrape_during_a_rendering_waits_for_the_next_and_they_share_it() -> None:
    """Scrapes that arrive while a rendering runs get a newer one (it may have missed what
    they came after), all of them the same one."""

    async def run() -> None:
        render = Held()
        renderings = Renderings(render, gap=0.0, clock=Clock())
        first = asyncio.create_task(renderings.latest())
        await _until(render.started)
        later = [asyncio.create_task(renderings.latest()) for _ in range(5)]
        await asyncio.sleep(0)
        render.release.set()
        assert await first == b"1"
        assert await asyncio.gather(*later) == [b"2"] * 5
        assert render.calls == 2

    asyncio.run(run())


def test_a_scrape_after_a_rendering_gets_a_fresh_one_after_the_gap() -> None:
    async def run() -> None:
        clock = Clock()
        durations: list[float] = []

        def render() -> bytes:
            clock.now += 0.5  # each rendering "takes" 0.5 s of the test's clock
            return b"x"

        slept: list[float] = []

        async def sleep(seconds: float) -> None:
            slept.append(seconds)
            clock.now += seconds

        renderings = Renderings(render, clock=clock, sleep=sleep, on_render=durations.append)
        await renderings.latest()
        ended = clock.now
        await renderings.latest()
        assert renderings.count == 2
        assert durations == [0.5, 0.5]
        # The second started RENDER_GAP x 0.5 s after the first ended, not before.
        assert slept == [pytest.approx(RENDER_GAP * 0.5)]
        assert clock.now == pytest.approx(ended + RENDER_GAP * 0.5 + 0.5)

    asyncio.run(run())


def test_a_scrape_that_leaves_does_not_cancel_the_others_rendering() -> None:
    async def run() -> None:
        render = Held()
        renderings = Renderings(render, clock=Clock())
        leaving = asyncio.create_task(renderings.latest())
        staying = asyncio.create_task(renderings.latest())
        await _until(render.started)
        leaving.cancel()
        render.release.set()
        assert await staying == b"1"
        with pytest.raises(asyncio.CancelledError):
            await leaving

    asyncio.run(run())


def test_the_app_renders_its_own_registry_and_times_it() -> None:
    async def run() -> None:
        metrics = Metrics()
        metrics.queue_depth.set(7)
        text = (await metrics.renderings.latest()).decode()
        assert "sdpa_queue_depth 7.0" in text
        metrics.queue_depth.set(8)
        text = (await metrics.renderings.latest()).decode()
        assert "sdpa_queue_depth 8.0" in text  # never an older text than the scrape
        assert "sdpa_metrics_render_seconds_count 1.0" in text  # the first one, timed

    asyncio.run(run())
