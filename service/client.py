"""HTTP client for sdpa-service: numpy (or torch) tensors in, numpy arrays out.

    with SDPAClient("http://127.0.0.1:8000", api_key="...") as client:
        result = client.attention(q, k, v, causal=True, diagnostics="summary")
        result.output            # np.ndarray [..., H, N_q, D_v]
        result.diagnostics.summary.entropy
        result.meta.batch_size   # how many requests the server batched this one with

`AsyncSDPAClient` has the same methods as coroutines. Both keep one httpx connection pool per
client object (create one client and reuse it; close it, or use it as a context manager).

Tensors: numpy arrays (float16, float32, float64; bool for masks) and torch tensors when torch
is already imported by the caller. This module never imports torch: it looks for
``sys.modules["torch"]``, so a numpy-only user does not pay for it. numpy has no bfloat16:
a bfloat16 torch tensor travels as its raw 16-bit patterns with dtype "bfloat16", and a
bfloat16 response is returned as float32 (every bfloat16 value is exactly a float32 value).

Encoding: "base64" (the default) sends little-endian bytes, and asks for the response in the same
encoding; "json" sends nested lists. Arrays decoded from base64 are read-only views of the
response bytes (``np.array(result.output)`` gives a writable copy).

Errors: every non-2xx answer becomes an `SDPAError` subclass carrying the problem+json fields
(status, title, detail, errors with their `loc`), e.g. `SDPAValidationError` for 422. Transport
failures become `SDPAConnectionError`.

Retries: /v1/attention and /v1/analyze are pure functions of their input, so repeating them is
safe. 503 (queue full, draining) and 504 (deadline passed before compute) and connection
failures are retried with exponential backoff and jitter, honouring Retry-After, within
`RetryPolicy.max_attempts` and `RetryPolicy.max_total_s`. A client-side read timeout is not
retried: the server may still be computing, and a retry would double its load.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import json
import math
import random
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any, Literal, TypeAlias

import httpx
import numpy as np
import numpy.typing as npt

__all__ = [
    "AsyncSDPAClient",
    "AttentionResult",
    "Diagnostics",
    "DiagnosticsSummary",
    "FieldError",
    "ResponseMeta",
    "RetryPolicy",
    "SDPAAuthError",
    "SDPAClient",
    "SDPAClientError",
    "SDPAConnectionError",
    "SDPAError",
    "SDPAPayloadTooLarge",
    "SDPAProtocolError",
    "SDPAReadTimeout",
    "SDPAServerError",
    "SDPATimeout",
    "SDPAUnavailable",
    "SDPAUnsupportedMediaType",
    "SDPAValidationError",
    "ScalingReport",
    "StrategyResult",
    "build_analyze_body",
    "build_attention_body",
    "decode_tensor",
    "encode_body",
    "encode_tensor",
]

CLIENT_VERSION = "0.1.0"

Encoding: TypeAlias = Literal["base64", "json"]
DiagnosticsLevel: TypeAlias = Literal["none", "summary", "full"]
Causal: TypeAlias = bool | Literal["top_left", "bottom_right"]
AnyArray: TypeAlias = npt.NDArray[Any]

# Wire dtype name -> little-endian numpy dtype. bfloat16 is handled separately (numpy has none).
_WIRE_TO_NUMPY: dict[str, np.dtype[Any]] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "bool": np.dtype("|b1"),
}
_NUMPY_TO_WIRE: dict[str, str] = {"float16": "float16", "float32": "float32",
                                  "float64": "float64", "bool": "bool"}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FieldError:
    """One field-level problem of an error response; `loc` names the field, e.g.
    ("body", "k", "shape")."""

    loc: tuple[str | int, ...]
    msg: str
    type: str | None = None


class SDPAError(Exception):
    """Base of every error this client raises. `status` is None for transport failures."""

    def __init__(
        self,
        status: int | None,
        title: str,
        detail: str,
        *,
        errors: Sequence[FieldError] = (),
        problem_type: str = "about:blank",
        retry_after_s: float | None = None,
        request_id: str | None = None,
        attempts: int = 1,
    ) -> None:
        self.status = status
        self.title = title
        self.detail = detail
        self.errors: list[FieldError] = list(errors)
        self.problem_type = problem_type
        self.retry_after_s = retry_after_s
        self.request_id = request_id
        self.attempts = attempts
        super().__init__(self._message())

    def __reduce__(self) -> tuple[Any, ...]:
        # Exception pickles as cls(*args); ours take keyword-only fields (multiprocessing,
        # concurrent.futures and pytest-xdist pickle exceptions).
        return (_rebuild_error, (type(self), self.__dict__.copy()))

    def _message(self) -> str:
        head = f"{self.status} {self.title}" if self.status is not None else self.title
        text = f"{head}: {self.detail}" if self.detail else head
        if self.errors:
            shown = "; ".join(f"{'.'.join(map(str, e.loc))}: {e.msg}" for e in self.errors[:3])
            more = f" (+{len(self.errors) - 3} more)" if len(self.errors) > 3 else ""
            text = f"{text} [{shown}{more}]"
        return text


def _rebuild_error(cls: type[SDPAError], state: dict[str, Any]) -> SDPAError:
    err = cls.__new__(cls)
    err.__dict__.update(state)
    Exception.__init__(err, err._message())
    return err


class SDPAClientError(SDPAError):
    """4xx: the request was wrong; repeating it unchanged will fail again."""


class SDPAAuthError(SDPAClientError):
    """401/403: missing or wrong API key."""


class SDPAPayloadTooLarge(SDPAClientError):
    """413: the body exceeds the server's SDPA_MAX_BODY_BYTES."""


