"""The Open Inference Protocol over gRPC: KServe's inference.GRPCInferenceService, as
tritonclient.grpc speaks it, for the model "attention" (version "1", or none named).

A third door to the serving layer (service.serving.pipeline), beside v1 and v2 REST: ModelInfer
hands its message's bytes, undecoded, to a GrpcInferDoor (service.serving.prepare_grpc), so that
a large one is parsed off the event loop, and the same limits, tenants, batching, deadlines and
health apply. What this module adds is gRPC's part:

- API keys from the call's metadata (`authorization: Bearer <key>` or `x-api-key: <key>`, as
  the HTTP middleware reads headers: service.tenants), for every call but ServerLive and
  ServerReady, which stay open as the HTTP probes do.
- The deadline: the earliest of the call's gRPC deadline, the request's `timeout` parameter and
  SDPA_REQUEST_TIMEOUT_MS. When the client cancels, or its deadline passes, gRPC cancels the
  call's task; a job still queued leaves the batcher's queue (DynamicBatcher.submit drops a job
  whose waiter is cancelled) and is never computed.
- Status codes (gRPC's for the REST door's statuses): INVALID_ARGUMENT for 400/422,
  UNAUTHENTICATED 401, NOT_FOUND 404 (another model), RESOURCE_EXHAUSTED for 413 (a message
  over SDPA_MAX_BODY_BYTES is refused by gRPC itself), 429 and a full queue, DEADLINE_EXCEEDED
  504, UNAVAILABLE while starting or shutting down; a momentary refusal says when to retry in
  its message and in the trailing metadata `retry-after` (seconds). INTERNAL only for a bug of
  ours, whose traceback goes to the log (never to the client).
- One Exchange per call (service.serving.exchange), as the HTTP edge makes one per request:
  its route "grpc:<Method>", the HTTP status the REST door would answer (200, 400, 401, 404,
  413, 429, 499 for a call its client cancelled, 500, 503, 504) and gRPC's own code. The one
  recorder (service.access_log) turns it into the access-log line, the metrics and the span
  (W3C traceparent from the metadata), as for every door: this module writes none of them.
  Every call carries `x-request-id` back in its trailing metadata (the caller's own, when sane),
  and a computed one `server-timing`, as REST's Server-Timing header (read, decode, queue, ...).
- A `grpc-timeout` grpc-core cannot parse never reaches this module: grpc-core's HPACK parser
  ends the call INTERNAL before any handler runs (grpcio 1.85; a test pins it).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

# No stubs for grpcio in the dev dependencies (types-grpcio): its API is typed Any here.
import grpc  # type: ignore[import-untyped, unused-ignore]
from grpc import aio  # type: ignore[import-untyped, unused-ignore]

from service.api.v2 import MODEL_METADATA
from service.errors import (
    DeadlineUnreachable,
    DeviceOutOfMemory,
    MemoryBusy,
    QueueFull,
    RetryLater,
    ServiceError,
    ShuttingDown,
)
from service.grpc_limits import ReadSlots, max_concurrent_rpcs, send_answer, server_options
from service.serving import pipeline
from service.serving.exchange import Exchange
from service.serving.frame import admitted
from service.serving.inflight import Holding
from service.serving.pipeline import Served
from service.serving.prepare_grpc import GrpcInferDoor
from service.serving.state import AppState
from service.tenants import Keyring, presented_keys, refusal
from service.version import VERSION
from service.wire.grpc import grpc_predict_v2_pb2 as pb
from service.wire.grpc_codec import SERVICE_NAME, UnknownModel
from service.wire.v2_errors import v2_message, v2_status
from service.wire.v2_models import EXTENSIONS, MODEL_NAME, MODEL_VERSION, SERVER_NAME

logger = logging.getLogger("sdpa.grpc")

ROUTE_PREFIX: Final = "grpc:"
REQUEST_ID_KEY: Final = "x-request-id"
RETRY_AFTER_KEY: Final = "retry-after"
SERVER_TIMING_KEY: Final = "server-timing"
# As the HTTP access log takes a caller's X-Request-ID: 1-128 visible ASCII characters.
_SANE_REQUEST_ID: Final = re.compile(r"[\x21-\x7e]{1,128}")
# What a call its client cancelled is logged and counted as (nginx's "client closed request").
CLIENT_CLOSED: Final = 499
# Retry-After of a call refused because the server is starting or draining.
_NOT_SERVING_RETRY_AFTER_S: Final = 1.0


# ---- status codes ---------------------------------------------------------------------------


def grpc_code(exc: ServiceError) -> grpc.StatusCode:
    """The gRPC status of a client error (module docstring)."""
    if isinstance(exc, ShuttingDown):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, QueueFull | DeadlineUnreachable | MemoryBusy | DeviceOutOfMemory):
        # Capacity, not availability: the server serves, and a retry later may fit.
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    status = exc.status
    if status == 401:
        return grpc.StatusCode.UNAUTHENTICATED
    if status == 404:
        return grpc.StatusCode.NOT_FOUND
    if status in (413, 429):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if status == 503:
        return grpc.StatusCode.UNAVAILABLE
    if status == 504:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INVALID_ARGUMENT  # 400, 415, 422: what the caller sent


@dataclass(frozen=True, slots=True)
class _Refusal:
    """How a call ended in an error: gRPC's status, its message and trailing metadata, and the
    HTTP status it is logged and counted as."""

    code: grpc.StatusCode
    message: str
    http_status: int
    trailing: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, exc: ServiceError) -> _Refusal:
        message = v2_message(exc)
        trailing: tuple[tuple[str, str], ...] = ()
        if isinstance(exc, RetryLater):
            message = f"{message}; retry after {exc.retry_after_s} s"
            trailing = ((RETRY_AFTER_KEY, str(exc.retry_after_s)),)
        return cls(grpc_code(exc), message, v2_status(exc.status), trailing)


def _not_serving(state: AppState) -> ShuttingDown | None:
    """Why no new call is taken now (starting, or draining), or None."""
    if state.batcher is None:
        detail = "the service is starting: retry shortly"
    elif state.draining():
        state.metrics.rejected_total.labels(reason="shutting_down").inc()
        detail = "the service is shutting down: this call was not computed"
    else:
        return None
    return ShuttingDown(detail, retry_after_s=_NOT_SERVING_RETRY_AFTER_S)


# ---- one call -------------------------------------------------------------------------------


def _metadata(context: aio.ServicerContext[Any, Any]) -> list[tuple[str, str]]:
    """The call's text metadata (binary "-bin" entries carry no key, trace or id)."""
    return [
        (key, value)
        for key, value in (context.invocation_metadata() or ())
        if isinstance(value, str)
    ]


