"""The service's endpoints, each written once: arguments in, a `Call` out, no I/O.

`Endpoints` holds the public methods (attention, analyze, info, healthz, readyz) with their
signatures and documentation. Each describes its request as a `Call` (what to send, how to
read the answer) and hands a function that builds it to `_dispatch`, the only thing a subclass
supplies: `SDPAClient` sends the call and returns the result, `AsyncSDPAClient` returns a
coroutine that does (and builds nothing before it is awaited), and `RequestBuilder` returns the
Call itself, for a caller who sends it some other way.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, Literal, ParamSpec, TypeVar, cast

import httpx

from sdpa_client.bodies import (
    Causal,
    DiagnosticsLevel,
    StrategySpec,
    analyze_inputs,
    mask_fields,
    optional_float,
    priority_field,
    strategy_list,
    tensors,
)
from sdpa_client.codec import Encoding
from sdpa_client.errors import SDPAProtocolError
from sdpa_client.types import (
    AnalyzeResponse,
    AttentionResponse,
    parse_analyze_response,
    parse_attention_response,
)
from sdpa_client.v2 import INFER_PATH, build_infer_request, parse_infer_response

Protocol = Literal["v1", "v2"]
# The server's description, limits included (the client learns its body limit there).
INFO_PATH = "/v1/info"

T = TypeVar("T")
P = ParamSpec("P")
AttentionOut = TypeVar("AttentionOut")
AnalyzeOut = TypeVar("AnalyzeOut")
InfoOut = TypeVar("InfoOut")
ProbeOut = TypeVar("ProbeOut")


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One HTTP exchange, as data.

    Attributes:
        method: "GET" or "POST".
        path: e.g. "/v1/attention".
        body: the JSON object to POST (tensors already encoded), or None.
        read: turns the answer into the result.
        timeout_ms: the server-side deadline the body asks for (the client waits longer).
        request_id: sent as X-Request-ID.
        retryable: whether the request may be sent again (a pure computation may).
        answers: statuses other than 2xx that `read` turns into a result instead of an error.
        content: the bytes to POST instead of `body` (a v2 request with binary data).
        headers: more headers for this request (v2's Inference-Header-Content-Length).
    """

    method: Literal["GET", "POST"]
    path: str
    body: Mapping[str, Any] | None
    read: Callable[[httpx.Response], T]
    timeout_ms: float | None = None
    request_id: str | None = None
    retryable: bool = False
    answers: frozenset[int] = frozenset()
    content: bytes | None = None
    headers: Mapping[str, str] | None = None


def json_of(response: httpx.Response) -> Any:
    """The answer's JSON body.

    Raises:
        SDPAProtocolError: the body is not JSON.
    """
    try:
        return response.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise SDPAProtocolError(
            response.status_code, "Malformed response", f"response is not JSON ({exc})"
        ) from exc


def _attention_reader(
    protocol: Protocol, *, return_output: bool
) -> Callable[[httpx.Response], AttentionResponse]:
    """How an attention answer is read: v1's JSON or v2's, with or without its output."""
    if protocol == "v2":
        return lambda response: parse_infer_response(response, return_output=return_output)
    return lambda response: parse_attention_response(json_of(response), return_output=return_output)


def _read_analyze(response: httpx.Response) -> AnalyzeResponse:
    return parse_analyze_response(json_of(response))


def _read_info(response: httpx.Response) -> dict[str, Any]:
    payload = json_of(response)
    if not isinstance(payload, dict):
        raise SDPAProtocolError(200, "Malformed response", "info: not a JSON object")
    return payload


def _read_probe(response: httpx.Response) -> bool:
    return response.is_success


def _probe(path: str) -> Call[bool]:
    # A probe reports the state now: 503 is its "no", and it is never retried.
    return Call("GET", path, None, _read_probe, answers=frozenset({503}))