class SDPAUnsupportedMediaType(SDPAClientError):
    """415: the body was not sent as JSON."""


class SDPAValidationError(SDPAClientError):
    """400/422: shapes, masks, dtypes, non-finite values or limits; see `.errors`."""


class SDPAServerError(SDPAError):
    """5xx."""


class SDPAUnavailable(SDPAServerError):
    """503: queue full or server draining; `.retry_after_s` says when to come back."""


class SDPATimeout(SDPAServerError):
    """504: the request's deadline passed before it was computed."""


class SDPAConnectionError(SDPAError):
    """No HTTP answer: connection refused or reset, DNS, write or connect timeout."""


class SDPAReadTimeout(SDPAConnectionError):
    """The server accepted the request but did not answer within the client's read timeout."""


class SDPAProtocolError(SDPAError):
    """A 2xx answer this client cannot read (not JSON, or a field missing or malformed)."""


_STATUS_CLASSES: dict[int, type[SDPAError]] = {
    400: SDPAValidationError,
    401: SDPAAuthError,
    403: SDPAAuthError,
    413: SDPAPayloadTooLarge,
    415: SDPAUnsupportedMediaType,
    422: SDPAValidationError,
    503: SDPAUnavailable,
    504: SDPATimeout,
}


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Retry-After as seconds from now: delta-seconds or an HTTP-date (RFC 9110 §10.2.3).

    None when absent or unreadable; a date in the past gives 0.
    """
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(0.0, seconds) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT; obsolete forms may parse naive
        when = when.replace(tzinfo=UTC)
    reference = now or datetime.now(UTC)
    return max(0.0, (when - reference).total_seconds())


def error_from_response(response: httpx.Response, *, attempts: int = 1) -> SDPAError:
    """The typed exception for a non-2xx response (problem+json or anything else)."""
    status = response.status_code
    title = response.reason_phrase or "HTTP error"
    detail = ""
    problem_type = "about:blank"
    errors: list[FieldError] = []
    try:
        payload = response.json()
    except (ValueError, UnicodeDecodeError):
        payload = None
        detail = response.text[:500]
    if isinstance(payload, dict):
        title = str(payload.get("title") or title)
        detail = str(payload.get("detail") or "")
        problem_type = str(payload.get("type") or problem_type)
        for item in payload.get("errors") or ():
            if isinstance(item, dict):
                loc = item.get("loc") or ()
                errors.append(
                    FieldError(
                        loc=tuple(p if isinstance(p, int) else str(p) for p in loc),
                        msg=str(item.get("msg", "")),
                        type=str(item["type"]) if item.get("type") is not None else None,
                    )
                )
    cls = _STATUS_CLASSES.get(status)
    if cls is None:
        cls = (
            SDPAClientError
            if 400 <= status < 500
            else SDPAServerError
            if status >= 500
            else SDPAError
        )
    return cls(
        status,
        title,
        detail,
        errors=errors,
        problem_type=problem_type,
        retry_after_s=parse_retry_after(response.headers.get("retry-after")),
        request_id=response.headers.get("x-request-id"),
        attempts=attempts,
    )


def _transport_error(exc: httpx.TransportError, *, attempts: int) -> SDPAConnectionError:
    cls = SDPAReadTimeout if isinstance(exc, httpx.ReadTimeout) else SDPAConnectionError
    name = type(exc).__name__
    detail = str(exc) or name
    return cls(None, name, detail, attempts=attempts)


# --------------------------------------------------------------------------------------------
# Retry policy (pure: the clients own the sleeping and the clock)
# --------------------------------------------------------------------------------------------

# Failures that happen before the server could have started the work, or that lose the answer
# of a pure computation; ReadTimeout is deliberately absent (see the module docstring).
_RETRYABLE_TRANSPORT = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
    httpx.PoolTimeout,
)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded retries with exponential backoff and jitter.

    Attempt n (n = 1 after the first failure) waits `backoff_initial_s * multiplier**(n-1)`
    capped at `backoff_max_s`, scaled by a random factor in [1 - jitter, 1]; a Retry-After
    header is a floor on the wait, spread upward by at most `retry_after_spread` so clients
    told the same value do not return together. No wait may end later than `max_total_s` after
    the first attempt started: the last error is raised instead.
    """

    max_attempts: int = 4
    backoff_initial_s: float = 0.1
    backoff_multiplier: float = 2.0
    backoff_max_s: float = 5.0
    jitter: float = 1.0
    retry_after_spread: float = 0.1
    max_total_s: float = 60.0
    retry_statuses: frozenset[int] = frozenset({503, 504})
    retry_connection_errors: bool = True

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError("jitter must be in [0, 1]")
        if self.backoff_initial_s < 0 or self.backoff_max_s < 0 or self.max_total_s < 0:
            raise ValueError("backoff and total times must be >= 0")

    def delay_s(self, retry_number: int, retry_after_s: float | None, rng: random.Random) -> float:
        """Seconds to wait before retry number `retry_number` (1-based)."""
        base = min(
            self.backoff_max_s,
            self.backoff_initial_s * self.backoff_multiplier ** (retry_number - 1),
        )
        delay = base * (1.0 - self.jitter * rng.random())
        if retry_after_s is not None:
            floor = retry_after_s * (1.0 + self.retry_after_spread * rng.random())
            delay = max(delay, floor)
        return delay

    def should_retry_status(self, status: int) -> bool:
        return status in self.retry_statuses

    def should_retry_transport(self, exc: httpx.TransportError) -> bool:
        return self.retry_connection_errors and isinstance(exc, _RETRYABLE_TRANSPORT)


