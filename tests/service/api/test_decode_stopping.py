"""A request still reading or decoding its body when the drain ends is answered 503 at once
(ShuttingDown, Retry-After), never left to the exit's cancellation (a 500); one that starts
after it is answered 503 at once. The ASGI app driven as uvicorn drives it, its lifespan
included: the lifespan's shutdown drains the batcher and sets AppState.stopping."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from service.app import create_app
from service.serving.gc_pause import decodes_in_progress
from service.settings import Settings
from tests.support.app import asgi_scope, ready_engine, small_settings

Message = dict[str, Any]
V2_PATH = "/v2/models/attention/infer"


class RunningApp:
    """create_app(settings) with its lifespan started, called request by request."""

    def __init__(self, settings: Settings) -> None:
        self.app = create_app(settings, engine=ready_engine(settings))
        self._lifespan_in: asyncio.Queue[Message] = asyncio.Queue()
        self._lifespan_out: asyncio.Queue[Message] = asyncio.Queue()
        self._lifespan: asyncio.Task[None] | None = None

    async def start(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self._lifespan = asyncio.create_task(
            self.app(scope, self._lifespan_in.get, self._lifespan_out.put)
        )
        await self._lifespan_in.put({"type": "lifespan.startup"})
        assert (await self._lifespan_out.get())["type"] == "lifespan.startup.complete"

    async def shut_down(self) -> None:
        """The lifespan's shutdown: the batcher drains, then AppState.stopping is set."""
        assert self._lifespan is not None
        await self._lifespan_in.put({"type": "lifespan.shutdown"})
        await self._lifespan

    def request(
        self, path: str, receive: Callable[[], Awaitable[Message]], content_length: int
    ) -> tuple[asyncio.Task[None], list[Message]]:
        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        scope = asgi_scope("POST", path, content_length=content_length)
        return asyncio.create_task(self.app(scope, receive, send)), sent


def answer(sent: list[Message]) -> tuple[int, dict[str, str], Any]:
    start = next(m for m in sent if m["type"] == "http.response.start")
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], headers, json.loads(body)


def message_of(path: str, body: Any) -> str:
    return str(body["error"] if path == V2_PATH else body["detail"])


@pytest.mark.parametrize("path", ["/v1/attention", V2_PATH])
def test_a_request_still_reading_its_body_when_the_drain_ends_is_a_503(path: str) -> None:
    async def scenario() -> tuple[list[Message], list[Message]]:
        app = RunningApp(small_settings())
        await app.start()
        reading = asyncio.Event()
        stalled: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        first = [{"type": "http.request", "body": b'{"q": [[1.0, 0.0],', "more_body": True}]

        async def receive() -> Message:
            if first:
                return first.pop()
            reading.set()
            return await stalled  # the rest of the body never comes

        task, sent = app.request(path, receive, content_length=1000)
        await reading.wait()
        await app.shut_down()
        await asyncio.wait_for(task, timeout=10)
        # After the drain, a new request is answered at once, before its body is read.
        never: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        late, late_sent = app.request(path, lambda: never, content_length=1000)
        await asyncio.wait_for(late, timeout=10)
        return sent, late_sent

    for sent in asyncio.run(scenario()):
        status, headers, body = answer(sent)
        assert status == 503
        assert headers["retry-after"] == "1"
        assert "drain has ended" in message_of(path, body)


def wait_for_a_decode(timeout_s: float = 30.0) -> bool:
    """Whether a decode began (on a worker thread) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not decodes_in_progress():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_a_request_decoding_when_the_drain_ends_is_a_503_before_the_decoding_ends() -> None:
    # q = k = v: [1, 1, 400000, 1] as JSON lists (8.4 MB of single-element rows, the slowest
    # shape per byte): most of a second of decoding on a worker thread. The drain ends once the
    # decoding began.
    x = np.ones((1, 1, 400_000, 1)).tolist()
    body = json.dumps({"q": x, "k": x, "v": x}).encode()
    settings = small_settings(max_body_bytes=64 << 20, max_elements=1 << 22)

    async def scenario() -> tuple[list[Message], int]:
        app = RunningApp(settings)
        await app.start()
        read = asyncio.Event()

        async def receive() -> Message:
            read.set()
            return {"type": "http.request", "body": body, "more_body": False}

        task, sent = app.request("/v1/attention", receive, content_length=len(body))
        await read.wait()
        assert await asyncio.to_thread(wait_for_a_decode)
        await app.shut_down()
        await asyncio.wait_for(task, timeout=30)
        return sent, decodes_in_progress()

    sent, decoding = asyncio.run(scenario())
    # The abandoned decode ends on its own; wait for it, so that it leaves with the test.
    deadline = time.monotonic() + 60
    while decodes_in_progress() and time.monotonic() < deadline:
        time.sleep(0.05)
    status, headers, problem = answer(sent)
    assert status == 503, problem
    assert headers["retry-after"] == "1"
    assert problem["title"] == "Shutting down"
    assert "drain has ended" in problem["detail"]
    assert decoding == 1  # answered while its worker thread still decoded
    assert decodes_in_progress() == 0
