"""Delivery: whether an answer handed to a connection reached its client. Each request's scope
carries, as the ASGI extension DELIVERY_EXTENSION, an awaitable that says so (the access log
logs 499 when it did not: the client left, or the send timeout dropped it, while its answer was
being sent); and the bytes of answers waiting in the write buffers of clients that fell behind,
which the in-flight limit counts."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from service.protocol.connection import GuardedHttpToolsProtocol

# scope["extensions"][DELIVERY_EXTENSION]: () -> awaitable bool, whether the answer handed to the
# connection reached its client. It waits while the client reads slower than the server writes
# (bounded by the send timeout) and is False when the connection was lost with bytes unsent.
DELIVERY_EXTENSION: Final = "sdpa.delivery"
Delivery = Callable[[], Awaitable[bool]]

# The connections whose client reads slower than the server writes (write buffer past its
# high-water mark): their unsent answers are memory the in-flight limit must count.
backed_up: set[GuardedHttpToolsProtocol] = set()


def unsent_bytes() -> int:
    """Bytes of answers handed over but not yet taken by their clients (write buffers)."""
    return sum(protocol.transport.get_write_buffer_size() for protocol in backed_up)


async def delivered(conn: GuardedHttpToolsProtocol) -> bool:
    """Whether the answers handed to this connection reached the client: at once unless
    the client reads slower than the server writes; then when it catches up (True) or the
    connection is lost, by the client or the send timeout (False)."""
    if conn._lost_undelivered:
        return False
    if conn not in backed_up:
        return True
    waiter: asyncio.Future[bool] = conn.loop.create_future()
    conn._delivery_waiters.add(waiter)
    try:
        return await waiter
    finally:
        conn._delivery_waiters.discard(waiter)


def settle_delivery(conn: GuardedHttpToolsProtocol, delivered: bool) -> None:
    for waiter in conn._delivery_waiters:
        if not waiter.done():
            waiter.set_result(delivered)
