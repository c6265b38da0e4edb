"""Compressed bodies for the content-encoding tests of both protocols: the plain requests they
compress, and ContentEncodingMiddleware driven directly (a body sent in chunks to an app that
stops reading where the test says, to see how much the middleware read and inflated for it)."""

from __future__ import annotations

import asyncio
import json

from starlette.types import Message, Receive, Scope, Send

from service.middleware.content_encoding import ContentEncodingMiddleware
from tests.support.app import API_SERVER_ENV

MAX_BODY = int(API_SERVER_ENV["SDPA_MAX_BODY_BYTES"])
Q = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
V1_BODY = json.dumps({"q": Q, "k": Q, "v": Q, "causal": True}).encode()
V2_BODY = json.dumps(
    {
        "inputs": [
            {"name": n, "shape": [3, 2], "datatype": "FP32", "data": [x for row in Q for x in row]}
            for n in ("q", "k", "v")
        ],
        "parameters": {"causal": True},
    }
).encode()


def drive(
    body: bytes,
    codings: bytes,
    *,
    stop_after: int,
    chunk: int = 4096,
    max_body_bytes: int | None = None,
    content_length: bool = False,
) -> tuple[int, list[int]]:
    """Send `body` with Content-Encoding `codings` (and its Content-Length, if asked), `chunk`
    bytes a message, through ContentEncodingMiddleware to an app that stops reading after
    `stop_after` inflated bytes -> (compressed bytes read, the sizes of the inflated messages
    the app saw)."""
    consumed = 0
    seen: list[int] = []

    async def receive() -> Message:
        nonlocal consumed
        part = body[consumed : consumed + chunk]
        consumed += len(part)
        return {"type": "http.request", "body": part, "more_body": consumed < len(body)}

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        total = 0
        while total <= stop_after:
            message = await receive()
            seen.append(len(message["body"]))
            total += len(message["body"])
            if not message.get("more_body"):
                return

    async def send(message: Message) -> None:
        pass

    headers = [(b"content-encoding", codings)]
    if content_length:
        headers.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "method": "POST", "path": "/v1/attention", "headers": headers}
    middleware = ContentEncodingMiddleware(inner, max_body_bytes=max_body_bytes)
    asyncio.run(middleware(scope, receive, send))
    return consumed, seen