def _request_id(metadata: Sequence[tuple[str, str]]) -> str:
    for key, value in metadata:
        if key == REQUEST_ID_KEY:
            if _SANE_REQUEST_ID.fullmatch(value):
                return value
            break
    return uuid.uuid4().hex


def _client(context: aio.ServicerContext[Any, Any]) -> str | None:
    """The peer's address without its port: "ipv4:127.0.0.1:5000" -> "127.0.0.1"."""
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or None
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]") or None
    return peer or None


class InferenceServicer:
    """The six calls, each a coroutine over one AppState."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        keys = state.settings.tenant_keys()
        self.keyring = Keyring(keys) if keys else None
        self.reads = ReadSlots(
            max_inflight_bytes=state.max_inflight_bytes,
            max_body_bytes=state.settings.max_body_bytes,
        )

    # ---- the frame every call shares ---------------------------------------------------------

    def _check_key(self, exchange: Exchange, metadata: Sequence[tuple[str, str]]) -> None:
        """Name the caller's tenant by its key; raises Unauthorized (UNAUTHENTICATED)."""
        if self.keyring is None:
            return
        presented = presented_keys(metadata)
        tenant = self.keyring.tenant_of(presented)
        if tenant is None:
            exchange.key_refused = True
            self.state.metrics.rejected_total.labels(reason="unauthorized").inc()
            raise refusal(presented)
        exchange.tenant = tenant

    async def _serve(
        self,
        method: str,
        context: aio.ServicerContext[Any, Any],
        answer: Callable[[Exchange], Awaitable[Any]],
        *,
        open_call: bool = False,
    ) -> Any:
        """Run `answer` as call `method`: its Exchange (key, request id, status), recorded."""
        metadata = _metadata(context)
        exchange = Exchange(
            door="grpc",
            method=method,
            path=f"/{SERVICE_NAME}/{method}",
            request_id=_request_id(metadata),
            started=time.monotonic(),
            client=_client(context),
            trace_context=metadata,
            route=ROUTE_PREFIX + method,
        )
        refused: _Refusal | None = None
        try:
            if not open_call:
                self._check_key(exchange, metadata)
            return await answer(exchange)
        except ServiceError as exc:
            refused = _Refusal.of(exc)
        except asyncio.CancelledError as exc:
            # The client cancelled, or its deadline passed: gRPC answers it (nobody reads it).
            exchange.status, exchange.error = CLIENT_CLOSED, exc
            exchange.grpc_code = _code(grpc.StatusCode.CANCELLED)
            raise
        except Exception as exc:  # a bug of ours: INTERNAL, the traceback in the log only
            logger.exception("unhandled error in %s (request_id=%s)", method, exchange.request_id)
            exchange.error = exc
            refused = _Refusal(
                grpc.StatusCode.INTERNAL,
                f"internal server error; request id {exchange.request_id}",
                500,
            )
        finally:
            trailing = [(REQUEST_ID_KEY, exchange.request_id)]
            if refused is not None:
                trailing += refused.trailing
                exchange.status, exchange.grpc_code = refused.http_status, _code(refused.code)
            elif exchange.status is None:
                exchange.status, exchange.grpc_code = 200, _code(grpc.StatusCode.OK)
                if exchange.phases is not None:  # where its time went, as REST's Server-Timing
                    trailing.append((SERVER_TIMING_KEY, exchange.phases.server_timing()))
            context.set_trailing_metadata(tuple(trailing))
            self.state.recorder.record(exchange)
        # Only a refusal gets here (every other way out returns or raises above). abort()
        # raises: gRPC ends the call with that status.
        assert refused is not None
        await context.abort(refused.code, refused.message)
        raise AssertionError("grpc.aio's abort() returned")

    # ---- the calls -----------------------------------------------------------------------

    async def server_live(
        self, request: pb.ServerLiveRequest, context: aio.ServicerContext[Any, Any]
    ) -> pb.ServerLiveResponse:
        async def answer(exchange: Exchange) -> Any:
            return pb.ServerLiveResponse(live=True)

        result: pb.ServerLiveResponse = await self._serve(
            "ServerLive", context, answer, open_call=True
        )
        return result

    async def server_ready(
        self, request: pb.ServerReadyRequest, context: aio.ServicerContext[Any, Any]
    ) -> pb.ServerReadyResponse:
        async def answer(exchange: Exchange) -> Any:
            return pb.ServerReadyResponse(ready=self.state.not_ready_reason() is None)

        result: pb.ServerReadyResponse = await self._serve(
            "ServerReady", context, answer, open_call=True
        )
        return result

    async def model_ready(
        self, request: pb.ModelReadyRequest, context: aio.ServicerContext[Any, Any]
    ) -> pb.ModelReadyResponse:
        async def answer(exchange: Exchange) -> Any:
            ours = request.name == MODEL_NAME and request.version in ("", MODEL_VERSION)
            return pb.ModelReadyResponse(ready=ours and self.state.not_ready_reason() is None)

        result: pb.ModelReadyResponse = await self._serve("ModelReady", context, answer)
        return result

    async def server_metadata(
        self, request: pb.ServerMetadataRequest, context: aio.ServicerContext[Any, Any]
    ) -> pb.ServerMetadataResponse:
        async def answer(exchange: Exchange) -> Any:
            return pb.ServerMetadataResponse(
                name=SERVER_NAME, version=VERSION, extensions=list(EXTENSIONS)
            )

        result: pb.ServerMetadataResponse = await self._serve("ServerMetadata", context, answer)
        return result

    async def model_metadata(
        self, request: pb.ModelMetadataRequest, context: aio.ServicerContext[Any, Any]
    ) -> pb.ModelMetadataResponse:
        async def answer(exchange: Exchange) -> Any:
            if request.name != MODEL_NAME or request.version not in ("", MODEL_VERSION):
                raise UnknownModel(
                    f"no model {request.name[:64]!r}"
                    + (f" version {request.version[:64]!r}" if request.version else "")
                    + f": this server serves the model {MODEL_NAME!r}, version {MODEL_VERSION!r}"
                )
            return MODEL_METADATA_MESSAGE

        result: pb.ModelMetadataResponse = await self._serve("ModelMetadata", context, answer)
        return result

    async def model_infer(self, requests: Any, context: aio.ServicerContext[Any, Any]) -> None:
        """ModelInfer: the message's bytes in (read once the call has its key; parsed by the
        door, off the loop when large), the serialized ModelInferResponse out, sent while it
        is still counted (service.grpc_limits)."""

        async def answer(exchange: Exchange) -> None:
            state = self.state
            not_serving = _not_serving(state)
            if not_serving is not None:
                raise not_serving
            settings = state.settings
            raw = await self.reads.read(
                context, timeout_s=settings.read_timeout_s, metrics=state.metrics
            )
            # The message counts against SDPA_MAX_INFLIGHT_BYTES with the HTTP door's
            # requests, then its answer too (reserved before compute), until it is sent.
            holding = Holding(state.inflight, len(raw), metrics=state.metrics)
            exchange.holding = holding
            try:
                exchange.deadline = _deadline(context)
                async with admitted(state, exchange):
                    # Its read phase was the message's read, before this.
                    exchange.received = time.monotonic()
                    served: Served[bytes] = await pipeline.run(GrpcInferDoor(raw), exchange, state)
                await send_answer(
                    context, served.answer, timeout_s=settings.send_timeout_s, metrics=state.metrics
                )
            finally:
                holding.release()

        await self._serve("ModelInfer", context, answer)


