"""Prepare a request: body bytes -> a validated, limit-checked job for the runtime.

Parse the JSON and validate its envelope (service.wire.models), decode the tensors
(service.wire.codec), validate the tensors once (service.runtime.jobs.prepare: a PreparedJob,
which nothing else can make), and check the size limits. Every failure is a 422 before the
request is queued.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

import torch

from sdpa_core import Masks, analysis_passes, default_scale, make_synthetic_qk
from service.runtime.jobs import AnalyzeJob, AttentionJob, PreparedJob, Strategy, prepare
from service.runtime.policy import CostModel, WorkShape, job_work
from service.serving.limits import (
    SizedAs,
    answer_working_bytes,
    attention_work_hint,
    check_analysis_limits,
    check_attention_limits,
    check_priority,
    check_response_size,
    check_synthetic_limits,
    check_work,
    over_limit,
)
from service.settings import Settings
from service.wire.codec import EncodingName, decode_int_list, decode_tensor, loads_request
from service.wire.json_arrays import Pieces, SlotOf
from service.wire.models import (
    AnalyzeRequest,
    AttentionRequest,
    CustomStrategy,
    Synthetic,
    array_slots,
    validate_request,
)
from service.wire.number_lists import NumberArray

# Where each endpoint's model reads a list (service.wire.json_arrays).
_ATTENTION_SLOTS: Final = array_slots(AttentionRequest)
_ANALYZE_SLOTS: Final = array_slots(AnalyzeRequest)

_TORCH_DTYPES: Final = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A validated job and what the response needs from the request."""

    prepared: PreparedJob
    encoding: EncodingName  # of the response's tensors
    timeout_ms: float | None
    response_bytes: int = 0  # the answer's estimated size (0: a small, fixed-size answer)
    tag: str | None = None  # labels the request's health metrics (service.serving.health)
    # Its level among its tenant's waiting requests (1 the highest); None: the default.
    priority: int | None = None
    # Whether the answer carries the output (v1 return_output; v2: "output" among the outputs).
    return_output: bool = True
    # What the request holds at its peak from compute to send (limits.answer_working_bytes):
    # reserved against SDPA_MAX_INFLIGHT_BYTES before it is computed.
    working_bytes: int = 0


def _decode_masks(
    causal: bool | str,
    key_lengths: list[Any] | NumberArray | int | None,
    key_padding_mask: Any,
    attn_mask: Any,
    *,
    max_elements: int,
) -> Masks:
    """The mask options of a request as one Masks value, tensors decoded (None where absent)."""
    return Masks(
        causal=causal,
        key_lengths=None
        if key_lengths is None
        else decode_int_list(key_lengths, loc=("body", "key_lengths"), max_elements=max_elements),
        key_padding_mask=None
        if key_padding_mask is None
        else decode_tensor(
            key_padding_mask,
            loc=("body", "key_padding_mask"),
            role="bool_mask",
            max_elements=max_elements,
        ).tensor,
        attn_mask=None
        if attn_mask is None
        else decode_tensor(
            attn_mask, loc=("body", "attn_mask"), role="mask", max_elements=max_elements
        ).tensor,
    )


def prepare_attention(
    body: bytes, settings: Settings, cost: CostModel, *, pieces: Pieces | None = None
) -> PreparedRequest:
    """Body bytes -> a validated attention job within every limit. Raises InvalidRequest /
    SdpaError (422). With `pieces`, its big lists of numbers are parsed in pieces (a body that
    decodes off the event loop: service.wire.json_arrays); the answer is the same."""
    req = validate_request(_loads(body, _ATTENTION_SLOTS, pieces), AttentionRequest)
    limit = settings.max_elements
    q = decode_tensor(req.q, loc=("body", "q"), role="float", max_elements=limit)
    k = decode_tensor(req.k, loc=("body", "k"), role="float", max_elements=limit)
    v = decode_tensor(req.v, loc=("body", "v"), role="float", max_elements=limit)
    masks = _decode_masks(
        req.causal, req.key_lengths, req.key_padding_mask, req.attn_mask, max_elements=limit
    )
    job = AttentionJob(
        q=q.tensor,
        k=k.tensor,
        v=v.tensor,
        masks=masks,
        scale=req.scale
        if req.temperature is None
        else temperature_scale(req.temperature, q.tensor),
        return_weights=req.return_weights,
        diagnostics=req.diagnostics,
    )
    encoding = req.response_encoding or q.encoding
    return prepare_attention_job(
        job,
        encoding=encoding,
        timeout_ms=req.timeout_ms,
        settings=settings,
        cost=cost,
        tag=req.tag,
        return_output=req.return_output,
        priority=check_priority(req.priority, settings=settings, loc=("body", "priority")),
    )


def _loads(body: bytes, slots: SlotOf, pieces: Pieces | None) -> Any:
    if pieces is None:
        return loads_request(body)
    return loads_request(body, slot_of=slots, pieces=pieces)


def temperature_scale(temperature: float, q: torch.Tensor) -> float | None:
    """scale = 1 / (T·sqrt(D)) for a temperature T > 0: the default scale divided by T.
    None for a q without a head dim (its own error follows in validation). Raises
    InvalidRequest naming `temperature` when T is so small that the scale is not finite."""
    d = q.shape[-1] if q.dim() else 0
    if not d:
        return None
    scale = default_scale(d) / temperature
    if not math.isfinite(scale):
        raise over_limit(
            ("body", "temperature"),
            f"temperature {temperature!r} is too small: the scale 1/(T·sqrt(D)) it gives is not "
            "a finite number",
            kind="value_error",
        )
    return scale