class Endpoints(Generic[AttentionOut, AnalyzeOut, InfoOut, ProbeOut]):
    """The endpoints of the service's API. The type parameters are what each kind of
    endpoint returns in a subclass: the result itself, a coroutine of it, or its Call.

    `protocol` says how `attention` travels: "v1" (POST /v1/attention, JSON) or "v2" (the Open
    Inference Protocol, POST /v2/models/attention/infer; binary tensor data unless the
    encoding is "json"). The other endpoints are v1's on either.
    """

    __slots__ = ()
    protocol: Protocol = "v1"

    def _dispatch(self, make: Callable[[], Call[Any]]) -> Any:
        """Realize the call that `make` builds (building it is part of the call: a coroutine
        builds its request only once awaited)."""
        raise NotImplementedError

    def attention(
        self,
        q: object,
        k: object,
        v: object,
        *,
        causal: Causal = False,
        key_lengths: object | None = None,
        key_padding_mask: object | None = None,
        attn_mask: object | None = None,
        scale: float | None = None,
        return_weights: bool = False,
        diagnostics: DiagnosticsLevel = "summary",
        timeout_ms: float | None = None,
        encoding: Encoding = "base64",
        request_id: str | None = None,
        temperature: float | None = None,
        tag: str | None = None,
        return_output: bool = True,
        priority: int | None = None,
    ) -> AttentionOut:
        """Compute softmax(q kᵀ · scale + masks) v on the server (POST /v1/attention).

        Tensors are numpy arrays (float16, float32, float64; bool for masks), nested lists, or
        torch tensors (bfloat16 too) when the caller has imported torch.

        Args:
            q: queries [..., H, N_q, D], any number of leading batch dims.
            k: keys [..., H_kv, N_kv, D]; H must be a multiple of H_kv (grouped-query
                attention: query head i uses kv head i // (H / H_kv)).
            v: values [..., H_kv, N_kv, D_v].
            causal: False; True or "top_left" (query i sees keys j <= i); "bottom_right"
                (query i sees keys j <= i + N_kv - N_q, as in KV-cache decoding).
            key_lengths: integers, one per sequence (or per head); keys j >= length are padding.
            key_padding_mask: booleans, True = padding, [..., N_kv] per sequence (or per head).
            attn_mask: boolean (True = may attend) or float (added to the scaled scores),
                broadcastable to [..., H, N_q, N_kv].
            scale: the factor on q kᵀ; None means 1/sqrt(D).
            return_weights: also return the attention weights [..., H, N_q, N_kv].
            diagnostics: "none"; "summary" (scalars and per-head arrays); "full" (adds per-row
                arrays).
            timeout_ms: the server's deadline for this request (a 504 after it); the client
                then waits for the answer at least timeout_ms + 5 s.
            encoding: "base64" (raw little-endian bytes, fast) or "json" (nested lists), for
                the request and the answer. With protocol "v2", "base64" means binary tensor
                data (raw bytes after a JSON header, no base64 at all).
            request_id: sent as X-Request-ID, to find this call in the server's log.
            temperature: T > 0 means scale = 1/(T·sqrt(D)); not together with scale.
            tag: labels the request's attention-health metrics on the server (1-64 of
                A-Z a-z 0-9 _ . : / -), e.g. "mymodel/layer3"; None = "default".
            return_output: False leaves the output out of the answer (the server neither
                encodes nor sends it), for a caller who wants the diagnostics (or weights)
                alone; the result's `output` is then None. v1 sends `return_output: false`
                (only then, so that a server older than the field still takes the request); v2
                names the outputs it wants, without "output".
            priority: the request's level among this tenant's own waiting requests (never
                ahead of another tenant's): 1 the highest, larger numbers lower, 0 the server's
                default; None sends none (the default). v1 sends the field "priority", v2 the
                request parameter "priority" (as tritonclient does). A level above the
                server's SDPA_PRIORITY_LEVELS is a 422 that names the field.

        Returns:
            An `AttentionResponse`: output [..., H, N_q, D_v] (None without return_output),
            weights, diagnostics and meta (from AsyncSDPAClient, a coroutine that returns it).
            On either protocol, diagnostics.per_head holds every per-head statistic.

        Raises:
            SDPAValidationError: 422, the server refused the inputs (shapes, masks, dtypes,
                NaN/Inf, limits); `.errors` names the fields at fault.
            SDPAAuthError: 401/403, missing or wrong API key.
            SDPAPayloadTooLarge: 413, the body is over the server's limit.
            SDPARateLimited: 429 (this tenant's share of the queue is full) once the retries
                are spent.
            SDPAUnavailable: 503 (queue full, draining) once the retries are spent.
            SDPATimeout: 504, the deadline passed, once the retries are spent.
            SDPAConnectionError: no answer (SDPAReadTimeout: none within the read timeout).
            SDPAProtocolError: a 2xx answer that cannot be read.
            TypeError: a tensor of a dtype the wire cannot carry, or a priority that is not
                an int, found before sending.
            ValueError: a negative priority, found before sending.
        """

        def make() -> Call[AttentionResponse]:
            read = _attention_reader(self.protocol, return_output=return_output)
            if self.protocol == "v2":
                content, headers = build_infer_request(
                    q, k, v, causal=causal, key_lengths=key_lengths,
                    key_padding_mask=key_padding_mask, attn_mask=attn_mask, scale=scale,
                    temperature=temperature, return_weights=return_weights,
                    diagnostics=diagnostics, timeout_ms=timeout_ms, binary=encoding == "base64",
                    tag=tag, return_output=return_output, priority=priority,
                )  # fmt: skip
                return Call(
                    "POST", INFER_PATH, None, read, timeout_ms=timeout_ms,
                    request_id=request_id, retryable=True, content=content, headers=headers,
                )  # fmt: skip
            body = {
                **tensors(encoding, q=q, k=k, v=v),
                "causal": causal,
                **mask_fields(key_lengths, key_padding_mask, attn_mask, encoding),
                "scale": optional_float(scale),
                **({} if temperature is None else {"temperature": float(temperature)}),
                "return_weights": bool(return_weights),
                "diagnostics": diagnostics,
                "response_encoding": encoding,
                "timeout_ms": optional_float(timeout_ms),
                **({} if tag is None else {"tag": tag}),
                **priority_field(priority),
                **({} if return_output else {"return_output": False}),
            }
            return Call(
                "POST", "/v1/attention", body, read,
                timeout_ms=timeout_ms, request_id=request_id, retryable=True,
            )  # fmt: skip

        return cast(AttentionOut, self._dispatch(make))

    def analyze(
        self,
        q: object | None = None,
        k: object | None = None,
        *,
        synthetic: Mapping[str, Any] | None = None,
        strategies: Sequence[StrategySpec] | None = None,
        causal: Causal = False,
        key_lengths: object | None = None,
        key_padding_mask: object | None = None,
        attn_mask: object | None = None,
        timeout_ms: float | None = None,
        encoding: Encoding = "base64",
        request_id: str | None = None,
        priority: int | None = None,
    ) -> AnalyzeOut:
        """Compare scalings of the attention scores on the server (POST /v1/analyze).

        Args:
            q: queries [..., H, N_q, D]; with k, or neither and `synthetic`.
            k: keys [..., H_kv, N_kv, D].
            synthetic: instead of q and k, Gaussian ones the server draws:
                {"n_q", "n_k", "d_k", "std", "seed"}.
            strategies: standard names ("none", "sqrt_dk", "dk", "dk_quarter", "two_sqrt_dk")
                and/or custom (name, divisor) pairs; None means the five standard ones.
            causal: as in `attention`.
            key_lengths: as in `attention`.
            key_padding_mask: as in `attention`.
            attn_mask: as in `attention`.
            timeout_ms: the server's deadline for this request.
            encoding: "base64" or "json", for q and k.
            request_id: sent as X-Request-ID.
            priority: as in `attention` (the body's field "priority"; None sends none).

        Returns:
            An `AnalyzeResponse`: d_k, raw score variance, the recommended divisor and the
            statistics of each strategy (from AsyncSDPAClient, a coroutine that returns it).

        Raises:
            ValueError: only one of q and k, neither q/k nor synthetic, or a negative priority
                (before sending).
            TypeError: a priority that is not an int (before sending).
            SDPAValidationError: 422, the server refused the inputs.
            SDPAAuthError: 401/403, missing or wrong API key.
            SDPARateLimited: 429 once the retries are spent.
            SDPAUnavailable: 503 once the retries are spent.
            SDPATimeout: 504 once the retries are spent.
            SDPAConnectionError: no answer.
            SDPAProtocolError: a 2xx answer that cannot be read.
        """

        def make() -> Call[AnalyzeResponse]:
            body = {
                **analyze_inputs(q, k, synthetic, encoding),
                **({} if strategies is None else {"strategies": strategy_list(strategies)}),
                "causal": causal,
                **mask_fields(key_lengths, key_padding_mask, attn_mask, encoding),
                **({} if timeout_ms is None else {"timeout_ms": float(timeout_ms)}),
                **priority_field(priority),
            }
            return Call(
                "POST", "/v1/analyze", body, _read_analyze,
                timeout_ms=timeout_ms, request_id=request_id, retryable=True,
            )  # fmt: skip

        return cast(AnalyzeOut, self._dispatch(make))

    def info(self) -> InfoOut:
        """Describe the server (GET /v1/info).

        Returns:
            The server's version, device, torch version, dtypes, limits and batching settings,
            as a dict (from AsyncSDPAClient, a coroutine that returns it).

        Raises:
            SDPAAuthError: 401/403, when the server wants a key for it.
            SDPARequestError: any other answer than 2xx (not retried), or no answer.
            SDPAProtocolError: an answer that is not a JSON object.
        """
        return cast(InfoOut, self._dispatch(lambda: Call("GET", INFO_PATH, None, _read_info)))

    def healthz(self) -> ProbeOut:
        """Ask whether the server process is alive (GET /healthz, liveness: 200 while it serves).

        A live server may still be warming up or draining: `readyz` says whether it takes work.

        Returns:
            True for 200, False for 503 (from AsyncSDPAClient, a coroutine that returns it). A
            probe reports the state now: it is never retried.

        Raises:
            SDPARequestError: any other status, or no answer (SDPAConnectionError).
        """
        return cast(ProbeOut, self._dispatch(lambda: _probe("/healthz")))

    def readyz(self) -> ProbeOut:
        """Ask whether the server takes work now (GET /readyz, readiness).

        Ready means warmed up (one attention call ran on its device), its batcher running, and
        not draining; a load balancer sends traffic to ready servers only.

        Returns:
            True when ready (200), False when not (503); from AsyncSDPAClient, a coroutine.

        Raises:
            SDPARequestError: any other status, or no answer; a probe is never retried.
        """
        return cast(ProbeOut, self._dispatch(lambda: _probe("/readyz")))


