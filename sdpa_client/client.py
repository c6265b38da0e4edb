"""The HTTP clients: `SDPAClient` (blocking) and `AsyncSDPAClient` (asyncio), over httpx.

    with SDPAClient("http://127.0.0.1:8000", api_key="...") as client:
        result = client.attention(q, k, v, causal=True, diagnostics="summary")
        result.output                       # np.ndarray [..., H, N_q, D_v]
        result.diagnostics.summary.entropy
        result.meta.batch_size              # how many requests the server batched this one with

Both have the same methods (`sdpa_client.calls.Endpoints`; the async ones return coroutines),
and the same retries (`sdpa_client.retry`); they differ only in how they send and sleep. Each
object keeps one httpx connection pool: create one client and reuse it, and close it (or use it
as a context manager).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Generic, Self, TypeVar

import httpx

from sdpa_client.calls import INFO_PATH, Call, Endpoints, Protocol
from sdpa_client.codec import encode_body
from sdpa_client.errors import FieldProblem, SDPAPayloadTooLarge
from sdpa_client.retry import Attempts, RetryPolicy
from sdpa_client.trace_context import trace_headers
from sdpa_client.types import AnalyzeResponse, AttentionResponse
from sdpa_client.version import __version__

DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=60.0, write=60.0, pool=10.0)
_READ_MARGIN_S = 5.0  # beyond a server-side timeout_ms, so that the server's 504 arrives first
# A body this large, sent while the server's body limit is unknown, first asks for it (GET
# /v1/info, once per client): uploading a body over the limit costs seconds before the 413
# (384 MB took 9 s), the question about a millisecond. Smaller bodies never ask: a 413 for
# them comes back as fast as the question would.
SIZE_CHECK_FROM_BYTES = 1 << 20

T = TypeVar("T")
HttpT = TypeVar("HttpT", bound=httpx.Client | httpx.AsyncClient)
TransportT = TypeVar("TransportT")
SleepT = TypeVar("SleepT")


def _checked_base_url(base_url: str) -> str:
    """base_url without a trailing slash, or ValueError now rather than at the first call."""
    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"base_url {base_url!r} is not a URL: {exc}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(
            f"base_url must look like http://host:port or https://host, got {base_url!r}"
        )
    return base_url.rstrip("/")


class _Connection(Generic[HttpT, TransportT, SleepT]):
    """What both clients hold: the settings, the httpx client, and how a Call becomes a request."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        headers: Mapping[str, str] | None = None,
        transport: TransportT | None = None,
        sleep: SleepT | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
        protocol: Protocol = "v1",
    ) -> None:
        """Open a connection pool to one server (connections are made on first use).

        Args:
            base_url: e.g. "http://127.0.0.1:8000".
            api_key: sent as "Authorization: Bearer <key>".
            timeout: seconds, or an httpx.Timeout (default: connect 5 s, read and write 60 s).
                A call with timeout_ms waits at least timeout_ms + 5 s for its answer.
            retry: the RetryPolicy (default: 4 attempts within 60 s); `NO_RETRY` sends once.
            headers: more headers for every request.
            transport: an httpx transport in place of the network (httpx.MockTransport in
                tests; an async one for AsyncSDPAClient).
            sleep: waits between retries in place of time.sleep (asyncio.sleep for
                AsyncSDPAClient), e.g. a fake that records the delays.
            rng: the source of retry jitter (a seeded random.Random for reproducible waits).
            clock: monotonic seconds, for the retries' total time budget.
            protocol: "v1" (default) or "v2": `attention` through the Open Inference Protocol
                (POST /v2/models/attention/infer) with binary tensor data, the fast path: no
                base64, and BF16 as its raw bits. The answer is the same AttentionResponse
                (its per-head statistics as the v2 outputs "<stat>_per_head").

        Raises:
            ValueError: a base_url that is not an http:// or https:// URL, or an unknown
                protocol.
        """
        if protocol not in ("v1", "v2"):
            raise ValueError(f"protocol must be 'v1' or 'v2', got {protocol!r}")
        self.protocol = protocol
        self.base_url = _checked_base_url(base_url)
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self.retry = retry if retry is not None else RetryPolicy()
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._clock = clock
        sent_headers = {"user-agent": f"sdpa-client/{__version__}"}
        if api_key:
            sent_headers["authorization"] = f"Bearer {api_key}"
        sent_headers.update(headers or {})
        self._http: HttpT = self._open(transport, sent_headers)
        # The server's body limit (/v1/info limits.max_body_bytes), once an info answer said it
        # (the caller's info(), or the client's own question before a large body).
        self.max_body_bytes: int | None = None
        self._limit_asked = False

    def _open(self, transport: TransportT | None, headers: dict[str, str]) -> HttpT:
        raise NotImplementedError

    def _prepare(self, call: Call[Any]) -> tuple[httpx.Request, Attempts]:
        """The request to send (built once: a retry repeats the same bytes) and its attempts."""
        # The caller's current trace context (traceparent), when opentelemetry is installed:
        # read here, in the caller's thread or task, where its span is current.
        headers = trace_headers()
        content = call.content
        if call.body is not None:
            headers["content-type"] = "application/json"
            content = encode_body(call.body)
        headers.update(call.headers or {})
        if call.request_id is not None:
            headers["x-request-id"] = call.request_id
        request = self._http.build_request(
            call.method, call.path, content=content, headers=headers,
            timeout=self._timeout_for(call.timeout_ms),
        )  # fmt: skip
        attempts = Attempts(
            self.retry, retryable=call.retryable, answers=call.answers, rng=self._rng,
            clock=self._clock,
            deadline_s=None if call.timeout_ms is None else call.timeout_ms / 1000.0,
        )  # fmt: skip
        return request, attempts

    def _should_ask_limit(self, request: httpx.Request) -> bool:
        """Whether to ask the server's body limit before sending `request`: a large body, and
        this client never asked (a server that did not say is not asked again)."""
        return not self._limit_asked and _body_size(request) >= SIZE_CHECK_FROM_BYTES

    def _limit_request(self) -> httpx.Request:
        self._limit_asked = True
        return self._http.build_request("GET", "/v1/info", headers=trace_headers())

    def _learn_limit(self, answer: object) -> None:
        """Keep limits.max_body_bytes from an info answer (a dict, or its httpx.Response);
        anything else (an error, no answer, an older server) leaves the limit unknown."""
        if isinstance(answer, httpx.Response):
            if not answer.is_success:
                return
            try:
                answer = answer.json()
            except (ValueError, UnicodeDecodeError):
                return
        limits = answer.get("limits") if isinstance(answer, dict) else None
        value = limits.get("max_body_bytes") if isinstance(limits, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            self.max_body_bytes = value
            self._limit_asked = True

    def _check_size(self, call: Call[Any], request: httpx.Request) -> None:
        """SDPAPayloadTooLarge, as the server's 413 would be, for a body over the server's
        known limit: its bytes are never sent."""
        limit, size = self.max_body_bytes, _body_size(request)
        if limit is None or size <= limit:
            return
        split = "split it into smaller requests (fewer batch items or shorter sequences)"
        lists = call.body is not None and any(
            _is_json_lists(call.body.get(name)) for name in ("q", "k", "v")
        )
        advice = f"encoding='base64' is about 3x smaller, or {split}" if lists else split
        msg = (
            f"request body of {size} bytes exceeds the server's limit of {limit} bytes "
            f"(/v1/info limits.max_body_bytes); not sent: {advice}"
        )
        err = SDPAPayloadTooLarge(
            413, "Payload too large", msg,
            errors=[FieldProblem(loc=("body",), msg=msg, type="too_large")], attempts=0,
        )  # fmt: skip
        err.limit_bytes, err.body_bytes = limit, size
        raise err

    def _timeout_for(self, timeout_ms: float | None) -> httpx.Timeout:
        if timeout_ms is None or self.timeout.read is None:
            return self.timeout
        read = max(self.timeout.read, timeout_ms / 1000.0 + _READ_MARGIN_S)
        return httpx.Timeout(
            connect=self.timeout.connect, read=read, write=self.timeout.write,
            pool=self.timeout.pool,
        )  # fmt: skip


def _is_json_lists(tensor: object) -> bool:
    # encoding="json": {"dtype", "shape", "data": nested lists} (or bare lists); base64's
    # {"dtype", "shape", "b64"} is already the compact one.
    return isinstance(tensor, list) or (isinstance(tensor, dict) and "data" in tensor)


def _body_size(request: httpx.Request) -> int:
    # httpx sets Content-Length for a body given as bytes (every Call's).
    value = request.headers.get("content-length", "0")
    return int(value) if value.isdigit() else 0


class SDPAClient(
    Endpoints[AttentionResponse, AnalyzeResponse, dict[str, Any], bool],
    _Connection[httpx.Client, httpx.BaseTransport, Callable[[float], None]],
):
    """Blocking client of sdpa-service; its methods wait for the answer."""

    def _open(self, transport: httpx.BaseTransport | None, headers: dict[str, str]) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url, timeout=self.timeout, headers=headers, transport=transport
        )

    def _dispatch(self, make: Callable[[], Call[T]]) -> T:
        call = make()
        request, attempts = self._prepare(call)
        if self._should_ask_limit(request):
            self._learn_limit(self._try(self._limit_request()))
        self._check_size(call, request)
        sleep = self._sleep or time.sleep
        while (delay := attempts.judge(self._try(request))) is not None:
            sleep(delay)
        result = call.read(attempts.answer)
        if call.path == INFO_PATH:
            self._learn_limit(result)
        return result

    def _try(self, request: httpx.Request) -> httpx.Response | httpx.TransportError:
        try:
            return self._http.send(request)
        except httpx.TransportError as exc:
            return exc

    def close(self) -> None:
        """Close the connection pool; the client cannot be used after it.

        Returns:
            None.

        Raises:
            Nothing of its own; closing twice is harmless.
        """
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncSDPAClient(
    Endpoints[
        Coroutine[Any, Any, AttentionResponse],
        Coroutine[Any, Any, AnalyzeResponse],
        Coroutine[Any, Any, dict[str, Any]],
        Coroutine[Any, Any, bool],
    ],
    _Connection[httpx.AsyncClient, httpx.AsyncBaseTransport, Callable[[float], Awaitable[None]]],
):
    """asyncio client of sdpa-service; its methods return coroutines (await them)."""

    def _open(
        self, transport: httpx.AsyncBaseTransport | None, headers: dict[str, str]
    ) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base_url, timeout=self.timeout, headers=headers, transport=transport
        )

    def _dispatch(self, make: Callable[[], Call[T]]) -> Coroutine[Any, Any, T]:
        return self._exchange(make)

    async def _exchange(self, make: Callable[[], Call[T]]) -> T:
        call = make()
        request, attempts = self._prepare(call)
        if self._should_ask_limit(request):
            self._learn_limit(await self._try(self._limit_request()))
        self._check_size(call, request)
        sleep = self._sleep or asyncio.sleep
        while (delay := attempts.judge(await self._try(request))) is not None:
            await sleep(delay)
        result = call.read(attempts.answer)
        if call.path == INFO_PATH:
            self._learn_limit(result)
        return result

    async def _try(self, request: httpx.Request) -> httpx.Response | httpx.TransportError:
        try:
            return await self._http.send(request)
        except httpx.TransportError as exc:
            return exc

    async def aclose(self) -> None:
        """Close the connection pool (a coroutine); the client cannot be used after it.

        Returns:
            None, once the connections are closed.

        Raises:
            Nothing of its own; closing twice is harmless.
        """
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