NO_RETRY = RetryPolicy(max_attempts=1)


# --------------------------------------------------------------------------------------------
# Tensors on the wire
# --------------------------------------------------------------------------------------------


def _torch_module() -> Any | None:
    # Only a torch the caller already imported: importing it here would cost seconds and memory.
    return sys.modules.get("torch")


def _is_torch_tensor(x: object) -> bool:
    torch = _torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def _to_numpy(x: object, *, param: str, default_dtype: str = "float32") -> tuple[str, AnyArray]:
    """(wire dtype, numpy array) for a tensor argument.

    For "bfloat16" the array holds the raw uint16 bit patterns.
    """
    if _is_torch_tensor(x):
        torch = _torch_module()
        assert torch is not None
        t = x.detach()  # type: ignore[attr-defined]
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            # Reinterpret, not convert: the bits of each bfloat16 are sent unchanged.
            return "bfloat16", t.view(torch.int16).numpy().view(np.uint16)
        arr = t.resolve_conj().resolve_neg().numpy()
    elif isinstance(x, np.ndarray):
        arr = x
    else:
        # Plain (nested) lists or scalars: floats as float32 and booleans as bool, as the wire
        # reads a bare list.
        arr = np.asarray(x)
        if arr.dtype != np.bool_:
            arr = arr.astype(default_dtype)
    wire = _NUMPY_TO_WIRE.get(arr.dtype.name)
    if wire is None:
        raise TypeError(
            f"{param}: dtype {arr.dtype} cannot be sent; use float16, float32, float64 "
            "(or bool for masks), or a bfloat16 torch tensor"
        )
    return wire, arr


def encode_tensor(
    x: object, *, encoding: Encoding = "base64", param: str = "tensor"
) -> dict[str, Any]:
    """The wire object of one tensor: {"dtype", "shape", "b64"} or {"dtype", "shape", "data"}."""
    wire, arr = _to_numpy(x, param=param)
    shape = [int(s) for s in arr.shape]
    if encoding == "base64":
        if wire == "bfloat16":
            raw = np.ascontiguousarray(arr, dtype="<u2").tobytes()
        else:
            raw = np.ascontiguousarray(arr, dtype=_WIRE_TO_NUMPY[wire]).tobytes()
        return {"dtype": wire, "shape": shape, "b64": base64.b64encode(raw).decode("ascii")}
    if encoding == "json":
        values = _bf16_bits_to_float32(arr).tolist() if wire == "bfloat16" else arr.tolist()
        return {"dtype": wire, "shape": shape, "data": values}
    raise ValueError(f"encoding must be 'base64' or 'json', got {encoding!r}")


def _bf16_bits_to_float32(bits: AnyArray) -> npt.NDArray[np.float32]:
    # A bfloat16 is the top half of a float32: shift the 16 bits into place.
    widened = bits.astype(np.uint32) << np.uint32(16)
    return widened.view(np.float32)


