"""The sender of a load test: POSTs one pre-encoded payload, as fast as the event loop allows."""

from __future__ import annotations

import ssl

import httpx

from sdpa_client.loadgen.payloads import Payload
from sdpa_client.trace_context import trace_headers
from sdpa_client.version import __version__


class HttpSender:
    """POSTs one payload; the response body is read in full, then discarded.

    One single-connection httpx.AsyncClient per concurrent request (created on first need, then
    reused with keep-alive), rather than one client with a pool of N: httpcore 1.0's pool does
    work linear in its connections and queued requests on every request (encode/httpx#3215,
    encode/httpcore#1035; measured here with httpcore 1.0.9 against a no-op endpoint: 1.4 ms of
    client CPU per request with one pool of 16 connections, 0.7 ms with 16 pools of one), which
    made the generator, not the server, the limit. A pool of one connection stays on the fast
    path.
    """

    def __init__(
        self, base_url: str, payload: Payload, *, api_key: str | None = None,
        timeout_s: float = 60.0, transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:  # fmt: skip
        self._base_url = base_url.rstrip("/")
        self._path = payload.path
        self._body = payload.body
        self._extra_headers = dict(payload.headers) or None
        self._timeout = httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))
        self._headers = {
            "content-type": "application/json",
            "user-agent": f"sdpa-loadtest/{__version__}",
        }
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._idle: list[httpx.AsyncClient] = []
        self._all: list[httpx.AsyncClient] = []
        # httpx builds an SSL context per client unless given one (tens of ms of CPU each,
        # even for http:// URLs): share one.
        self._ssl = ssl.create_default_context()
        self._transport = transport  # in place of the network (tests: the app in process)

    def _client(self) -> httpx.AsyncClient:
        if self._idle:
            return self._idle.pop()
        client = httpx.AsyncClient(
            base_url=self._base_url,
            timeout=self._timeout,
            headers=self._headers,
            verify=self._ssl,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            transport=self._transport,
        )
        self._all.append(client)
        return client

    async def __call__(self) -> int:
        client = self._client()
        headers = self._extra_headers
        # The trace context current in the task that sends (a copy of the one run_load was
        # called in), when opentelemetry is installed: the sdpa-loadtest command has none.
        trace = trace_headers()
        if trace:
            headers = {**(headers or {}), **trace}
        try:
            response = await client.post(self._path, content=self._body, headers=headers)
            return response.status_code
        finally:
            self._idle.append(client)

    @property
    def connections(self) -> int:
        return len(self._all)

    async def aclose(self) -> None:
        clients, self._all, self._idle = self._all, [], []
        for client in clients:
            await client.aclose()

    async def __aenter__(self) -> HttpSender:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
