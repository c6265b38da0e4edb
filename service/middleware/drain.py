"""While the service drains (after SIGTERM), every response says `Connection: close`.

A keep-alive client that got an answer during the drain then opens a new connection for its
next request instead of reusing this one: that connection would be closed when the process
exits, possibly while the client is sending on it (the request lost without an answer). A new
connection reaches this replica's listener while it still answers (503 + Retry-After for new
work) or, once it has closed, is refused before anything is sent: either way the client, or the
load balancer in front, knows the request did not run and can send it elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

CONNECTION: Final = b"connection"


class ConnectionCloseWhileDrainingMiddleware:
    """Adds `Connection: close` to every HTTP response while `draining()` is true."""

    def __init__(self, app: ASGIApp, *, draining: Callable[[], bool]) -> None:
        self.app = app
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and self.draining():
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != CONNECTION]
                headers.append((CONNECTION, b"close"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_closing)