class RequestBuilder(
    Endpoints[Call[AttentionResponse], Call[AnalyzeResponse], Call[dict[str, Any]], Call[bool]]
):
    """The endpoints without I/O: each method returns the `Call` it would make."""

    __slots__ = ()

    def _dispatch(self, make: Callable[[], Call[Any]]) -> Call[Any]:
        return make()


def _body_builder(
    endpoint: Callable[Concatenate[RequestBuilder, P], Call[Any]],
) -> Callable[P, dict[str, Any]]:
    """A function with the endpoint's arguments that returns the body of its request."""
    builder = RequestBuilder()

    def build(*args: P.args, **kwargs: P.kwargs) -> dict[str, Any]:
        body = endpoint(builder, *args, **kwargs).body
        assert body is not None  # every POST has one
        return dict(body)

    name = endpoint.__name__
    signature = inspect.signature(endpoint)
    build.__name__ = build.__qualname__ = f"build_{name}_body"
    build.__doc__ = f"""The JSON body that `SDPAClient.{name}` sends, its tensors encoded.

    Takes the arguments of `SDPAClient.{name}` (request_id, a header, is not in the body).

    Returns:
        The body as a dict; `sdpa_client.encode_body` turns it into bytes.

    Raises:
        TypeError, ValueError: what `SDPAClient.{name}` raises before it sends anything.
    """
    # help() and IDEs show the endpoint's own parameters (without self), not *args/**kwargs.
    build.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=list(signature.parameters.values())[1:], return_annotation="dict[str, Any]"
    )
    return build


build_attention_body = _body_builder(RequestBuilder.attention)
build_analyze_body = _body_builder(RequestBuilder.analyze)