def prepare_attention_job(
    job: AttentionJob,
    *,
    encoding: EncodingName,
    timeout_ms: float | None,
    settings: Settings,
    cost: CostModel,
    tag: str | None = None,
    sized_as: SizedAs | None = None,
    return_output: bool = True,
    priority: int | None = None,
) -> PreparedRequest:
    """A decoded attention job -> validated once and within every limit. Both protocols' doors
    (v1 JSON, v2) come through here. The answer is sized in `encoding`, or in `sized_as` when
    given (v2's raw "binary" data), with the output only when `return_output`. Raises
    InvalidRequest / SdpaError (422)."""
    prepared = prepare(job)
    spec = prepared.spec
    check_attention_limits(spec, return_weights=job.return_weights, settings=settings)
    shape, path = job_work(prepared)
    check_work(
        shape, path, cost=cost, settings=settings, loc=("body", "q"), how=attention_work_hint(path)
    )
    sized = encoding if sized_as is None else sized_as
    size = check_response_size(
        spec,
        encoding=sized,
        return_weights=job.return_weights,
        diagnostics=job.diagnostics,
        settings=settings,
        return_output=return_output,
    )
    working = answer_working_bytes(
        spec,
        encoding=sized,
        return_weights=job.return_weights,
        diagnostics=job.diagnostics,
        response_bytes=size,
    )
    return PreparedRequest(
        prepared=prepared,
        encoding=encoding,
        timeout_ms=timeout_ms,
        response_bytes=size,
        working_bytes=working,
        tag=tag,
        return_output=return_output,
        priority=priority,
    )


def _check_analysis_work(
    *,
    heads: int,
    batch: int,
    n_q: int,
    n_kv: int,
    d: int,
    strategies: tuple[Strategy, ...] | None,
    cost: CostModel,
    settings: Settings,
    loc: tuple[str | int, ...],
) -> None:
    shape = WorkShape(batch, heads, n_q, n_kv, d, d, analysis_passes(strategies, d))
    how = (
        "Use fewer queries, keys or heads (a few hundred of each estimate the statistics "
        "well), or fewer strategies."
    )
    check_work(shape, "analyze", cost=cost, settings=settings, loc=loc, how=how)


def _synthetic(
    syn: Synthetic, strategies: tuple[Strategy, ...] | None, settings: Settings, cost: CostModel
) -> tuple[torch.Tensor, torch.Tensor]:
    # Every limit before any random number is drawn: drawing is costly.
    check_synthetic_limits(syn, settings)
    _check_analysis_work(
        heads=syn.heads, batch=1, n_q=syn.n_q, n_kv=syn.n_k, d=syn.d_k, strategies=strategies,
        cost=cost, settings=settings, loc=("body", "synthetic"),
    )  # fmt: skip
    q, k = make_synthetic_qk(
        n_q=syn.n_q,
        n_k=syn.n_k,
        d_k=syn.d_k,
        std=syn.std,
        seed=syn.seed,
        heads=syn.heads,
        dtype=_TORCH_DTYPES[syn.dtype],
    )
    if not (bool(torch.isfinite(q).all()) and bool(torch.isfinite(k).all())):
        # Say which knob to turn, rather than blame a q the client never sent.
        raise over_limit(
            ("body", "synthetic", "std"),
            f"values drawn with std={syn.std} overflow {syn.dtype}; use a smaller std or a "
            "wider dtype",
            kind="non_finite",
        )
    return q, k


def prepare_analyze(
    body: bytes, settings: Settings, cost: CostModel, *, pieces: Pieces | None = None
) -> PreparedRequest:
    """Body bytes -> a validated analysis job within every limit. Raises InvalidRequest /
    SdpaError (422). `pieces` as for prepare_attention."""
    req = validate_request(_loads(body, _ANALYZE_SLOTS, pieces), AnalyzeRequest)
    limit = settings.max_elements
    strategies = (
        None
        if req.strategies is None
        else tuple(
            (s.name, s.divisor) if isinstance(s, CustomStrategy) else s for s in req.strategies
        )
    )
    if req.synthetic is not None:
        q, k = _synthetic(req.synthetic, strategies, settings, cost)
        where: tuple[str | int, ...] = ("body", "synthetic")
    else:
        # AnalyzeRequest guarantees both.
        assert req.q is not None
        assert req.k is not None
        q = decode_tensor(req.q, loc=("body", "q"), role="float", max_elements=limit).tensor
        k = decode_tensor(req.k, loc=("body", "k"), role="float", max_elements=limit).tensor
        where = ("body", "k")
    masks = _decode_masks(
        req.causal, req.key_lengths, req.key_padding_mask, req.attn_mask, max_elements=limit
    )
    prepared = prepare(AnalyzeJob(q=q, k=k, strategies=strategies, masks=masks))
    spec = prepared.spec
    check_analysis_limits(spec, where=where, settings=settings)
    _check_analysis_work(
        heads=spec.heads, batch=spec.batch, n_q=spec.n_q, n_kv=spec.n_kv, d=spec.d,
        strategies=strategies, cost=cost, settings=settings, loc=where,
    )  # fmt: skip
    priority = check_priority(req.priority, settings=settings, loc=("body", "priority"))
    return PreparedRequest(
        prepared=prepared, encoding="json", timeout_ms=req.timeout_ms, priority=priority
    )