def _code(code: grpc.StatusCode) -> tuple[int, str]:
    """gRPC's status code as the Exchange records it: its number and its name."""
    number: int = code.value[0]
    return number, code.name


def _deadline(context: aio.ServicerContext[Any, Any]) -> float | None:
    """The call's gRPC deadline as a time.monotonic() instant (None: the client set none), which
    serving weighs with the request's `timeout` and SDPA_REQUEST_TIMEOUT_MS. (grpc-core reads
    grpc-timeout itself and keeps it out of the metadata: one it cannot parse ends the call
    INTERNAL in its HPACK parser before any handler runs, grpcio 1.85.)"""
    remaining_s = context.time_remaining()
    return None if remaining_s is None else time.monotonic() + remaining_s


def _model_metadata(metadata: Mapping[str, Any]) -> pb.ModelMetadataResponse:
    """REST's model metadata (service.api.v2.MODEL_METADATA) as its gRPC message."""

    def tensors(
        entries: Sequence[Mapping[str, Any]],
    ) -> list[pb.ModelMetadataResponse.TensorMetadata]:
        return [
            pb.ModelMetadataResponse.TensorMetadata(
                name=entry["name"], datatype=entry["datatype"], shape=entry["shape"]
            )
            for entry in entries
        ]

    return pb.ModelMetadataResponse(
        name=metadata["name"],
        versions=metadata["versions"],
        platform=metadata["platform"],
        inputs=tensors(metadata["inputs"]),
        outputs=tensors(metadata["outputs"]),
    )


