"""The gRPC door's bounds: what the HTTP door's protocol layer (service.protocol) does for HTTP/1.1,
done for HTTP/2 by grpc-core's server options and by how ModelInfer reads and sends its message.

grpc-core (grpcio 1.85, the channel arguments checked in its cygrpc library) bounds, below Python:
- a message over SDPA_MAX_BODY_BYTES (grpc.max_receive_message_length: RESOURCE_EXHAUSTED), an
  answer over SDPA_MAX_RESPONSE_BYTES and its header (grpc.max_send_message_length);
- connections: at most SDPA_MAX_CONNECTIONS (grpc.max_allowed_incoming_connections, the resource
  quota's connection cap: one more is closed at once), so the two doors hold at most twice
  SDPA_MAX_CONNECTIONS descriptors between them; a connection that has not finished HTTP/2's
  handshake within SDPA_READ_TIMEOUT_S is closed (grpc.server_handshake_timeout_ms, 120 s by
  default), and one idle for IDLE_CONNECTION_S gets a GOAWAY (grpc.max_connection_idle_ms);
- streams: SDPA_GRPC_MAX_STREAMS at once on one connection (grpc.max_concurrent_streams,
  unbounded by default; a client past it gets its stream refused), and SDPA_MAX_CONNECTIONS calls
  in the whole server (aio.server's maximum_concurrent_rpcs: RESOURCE_EXHAUSTED past it), so
  that opening and resetting streams (rapid reset, CVE-2023-44487) cannot start more handlers
  than that; grpc-core itself stops reading a connection whose peer makes it queue too many
  RST_STREAM and SETTINGS answers, and answers ping floods with GOAWAY (too_many_pings);
- headers: SDPA_MAX_HEADER_BYTES of metadata (grpc.max_metadata_size), as the HTTP door's head;
- a dead peer: a keepalive ping every KEEPALIVE_S without an answer for KEEPALIVE_TIMEOUT_S
  closes the connection.

ModelInfer is registered as a streaming method (the same bytes on the wire as a unary call: one
message each way, then the trailers), so that the door reads the message only once the call has
its key, and sends the answer while it still holds it:
- `read_message`: an unkeyed call is refused before its message is read, and holds no more than
  HTTP/2's flow-control window; a keyed one waits for a read slot (`ReadSlots`: as many messages
  being read at once as SDPA_MAX_INFLIGHT_BYTES holds messages of SDPA_MAX_BODY_BYTES twice
  over (grpc-core's copy and Python's), so the messages being read never hold more than
  SDPA_MAX_INFLIGHT_BYTES, beside what the ledger counts) and must arrive whole within
  SDPA_READ_TIMEOUT_S;
- `send_answer`: the answer stays counted in flight until gRPC has taken it past the peer's
  flow-control window, and a peer that reads none of it for SDPA_SEND_TIMEOUT_S is dropped: the
  call ends as cancelled (499, `send_timeout`) and Python's copy of the answer is freed.
  grpc.aio has no way to reset the stream, so grpc-core's copy stays queued on the connection
  until it ends: a GOAWAY at CONNECTION_AGE_S and the close SDPA_SEND_TIMEOUT_S after it.
Each refusal here is logged and counted (sdpa_rejected_total{reason}); grpc-core's own (a
connection past the cap, a stream past the per-connection cap) happen below Python and are
neither.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Final

# No stubs for grpcio in the dev dependencies (types-grpcio): its API is typed Any here.
import grpc  # type: ignore[import-untyped, unused-ignore]

from service.errors import InvalidRequest, ServiceError

if TYPE_CHECKING:
    from service.metrics import Metrics
    from service.settings import Settings

logger = logging.getLogger("sdpa.grpc")

# The answer's header (model, id, parameters, outputs' names and shapes) beside the bytes that
# SDPA_MAX_RESPONSE_BYTES bounds: a few hundred bytes, with a wide margin.
SEND_HEADROOM_BYTES: Final = 1 << 20
# An HTTP/2 connection with no call for this long gets a GOAWAY (clients reconnect at once).
IDLE_CONNECTION_S: Final = 300
# A connection this old gets a GOAWAY, and is closed SDPA_SEND_TIMEOUT_S later: what bounds an
# answer grpc-core still holds for a peer that stopped reading (send_answer frees Python's).
CONNECTION_AGE_S: Final = 1800
# The server pings a connection this often, and closes it when no answer comes in the timeout.
KEEPALIVE_S: Final = 60
KEEPALIVE_TIMEOUT_S: Final = 20


def server_options(settings: Settings) -> list[tuple[str, int]]:
    """The grpc.aio server's channel arguments for these settings (module docstring)."""
    return [
        # gRPC sets SO_REUSEPORT by default: a second server on a port in use would share it
        # silently, and half the calls would reach the wrong process. A port in use must fail
        # start-up instead.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", settings.max_body_bytes),
        ("grpc.max_send_message_length", settings.max_response_bytes + SEND_HEADROOM_BYTES),
        ("grpc.max_allowed_incoming_connections", settings.max_connections),
        ("grpc.max_concurrent_streams", settings.grpc_max_streams),
        ("grpc.server_handshake_timeout_ms", int(settings.read_timeout_s * 1000)),
        ("grpc.max_connection_idle_ms", IDLE_CONNECTION_S * 1000),
        ("grpc.max_connection_age_ms", CONNECTION_AGE_S * 1000),
        ("grpc.max_connection_age_grace_ms", int(settings.send_timeout_s * 1000)),
        ("grpc.max_metadata_size", settings.max_header_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000),
    ]