def decode_tensor(obj: object, *, param: str = "tensor", null_as: float = math.nan) -> AnyArray:
    """A numpy array from a wire tensor (b64 object, data object or bare nested list).

    bfloat16 comes back as float32. In "data", null (the JSON lists encoding of a non-finite
    number) becomes `null_as`.
    """
    arr: AnyArray
    if isinstance(obj, list):
        arr = np.array(obj, dtype=np.float64)
        return _replace_nan(arr, null_as)
    if not isinstance(obj, dict):
        raise SDPAProtocolError(None, "Malformed response", f"{param}: not a tensor object")
    try:
        dtype = str(obj["dtype"])
        shape = tuple(int(s) for s in obj["shape"]) if obj.get("shape") is not None else None
        if "b64" in obj:
            raw = base64.b64decode(obj["b64"], validate=True)
            if dtype == "bfloat16":
                arr = _bf16_bits_to_float32(np.frombuffer(raw, dtype="<u2"))
            else:
                arr = np.frombuffer(raw, dtype=_WIRE_TO_NUMPY[dtype])
            if shape is None:
                raise KeyError("shape")
            return arr.reshape(shape)
        np_dtype: Any = np.float32 if dtype == "bfloat16" else _WIRE_TO_NUMPY[dtype]
        arr = np.array(obj["data"], dtype=np_dtype)
        if shape is not None:
            arr = arr.reshape(shape)
        return _replace_nan(arr, null_as) if arr.dtype.kind == "f" else arr
    except (KeyError, ValueError, TypeError) as exc:
        raise SDPAProtocolError(
            None, "Malformed response", f"{param}: cannot decode tensor ({exc!r})"
        ) from exc


def _replace_nan(arr: AnyArray, value: float) -> AnyArray:
    if not math.isnan(value) and arr.dtype.kind == "f":
        arr = np.where(np.isnan(arr), np.asarray(value, dtype=arr.dtype), arr)
    return arr


# --------------------------------------------------------------------------------------------
# Request bodies
# --------------------------------------------------------------------------------------------


def _int_list(x: object, *, param: str) -> Any:
    if _is_torch_tensor(x):
        return x.tolist()  # type: ignore[attr-defined]
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{param}: expected integers, got dtype {arr.dtype}")
    return arr.tolist()


def _bool_tensor(x: object, *, param: str, encoding: Encoding) -> dict[str, Any]:
    wire, _ = _to_numpy(x, param=param)
    if wire != "bool":
        raise TypeError(f"{param}: expected a boolean mask, got dtype {wire}")
    return encode_tensor(x, encoding=encoding, param=param)


def _mask_fields(
    *,
    key_lengths: object | None,
    key_padding_mask: object | None,
    attn_mask: object | None,
    encoding: Encoding,
) -> dict[str, Any]:
    return {
        "key_lengths": None if key_lengths is None else _int_list(key_lengths, param="key_lengths"),
        "key_padding_mask": None
        if key_padding_mask is None
        else _bool_tensor(key_padding_mask, param="key_padding_mask", encoding=encoding),
        "attn_mask": None
        if attn_mask is None
        else encode_tensor(attn_mask, encoding=encoding, param="attn_mask"),
    }


def build_attention_body(
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
) -> dict[str, Any]:
    """The JSON object of a POST /v1/attention request (DESIGN.md "HTTP API (v1)")."""
    return {
        "q": encode_tensor(q, encoding=encoding, param="q"),
        "k": encode_tensor(k, encoding=encoding, param="k"),
        "v": encode_tensor(v, encoding=encoding, param="v"),
        "causal": causal,
        **_mask_fields(
            key_lengths=key_lengths,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            encoding=encoding,
        ),
        "scale": None if scale is None else float(scale),
        "return_weights": bool(return_weights),
        "diagnostics": diagnostics,
        "response_encoding": encoding,
        "timeout_ms": None if timeout_ms is None else float(timeout_ms),
    }


def build_analyze_body(
    q: object | None = None,
    k: object | None = None,
    *,
    synthetic: Mapping[str, Any] | None = None,
    strategies: Sequence[str | tuple[str, float]] | None = None,
    causal: Causal = False,
    key_lengths: object | None = None,
    key_padding_mask: object | None = None,
    attn_mask: object | None = None,
    timeout_ms: float | None = None,
    encoding: Encoding = "base64",
) -> dict[str, Any]:
    """The JSON object of a POST /v1/analyze request: q and k, or `synthetic`."""
    if (q is None) != (k is None):
        raise ValueError("analyze: give both q and k, or neither (with synthetic=...)")
    if q is None and synthetic is None:
        raise ValueError("analyze: give q and k, or synthetic={'n_q': ..., 'd_k': ...}")
    body: dict[str, Any] = {}
    if q is not None:
        body["q"] = encode_tensor(q, encoding=encoding, param="q")
        body["k"] = encode_tensor(k, encoding=encoding, param="k")
    if synthetic is not None:
        body["synthetic"] = dict(synthetic)
    if strategies is not None:
        body["strategies"] = [
            s if isinstance(s, str) else {"name": s[0], "divisor": float(s[1])} for s in strategies
        ]
    body["causal"] = causal
    body.update(
        _mask_fields(
            key_lengths=key_lengths,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            encoding=encoding,
        )
    )
    if timeout_ms is not None:
        body["timeout_ms"] = float(timeout_ms)
    return body


