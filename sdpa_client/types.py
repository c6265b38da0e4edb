"""The answers of the service as Python objects, and the functions that read them from JSON.

Arrays come back as numpy arrays. Statistics are `Stats`: read-only mappings whose names come
from `sdpa_client.fields`, readable as ``stats["entropy"]`` or ``stats.entropy``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

import numpy as np

from sdpa_client.codec import AnyArray, decode_tensor
from sdpa_client.errors import SDPAProtocolError
from sdpa_client.fields import COUNT_STATS, STRATEGY_STAT_NAMES, SUMMARY_STAT_NAMES

# In the lists encoding a non-finite number is null; for these it can only be -inf (the
# log-sum-exp of a fully masked row), for every other statistic it reads as NaN.
_NULL_IS_MINUS_INF = frozenset({"lse"})


class Stats(Mapping[str, float]):
    """Named statistics: read-only, by name (``stats["entropy"]``) or attribute (``stats.entropy``).

    Counts (masked_rows) are ints; a statistic the server reported as null is NaN.
    """

    __slots__ = ("_values",)
    _values: dict[str, float]

    def __init__(self, values: Mapping[str, float]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getitem__(self, name: str) -> float:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getattr__(self, name: str) -> float:
        # Only reached when normal lookup failed; private names never map to statistics (and
        # _values itself is unset while an instance is being unpickled).
        if not name.startswith("_") and name in self._values:
            return self._values[name]
        raise AttributeError(f"{type(self).__name__} has no statistic {name!r}")

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._values})

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._values,))

    def __hash__(self) -> int:
        # Read-only, so hashable like the frozen result types that hold it.
        return hash(frozenset(self._values.items()))

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self._values.items())
        return f"{type(self).__name__}({shown})"


class SummaryStats(Stats):
    """diagnostics.summary: the statistics of `fields.SUMMARY_STAT_NAMES`, pooled over the request.

    A statistic that a newer server adds is there too, as the server sent it (see `extra`).
    """

    __slots__ = ()

    @property
    def extra(self) -> dict[str, Any]:
        """The statistics this client version does not know, as sent."""
        return {k: v for k, v in self.items() if k not in SUMMARY_STAT_NAMES}


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    """How the server ran the request (the answer's "meta"); None where the server did not say.

    Attributes:
        path: the compute path ("fused", "dense", "chunked" or "flash").
        backend: the kernel the fused path used (torch SDPA's backend) or the flash path's
            ("triton", "cpu_flash"), when the server reports it.
        device: e.g. "cpu", "cuda:0".
        dtype: the inputs' dtype.
        batch_size: how many requests the server batched this one with.
        queue_ms: time spent waiting in the server's queue.
        compute_ms: time spent computing.
        request_id: the server's id of the request (its X-Request-ID).
        extra: any other field of "meta", as sent.
    """

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
        """Read a "meta" object; anything not a JSON object reads as an empty one."""
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


@dataclass(frozen=True, slots=True, eq=False)
class DiagnosticsReport:
    """The attention's diagnostics, computed over visible entries only.

    Attributes:
        summary: scalars pooled over the request; a plain dict when the server (of another
            version) does not send every statistic this client knows.
        per_head: the summary's statistics per head, arrays [..., H] (masked_rows int64); on
            v2 in the datatype the server sent (float32, float64 for float64 inputs).
        per_row: with diagnostics="full", arrays [..., H, N_q] (`fields.PER_ROW_STAT_NAMES`);
            otherwise None. The log-sum-exp of a fully masked row (per_row["lse"]) is -inf.
    """

    summary: SummaryStats | dict[str, Any]
    per_head: Mapping[str, AnyArray]
    per_row: Mapping[str, AnyArray] | None


@dataclass(frozen=True, slots=True, eq=False)
class AttentionResponse:
    """The answer of POST /v1/attention (bfloat16 results come back as float32).

    Attributes:
        output: [..., H, N_q, D_v]; None when not asked for (return_output=False).
        weights: [..., H, N_q, N_kv] when asked for with return_weights, else None.
        diagnostics: None when asked for with diagnostics="none".
        meta: how the server ran it.
    """

    output: AnyArray | None
    weights: AnyArray | None
    diagnostics: DiagnosticsReport | None
    meta: ResponseMeta


@dataclass(frozen=True, slots=True)
class StrategyScores:
    """One scaling strategy of /v1/analyze: the raw scores divided by `divisor`.

    The statistics (`fields.STRATEGY_STAT_NAMES`) are in `stats` and read as attributes too:
    ``scores.entropy`` is ``scores.stats["entropy"]``.
    """

    name: str
    divisor: float
    stats: Stats

    def __getattr__(self, name: str) -> float:
        if name.startswith("_"):  # never a statistic; and `stats` is unset while unpickling
            raise AttributeError(name)
        value: float = getattr(self.stats, name)
        return value

    def __dir__(self) -> list[str]:
        return sorted({*object.__dir__(self), *self.stats})


@dataclass(frozen=True, slots=True)
class AnalyzeResponse:
    """The answer of POST /v1/analyze.

    Attributes:
        d_k: the key dimension.
        raw_score_variance: the variance of the unscaled scores q·k.
        recommended_divisor: the divisor that makes the scores' variance 1 (their std).
        strategies: one entry per strategy, in the order the server computed them.
        meta: how the server ran it.
    """

    d_k: int
    raw_score_variance: float
    recommended_divisor: float
    strategies: tuple[StrategyScores, ...]
    meta: ResponseMeta


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)


def _malformed(what: str) -> SDPAProtocolError:
    return SDPAProtocolError(None, "Malformed response", what)


def _parse_summary(obj: Mapping[str, Any]) -> SummaryStats | dict[str, Any]:
    if not all(name in obj for name in SUMMARY_STAT_NAMES):
        # A server of another version: hand the fields over untyped rather than guess.
        return dict(obj)
    values = {
        name: (int(value) if name in COUNT_STATS else _number(value))
        if name in SUMMARY_STAT_NAMES
        else value
        for name, value in obj.items()
    }
    return SummaryStats(values)


def _parse_stat_arrays(obj: Mapping[str, Any], *, param: str) -> dict[str, AnyArray]:
    out: dict[str, AnyArray] = {}
    for name, value in obj.items():
        null_as = -math.inf if name in _NULL_IS_MINUS_INF else math.nan
        if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
            # A 2-D request has one head and no head dim: its per-head statistics are numbers.
            arr = np.asarray(null_as if value is None else value)
        else:
            arr = decode_tensor(value, param=f"{param}.{name}", null_as=null_as)
        # Counts travel as numbers; give them back as integers when they are whole.
        if name in COUNT_STATS and arr.dtype.kind == "f" and np.all(np.isfinite(arr)):
            arr = arr.astype(np.int64)
        out[name] = arr
    return out


def _parse_diagnostics(obj: object) -> DiagnosticsReport | None:
    if obj is None:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("summary"), dict):
        raise _malformed("diagnostics: no summary object")
    per_row = obj.get("per_row")
    return DiagnosticsReport(
        summary=_parse_summary(obj["summary"]),
        per_head=_parse_stat_arrays(obj.get("per_head") or {}, param="per_head"),
        per_row=None if per_row is None else _parse_stat_arrays(per_row, param="per_row"),
    )


def parse_attention_response(payload: object, *, return_output: bool = True) -> AttentionResponse:
    """Read the JSON answer of POST /v1/attention.

    Args:
        payload: the decoded JSON body.
        return_output: whether the request asked for the output; only then must the answer
            hold it (without, an absent or null output reads as None).

    Returns:
        The answer, its tensors decoded.

    Raises:
        SDPAProtocolError: the payload is not such an answer.
    """
    if not isinstance(payload, dict):
        raise _malformed("attention: not a JSON object")
    output = payload.get("output")
    if output is None and return_output:
        raise _malformed("attention: no 'output' in response")
    weights = payload.get("weights")
    return AttentionResponse(
        output=None if output is None else decode_tensor(output, param="output"),
        weights=None if weights is None else decode_tensor(weights, param="weights"),
        diagnostics=_parse_diagnostics(payload.get("diagnostics")),
        meta=ResponseMeta.from_json(payload.get("meta")),
    )


def _parse_strategy(obj: Mapping[str, Any]) -> StrategyScores:
    stats = Stats({name: _number(obj[name]) for name in STRATEGY_STAT_NAMES})
    return StrategyScores(name=str(obj["name"]), divisor=_number(obj["divisor"]), stats=stats)


def parse_analyze_response(payload: object) -> AnalyzeResponse:
    """Read the JSON answer of POST /v1/analyze.

    Args:
        payload: the decoded JSON body.

    Returns:
        The report; a null statistic reads as NaN.

    Raises:
        SDPAProtocolError: the payload is not such an answer.
    """
    if not isinstance(payload, dict):
        raise _malformed("analyze: not a JSON object")
    try:
        return AnalyzeResponse(
            d_k=int(payload["d_k"]),
            raw_score_variance=_number(payload["raw_score_variance"]),
            recommended_divisor=_number(payload["recommended_divisor"]),
            strategies=tuple(_parse_strategy(s) for s in payload["strategies"]),
            meta=ResponseMeta.from_json(payload.get("meta")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise _malformed(f"analyze: cannot read response ({exc!r})") from exc