MODEL_METADATA_MESSAGE: Final = _model_metadata(MODEL_METADATA)


# ---- the server -----------------------------------------------------------------------------


def generic_handler(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """inference.GRPCInferenceService's six methods. ModelInfer's message travels as bytes both
    ways (the door parses it, off the loop when large; its answer is serialized already)."""

    def unary(
        behavior: Callable[..., Any], request_type: Any, response_type: Any
    ) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            behavior,
            request_deserializer=request_type.FromString,
            response_serializer=response_type.SerializeToString,
        )

    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "ServerLive": unary(servicer.server_live, pb.ServerLiveRequest, pb.ServerLiveResponse),
            "ServerReady": unary(
                servicer.server_ready, pb.ServerReadyRequest, pb.ServerReadyResponse
            ),
            "ModelReady": unary(servicer.model_ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
            "ServerMetadata": unary(
                servicer.server_metadata, pb.ServerMetadataRequest, pb.ServerMetadataResponse
            ),
            "ModelMetadata": unary(
                servicer.model_metadata, pb.ModelMetadataRequest, pb.ModelMetadataResponse
            ),
            # Streaming on the server's side only (a unary call's bytes on the wire): the
            # message is read after the key, the answer sent while counted (grpc_limits).
            "ModelInfer": grpc.stream_stream_rpc_method_handler(servicer.model_infer),
        },
    )


def grpc_address(host: str, port: int) -> str:
    """host:port as gRPC reads it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def build_server(state: AppState, *, host: str, port: int) -> tuple[aio.Server, int]:
    """A grpc.aio server of the door on host:port (port 0: one the OS picks), bound but not
    started -> (server, the bound port). Raises OSError when the port cannot be bound (in use,
    or not allowed)."""
    settings = state.settings
    server = aio.server(
        options=server_options(settings), maximum_concurrent_rpcs=max_concurrent_rpcs(settings)
    )
    server.add_generic_rpc_handlers((generic_handler(InferenceServicer(state)),))
    address = grpc_address(host, port)
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError:  # grpcio's "Failed to bind to address ...", without the reason
        raise OSError(
            f"gRPC: cannot listen on {address} (the port is in use, or not allowed)"
        ) from None
    return server, bound