# Below this, a b64 string goes through json.dumps like any other value.
_SPLICE_MIN_CHARS = 4096


def encode_body(body: Mapping[str, Any]) -> bytes:
    """Compact JSON bytes. NaN/Infinity pass through so the server answers them with its 422.

    Large base64 strings are spliced in as bytes instead of going through json.dumps, which
    scans every character for escapes (base64 has none): for an 8 MiB body that is about two
    thirds of the encoding time.
    """
    blobs: list[bytes] = []
    marker = f"@splice-{uuid.uuid4().hex}@"

    def swap(value: Any) -> Any:
        if isinstance(value, dict):
            b64 = value.get("b64")
            if isinstance(b64, str) and len(b64) >= _SPLICE_MIN_CHARS:
                blobs.append(b64.encode("ascii"))
                return {**value, "b64": f"{marker}{len(blobs) - 1}{marker}"}
            return {k: swap(v) for k, v in value.items()}
        return value

    skeleton = json.dumps({k: swap(v) for k, v in body.items()}, separators=(",", ":"))
    if not blobs:
        return skeleton.encode("utf-8")
    # "text@m@0@m@text@m@1@m@text": even parts are JSON text, odd parts blob indices.
    parts = skeleton.split(marker)
    out: list[bytes] = []
    for i, part in enumerate(parts):
        out.append(blobs[int(part)] if i % 2 else part.encode("utf-8"))
    return b"".join(out)


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """How the server ran the request (the response's "meta")."""

    path: str | None
    backend: str | None
    device: str | None
    dtype: str | None
    batch_size: int | None
    queue_ms: float | None
    compute_ms: float | None
    request_id: str | None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: object) -> ResponseMeta:
        data = dict(obj) if isinstance(obj, dict) else {}
        known = {f.name for f in fields(cls)} - {"extra"}

        def opt(name: str, conv: Callable[[Any], Any]) -> Any:
            value = data.get(name)
            return None if value is None else conv(value)

        return cls(
            path=opt("path", str),
            backend=opt("backend", str),
            device=opt("device", str),
            dtype=opt("dtype", str),
            batch_size=opt("batch_size", int),
            queue_ms=opt("queue_ms", float),
            compute_ms=opt("compute_ms", float),
            request_id=opt("request_id", str),
            extra={k: v for k, v in data.items() if k not in known},
        )


@dataclass(frozen=True, slots=True)
class DiagnosticsSummary:
    """Scalar diagnostics pooled over the request (DESIGN.md "Diagnostics")."""

    entropy: float
    normalized_entropy: float
    effective_keys: float
    max_weight: float
    saturated_fraction: float
    score_mean_raw: float
    score_variance_raw: float
    score_variance_scaled: float
    score_abs_max_scaled: float
    grad_health: float
    jacobian_fro: float
    masked_rows: int
    extra: Mapping[str, Any] = field(default_factory=dict)


_SUMMARY_FIELDS = tuple(f.name for f in fields(DiagnosticsSummary) if f.name != "extra")


def _number(value: Any, *, null_as: float = math.nan) -> float:
    return null_as if value is None else float(value)


def _parse_summary(obj: Mapping[str, Any]) -> DiagnosticsSummary | dict[str, Any]:
    if not all(name in obj for name in _SUMMARY_FIELDS):
        # A server of another version: hand the fields over untyped rather than guess.
        return dict(obj)
    values: dict[str, Any] = {name: _number(obj[name]) for name in _SUMMARY_FIELDS}
    values["masked_rows"] = int(obj["masked_rows"])
    extra = {k: v for k, v in obj.items() if k not in values}
    return DiagnosticsSummary(**values, extra=extra)


@dataclass(frozen=True, slots=True, eq=False)
class Diagnostics:
    """summary: scalars; per_head: arrays [..., H]; per_row ("full" only): arrays [..., H, N_q].

    A non-finite number is null in JSON; it comes back as NaN, except the log-sum-exp of a fully
    masked row (per_row["lse"]), which is -inf as in sdpa_core.
    """

    summary: DiagnosticsSummary | dict[str, Any]
    per_head: Mapping[str, AnyArray]
    per_row: Mapping[str, AnyArray] | None