def max_concurrent_rpcs(settings: Settings) -> int:
    """Calls alive at once in the whole server (aio.server's maximum_concurrent_rpcs)."""
    return settings.max_connections


class ReadTimedOut(ServiceError):
    """The message did not arrive whole within SDPA_READ_TIMEOUT_S (DEADLINE_EXCEEDED on gRPC:
    the HTTP door's 408 has no gRPC twin)."""

    status = 504
    title = "Request timeout"


class SendTimedOut(asyncio.CancelledError):
    """The peer read none of the answer for SDPA_SEND_TIMEOUT_S: the call ends as one its
    client cancelled (499 in the log, CANCELLED), and gRPC drops the stream and the answer."""


class ReadSlots:
    """How many ModelInfer messages may be read at once: SDPA_MAX_INFLIGHT_BYTES over
    SDPA_MAX_BODY_BYTES, at least one (module docstring). A message's size is unknown until
    gRPC hands it over whole, so each read is counted as the largest it may be."""

    def __init__(self, *, max_inflight_bytes: int, max_body_bytes: int) -> None:
        # A message being read is held twice at the end: grpc-core's buffer and the Python
        # bytes it is copied into.
        self.slots = max(1, max_inflight_bytes // (2 * max_body_bytes))
        self._free = asyncio.Semaphore(self.slots)

    async def read(self, context: Any, *, timeout_s: float, metrics: Metrics) -> bytes:
        """The call's one message, read within timeout_s (waiting for a slot included)."""
        try:
            async with asyncio.timeout(timeout_s):
                async with self._free:
                    message = await context.read()
        except TimeoutError:
            metrics.rejected_total.labels(reason="read_timeout").inc()
            raise ReadTimedOut(
                f"the message did not arrive whole within SDPA_READ_TIMEOUT_S = {timeout_s} s; "
                "send it at once"
            ) from None
        if message is grpc.aio.EOF:
            # The client half-closed without a message (or gRPC refused one over the size
            # limit, and has answered the call itself).
            metrics.rejected_total.labels(reason="no_message").inc()
            raise NoMessage("the call carried no ModelInferRequest message")
        result: bytes = message
        return result


class NoMessage(InvalidRequest):
    """A ModelInfer call that ended without its message (INVALID_ARGUMENT, unless gRPC has
    answered it already: RESOURCE_EXHAUSTED for a message over SDPA_MAX_BODY_BYTES)."""


async def send_answer(context: Any, answer: bytes, *, timeout_s: float, metrics: Metrics) -> None:
    """Hand the answer to the connection; a peer that takes none of it for timeout_s has its
    call cancelled (SendTimedOut)."""
    try:
        async with asyncio.timeout(timeout_s):
            await context.write(answer)
    except TimeoutError:
        metrics.rejected_total.labels(reason="send_timeout").inc()
        logger.warning(
            "gRPC peer read none of a %d-byte answer for SDPA_SEND_TIMEOUT_S = %s s: dropped",
            len(answer),
            timeout_s,
            extra={"json_fields": {"peer": context.peer(), "answer_bytes": len(answer)}},
        )
        raise SendTimedOut from None