def _parse_stat_arrays(obj: Mapping[str, Any], *, param: str) -> dict[str, AnyArray]:
    out: dict[str, AnyArray] = {}
    for name, value in obj.items():
        null_as = -math.inf if name == "lse" else math.nan
        arr = decode_tensor(value, param=f"{param}.{name}", null_as=null_as)
        # Counts travel as numbers; give them back as integers when they are whole.
        if (
            name in ("visible_keys", "masked_rows")
            and arr.dtype.kind == "f"
            and np.all(np.isfinite(arr))
        ):
            arr = arr.astype(np.int64)
        out[name] = arr
    return out


def _parse_diagnostics(obj: object) -> Diagnostics | None:
    if obj is None:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("summary"), dict):
        raise SDPAProtocolError(None, "Malformed response", "diagnostics: no summary object")
    per_head = obj.get("per_head") or {}
    per_row = obj.get("per_row")
    return Diagnostics(
        summary=_parse_summary(obj["summary"]),
        per_head=_parse_stat_arrays(per_head, param="per_head"),
        per_row=None if per_row is None else _parse_stat_arrays(per_row, param="per_row"),
    )


@dataclass(frozen=True, slots=True, eq=False)
class AttentionResult:
    """The answer of POST /v1/attention. output [..., H, N_q, D_v]; weights [..., H, N_q, N_kv]
    (when return_weights); bfloat16 results are float32."""

    output: AnyArray
    weights: AnyArray | None
    diagnostics: Diagnostics | None
    meta: ResponseMeta


def parse_attention_response(payload: object) -> AttentionResult:
    if not isinstance(payload, dict) or "output" not in payload:
        raise SDPAProtocolError(None, "Malformed response", "attention: no 'output' in response")
    weights = payload.get("weights")
    return AttentionResult(
        output=decode_tensor(payload["output"], param="output"),
        weights=None if weights is None else decode_tensor(weights, param="weights"),
        diagnostics=_parse_diagnostics(payload.get("diagnostics")),
        meta=ResponseMeta.from_json(payload.get("meta")),
    )


@dataclass(frozen=True, slots=True)
class StrategyResult:
    """One scaling strategy of /v1/analyze: the scores divided by `divisor`."""

    name: str
    divisor: float
    score_variance: float
    entropy: float
    normalized_entropy: float
    max_weight: float
    saturated_fraction: float
    grad_health: float


@dataclass(frozen=True, slots=True)
class ScalingReport:
    """The answer of POST /v1/analyze."""

    d_k: int
    raw_score_variance: float
    recommended_divisor: float
    strategies: tuple[StrategyResult, ...]
    meta: ResponseMeta


def parse_analyze_response(payload: object) -> ScalingReport:
    if not isinstance(payload, dict):
        raise SDPAProtocolError(None, "Malformed response", "analyze: not a JSON object")
    try:
        strategies = tuple(
            StrategyResult(
                name=str(s["name"]),
                **{f.name: _number(s[f.name]) for f in fields(StrategyResult) if f.name != "name"},
            )
            for s in payload["strategies"]
        )
        return ScalingReport(
            d_k=int(payload["d_k"]),
            raw_score_variance=_number(payload["raw_score_variance"]),
            recommended_divisor=_number(payload["recommended_divisor"]),
            strategies=strategies,
            meta=ResponseMeta.from_json(payload.get("meta")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SDPAProtocolError(
            None, "Malformed response", f"analyze: cannot read response ({exc!r})"
        ) from exc


# --------------------------------------------------------------------------------------------
# Clients
# --------------------------------------------------------------------------------------------

DEFAULT_TIMEOUT = httpx.Timeout(connect=5.0, read=60.0, write=60.0, pool=10.0)
_READ_MARGIN_S = 5.0  # beyond a server-side timeout_ms, so the server's 504 arrives first


@dataclass(frozen=True, slots=True)
class _Call:
    method: str
    path: str
    content: bytes | None
    timeout: httpx.Timeout
    retry: bool
    headers: Mapping[str, str]


class _ClientBase:
    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None,
        timeout: float | httpx.Timeout,
        retry: RetryPolicy | None,
        headers: Mapping[str, str] | None,
        rng: random.Random | None,
        clock: Callable[[], float],
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        self.retry = retry if retry is not None else RetryPolicy()
        self._rng = rng or random.Random()
        self._clock = clock
        self._headers: dict[str, str] = {"user-agent": f"sdpa-client/{CLIENT_VERSION}"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._headers.update(headers or {})

    def _timeout_for(self, timeout_ms: float | None) -> httpx.Timeout:
        if timeout_ms is None or self.timeout.read is None:
            return self.timeout
        read = max(self.timeout.read, timeout_ms / 1000.0 + _READ_MARGIN_S)
        return httpx.Timeout(
            connect=self.timeout.connect,
            read=read,
            write=self.timeout.write,
            pool=self.timeout.pool,
        )

    def _post(
        self,
        path: str,
        body: Mapping[str, Any],
        *,
        timeout_ms: float | None,
        request_id: str | None,
    ) -> _Call:
        headers = {"content-type": "application/json"}
        if request_id is not None:
            headers["x-request-id"] = request_id
        return _Call("POST", path, encode_body(body), self._timeout_for(timeout_ms), True, headers)

    def _get(self, path: str) -> _Call:
        return _Call("GET", path, None, self.timeout, False, {})

    def _next_delay(
        self, attempt: int, started: float, retry_after_s: float | None
    ) -> float | None:
        """Seconds to wait before attempt `attempt + 1`, or None to give up."""
        if attempt >= self.retry.max_attempts:
            return None
        delay = self.retry.delay_s(attempt, retry_after_s, self._rng)
        if self._clock() - started + delay > self.retry.max_total_s:
            return None
        return delay

    def _outcome(
        self,
        call: _Call,
        result: httpx.Response | httpx.TransportError,
        attempt: int,
        started: float,
    ) -> httpx.Response | SDPAError | float:
        """A 2xx response, the error to raise, or the seconds to wait before retrying."""
        if isinstance(result, httpx.TransportError):
            error: SDPAError = _transport_error(result, attempts=attempt)
            retryable = call.retry and self.retry.should_retry_transport(result)
        elif result.is_success:
            return result
        else:
            error = error_from_response(result, attempts=attempt)
            retryable = call.retry and self.retry.should_retry_status(result.status_code)
        if retryable:
            delay = self._next_delay(attempt, started, error.retry_after_s)
            if delay is not None:
                return delay
        return error


def _json_of(response: httpx.Response) -> Any:
    try:
        return response.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise SDPAProtocolError(
            response.status_code, "Malformed response", f"response is not JSON ({exc})"
        ) from exc


class SDPAClient(_ClientBase):
    """Synchronous client. One connection pool per object; use it as a context manager.

    Args:
        base_url: e.g. "http://127.0.0.1:8000".
        api_key: sent as "Authorization: Bearer <key>".
        timeout: seconds or an httpx.Timeout (default: connect 5 s, read/write 60 s). A call
            with timeout_ms waits at least timeout_ms + 5 s for the answer.
        retry: RetryPolicy (default 4 attempts within 60 s); `NO_RETRY` turns retries off.
        transport, sleep, rng, clock: injection points for tests (httpx.MockTransport, a fake
            sleep that records delays, a seeded random.Random, a fake monotonic clock).
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        headers: Mapping[str, str] | None = None,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            base_url, api_key=api_key, timeout=timeout, retry=retry, headers=headers,
            rng=rng, clock=clock,
        )  # fmt: skip
        self._sleep = sleep
        self._http = httpx.Client(
            base_url=self.base_url, timeout=self.timeout, headers=self._headers,
            transport=transport,
        )  # fmt: skip

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SDPAClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _send(self, call: _Call) -> httpx.Response:
        started = self._clock()
        attempt = 0
        while True:
            attempt += 1
            result: httpx.Response | httpx.TransportError
            try:
                result = self._http.request(
                    call.method, call.path, content=call.content, headers=call.headers,
                    timeout=call.timeout,
                )  # fmt: skip
            except httpx.TransportError as exc:
                result = exc
            outcome = self._outcome(call, result, attempt, started)
            if isinstance(outcome, httpx.Response):
                return outcome
            if isinstance(outcome, SDPAError):
                if isinstance(result, httpx.TransportError):
                    raise outcome from result
                raise outcome
            self._sleep(outcome)

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
    ) -> AttentionResult:
        """softmax(q k^T * scale + masks) v on the server. See DESIGN.md for every option."""
        body = build_attention_body(
            q, k, v, causal=causal, key_lengths=key_lengths, key_padding_mask=key_padding_mask,
            attn_mask=attn_mask, scale=scale, return_weights=return_weights,
            diagnostics=diagnostics, timeout_ms=timeout_ms, encoding=encoding,
        )  # fmt: skip
        call = self._post("/v1/attention", body, timeout_ms=timeout_ms, request_id=request_id)
        return parse_attention_response(_json_of(self._send(call)))

    def analyze(
        self,
        q: object | None = None,
        k: object | None = None,
        *,
        synthetic: Mapping[str, Any] | None = None,
        strategies: Sequence[str | tuple[str, float]] | None = None,
        causal: Causal = False,
        key_lengths: object | None = None,
        key_padding_mask: object | None = None,
        attn_mask: object | None = None,
        timeout_ms: float | None = None,
        encoding: Encoding = "base64",
        request_id: str | None = None,
    ) -> ScalingReport:
        """Compare score scalings on q/k, or on synthetic={"n_q", "n_k", "d_k", "std", "seed"}."""
        body = build_analyze_body(
            q, k, synthetic=synthetic, strategies=strategies, causal=causal,
            key_lengths=key_lengths, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
            timeout_ms=timeout_ms, encoding=encoding,
        )  # fmt: skip
        call = self._post("/v1/analyze", body, timeout_ms=timeout_ms, request_id=request_id)
        return parse_analyze_response(_json_of(self._send(call)))

    def info(self) -> dict[str, Any]:
        """GET /v1/info: version, device, dtypes, limits, batching settings."""
        payload = _json_of(self._send(self._get("/v1/info")))
        if not isinstance(payload, dict):
            raise SDPAProtocolError(200, "Malformed response", "info: not a JSON object")
        return payload

    def healthz(self) -> bool:
        """True while the process serves (200); False for 503. Other failures raise."""
        return self._probe("/healthz")

    def readyz(self) -> bool:
        """True when the server is warm and not draining (200); False for 503."""
        return self._probe("/readyz")

    def _probe(self, path: str) -> bool:
        try:
            self._send(self._get(path))
        except SDPAUnavailable:
            return False
        return True


class AsyncSDPAClient(_ClientBase):
    """The asyncio twin of SDPAClient (same arguments; `sleep` is an async function)."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000",
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(
            base_url, api_key=api_key, timeout=timeout, retry=retry, headers=headers,
            rng=rng, clock=clock,
        )  # fmt: skip
        self._sleep = sleep
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=self.timeout, headers=self._headers,
            transport=transport,
        )  # fmt: skip

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncSDPAClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _send(self, call: _Call) -> httpx.Response:
        started = self._clock()
        attempt = 0
        while True:
            attempt += 1
            result: httpx.Response | httpx.TransportError
            try:
                result = await self._http.request(
                    call.method, call.path, content=call.content, headers=call.headers,
                    timeout=call.timeout,
                )  # fmt: skip
            except httpx.TransportError as exc:
                result = exc
            outcome = self._outcome(call, result, attempt, started)
            if isinstance(outcome, httpx.Response):
                return outcome
            if isinstance(outcome, SDPAError):
                if isinstance(result, httpx.TransportError):
                    raise outcome from result
                raise outcome
            await self._sleep(outcome)

    async def attention(
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
    ) -> AttentionResult:
        """See SDPAClient.attention."""
        body = build_attention_body(
            q, k, v, causal=causal, key_lengths=key_lengths, key_padding_mask=key_padding_mask,
            attn_mask=attn_mask, scale=scale, return_weights=return_weights,
            diagnostics=diagnostics, timeout_ms=timeout_ms, encoding=encoding,
        )  # fmt: skip
        call = self._post("/v1/attention", body, timeout_ms=timeout_ms, request_id=request_id)
        return parse_attention_response(_json_of(await self._send(call)))

    async def analyze(
        self,
        q: object | None = None,
        k: object | None = None,
        *,
        synthetic: Mapping[str, Any] | None = None,
        strategies: Sequence[str | tuple[str, float]] | None = None,
        causal: Causal = False,
        key_lengths: object | None = None,
        key_padding_mask: object | None = None,
        attn_mask: object | None = None,
        timeout_ms: float | None = None,
        encoding: Encoding = "base64",
        request_id: str | None = None,
    ) -> ScalingReport:
        """See SDPAClient.analyze."""
        body = build_analyze_body(
            q, k, synthetic=synthetic, strategies=strategies, causal=causal,
            key_lengths=key_lengths, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
            timeout_ms=timeout_ms, encoding=encoding,
        )  # fmt: skip
        call = self._post("/v1/analyze", body, timeout_ms=timeout_ms, request_id=request_id)
        return parse_analyze_response(_json_of(await self._send(call)))

    async def info(self) -> dict[str, Any]:
        payload = _json_of(await self._send(self._get("/v1/info")))
        if not isinstance(payload, dict):
            raise SDPAProtocolError(200, "Malformed response", "info: not a JSON object")
        return payload

    async def healthz(self) -> bool:
        return await self._probe("/healthz")

    async def readyz(self) -> bool:
        return await self._probe("/readyz")

    async def _probe(self, path: str) -> bool:
        try:
            await self._send(self._get(path))
        except SDPAUnavailable:
            return False
        return True
