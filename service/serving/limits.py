"""Limits checked before a request is queued: sizes (SDPA_MAX_ELEMENTS,
SDPA_MAX_WEIGHTS_ELEMENTS), work (SDPA_MAX_REQUEST_FLOPS, through the runtime's cost model) and
the response's size (SDPA_MAX_RESPONSE_BYTES).

Each refusal is a 422 naming the field, the limit and how to stay under it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Final, Literal

from sdpa_core import PER_HEAD_FIELDS, PER_ROW_FIELDS, InputSpec
from service.errors import FieldError, InvalidRequest
from service.runtime.policy import CostModel, WorkShape
from service.settings import Settings
from service.wire.models import Synthetic

Loc = tuple[str | int, ...]
# How an answer's tensors are sized: v1's JSON lists or base64, or v2's raw binary data.
SizedAs = Literal["json", "base64", "binary"]
MB: Final = 1e6


def over_limit(loc: Loc, msg: str, *, kind: str = "limit") -> InvalidRequest:
    """A 422 for one field; `kind` is the error's type."""
    return InvalidRequest(msg, errors=[FieldError(loc=loc, msg=msg, type=kind)])


def largest_fitting(fits: Callable[[int], bool], guess: int) -> int:
    """The largest n >= 0 for which `fits(n)` holds (`fits` true up to some n, false after),
    from a guess that integer division or float rounding left a step or two off: each refusal
    names the largest size that the same check accepts, checked by that check itself."""
    n = max(guess, 0)
    while n > 0 and not fits(n):
        n -= 1
    while fits(n + 1):
        n += 1
    return n


def _pair_hint(max_product: int, n_q: int, q_name: str, kv_name: str) -> str:
    """The largest sizes whose product fits `max_product`: the keys at this query count, and
    the largest square (queries = keys)."""
    at_this_q = max_product // n_q
    square = math.isqrt(max_product)
    hint = f"the largest that fits: {kv_name} = {at_this_q} at {q_name} = {n_q}"
    if at_this_q == 0:
        hint = f"no {kv_name} fits at {q_name} = {n_q}"
    if square:
        hint += f", or {q_name} = {kv_name} = {square}"
    return hint


def check_priority(priority: int | None, *, settings: Settings, loc: Loc) -> int | None:
    """The request's priority as sent, within SDPA_PRIORITY_LEVELS (a 422 naming `loc` past
    it); 0 means the default, as absent does."""
    if priority is not None and priority > settings.priority_levels:
        raise over_limit(
            loc,
            f"priority {priority} is past the server's {settings.priority_levels} levels "
            f"(SDPA_PRIORITY_LEVELS): send 1 (the highest) to {settings.priority_levels}, or 0 "
            f"for the default, {settings.default_priority}",
            kind="less_than_equal",
        )
    return priority or None


def check_attention_limits(spec: InputSpec, *, return_weights: bool, settings: Settings) -> None:
    """The output, and the weights when asked for, must fit the element limits."""
    heads = spec.batch * spec.heads
    rows = heads * spec.n_q
    out_elements = rows * spec.d_v
    if out_elements > settings.max_elements:
        largest = settings.max_elements // (heads * spec.d_v)
        raise over_limit(
            ("body", "v"),
            f"the output [..., H, N_q, D_v] would hold {out_elements} elements, above the limit "
            f"of {settings.max_elements} per tensor (SDPA_MAX_ELEMENTS); send fewer sequences, "
            f"heads or queries per request (the largest that fits: N_q = {largest} at "
            f"B·H = {heads}, D_v = {spec.d_v})",
        )
    weights = rows * spec.n_kv
    if return_weights and weights > settings.max_weights_elements:
        hint = _pair_hint(settings.max_weights_elements // heads, spec.n_q, "N_q", "N_kv")
        raise over_limit(
            ("body", "return_weights"),
            f"the attention weights [..., H, N_q, N_kv] would hold {weights} elements, above "
            f"SDPA_MAX_WEIGHTS_ELEMENTS = {settings.max_weights_elements}. Ask for diagnostics "
            'without weights instead (return_weights: false, diagnostics: "summary" or "full"): '
            "they are computed in O(N) memory. Or send fewer queries or keys per request "
            f"({hint}, at B·H = {heads}).",
        )


def check_analysis_limits(spec: InputSpec, *, where: Loc, settings: Settings) -> None:
    """The analysis materializes the [..., H, N_q, N_kv] scores: they must fit the weights limit."""
    heads = spec.batch * spec.heads
    scores = heads * spec.n_q * spec.n_kv
    if scores > settings.max_weights_elements:
        hint = _pair_hint(settings.max_weights_elements // heads, spec.n_q, "N_q", "N_kv")
        raise over_limit(
            where,
            f"the analysis holds the [..., H, N_q, N_kv] scores: {scores} elements, above "
            f"SDPA_MAX_WEIGHTS_ELEMENTS = {settings.max_weights_elements}; use fewer queries or "
            f"keys (a few hundred of each estimate the statistics well; {hint}, at "
            f"B·H = {heads})",
        )


def check_synthetic_limits(syn: Synthetic, settings: Settings) -> None:
    """Synthetic sizes are refused before any random number is drawn (drawing is costly)."""
    for name, n in (("n_q", syn.n_q), ("n_k", syn.n_k)):
        elements = syn.heads * n * syn.d_k
        if elements > settings.max_elements:
            largest = settings.max_elements // (syn.heads * syn.d_k)
            hint = (
                f"the largest that fits: {name} = {largest}"
                if largest
                else f"no {name} fits: use fewer heads or a smaller d_k"
            )
            raise over_limit(
                ("body", "synthetic", name),
                f"heads x {name} x d_k = {elements} elements exceed the limit of "
                f"{settings.max_elements} per tensor (SDPA_MAX_ELEMENTS); {hint} at "
                f"heads = {syn.heads}, d_k = {syn.d_k}",
            )
    scores = syn.heads * syn.n_q * syn.n_k
    if scores > settings.max_weights_elements:
        hint = _pair_hint(settings.max_weights_elements // syn.heads, syn.n_q, "n_q", "n_k")
        raise over_limit(
            ("body", "synthetic"),
            f"heads x n_q x n_k = {scores} scores exceed the limit of "
            f"{settings.max_weights_elements} (SDPA_MAX_WEIGHTS_ELEMENTS); {hint} at "
            f"heads = {syn.heads}",
        )


# ---- work and response size ----------------------------------------------------------------

# Bytes per number of a JSON list, at most: a float32 (float16, bfloat16) written in its
# shortest form ("-1.2345678e-05") plus a comma; a float64 ("-1.2345678901234567e-308").
_JSON_BYTES = {4: 16, 8: 25}
# The summary scalars, meta and keys of a response: a constant next to any tensor.
_ENVELOPE_BYTES = 4096


def check_work(
    shape: WorkShape,
    path: str,
    *,
    cost: CostModel,
    settings: Settings,
    loc: Loc,
    how: str,
) -> None:
    """The request's estimated work must fit SDPA_MAX_REQUEST_FLOPS; `how` says how to shrink it."""
    work = cost.work(shape, path)
    limit = cost.work_limit(settings.max_request_flops, settings.max_compute_s)
    if work <= limit:
        return
    seconds = cost.seconds(shape, path)
    limit_s = limit * cost.paths["fused"].seconds_per_flop
    raise over_limit(
        loc,
        f"this request would cost about {work:.3g} FLOPs of work ({path} path, about "
        f"{seconds:.3g} s of device time), above SDPA_MAX_REQUEST_FLOPS = {limit:.3g} (about "
        f"{limit_s:.3g} s). {how} {_work_hint(shape, path, cost=cost, limit=limit)}.",
        kind="work_limit",
    )


def _work_hint(shape: WorkShape, path: str, *, cost: CostModel, limit: float) -> str:
    """The largest N_kv at this request's N_q (and the largest N_q = N_kv) whose work fits the
    limit, its other dimensions (batch, heads, head dims, strategies) unchanged: the work grows
    with the score count B·H·N_q·N_kv."""

    def fits(n_q: int, n_kv: int) -> bool:
        return cost.work(replace(shape, n_q=n_q, n_kv=n_kv), path) <= limit

    per_score = cost.work(replace(shape, batch=1, heads=1, n_q=1, n_kv=1), path)
    heads = shape.batch * shape.heads
    scores = int(limit / per_score) // heads if per_score > 0 else 0
    at_this_q = largest_fitting(lambda n: fits(shape.n_q, n), scores // shape.n_q)
    square = largest_fitting(lambda n: fits(n, n), math.isqrt(scores))
    hint = (
        f"The largest that fits: N_kv = {at_this_q} at N_q = {shape.n_q}"
        if at_this_q
        else f"No N_kv fits at N_q = {shape.n_q}"
    )
    if square:
        hint += f", or N_q = N_kv = {square}"
    return hint + f", at B·H = {heads}"


def attention_work_hint(path: str) -> str:
    """How to bring an attention request's work under the limit."""
    hint = (
        "Send fewer sequences, heads or query rows per request (split it: the work grows as "
        "B·H·N_q·N_kv·(D + D_v))"
    )
    if path != "fused":
        hint += ', or ask for diagnostics "none" without weights (the fused path is cheaper)'
    return hint + "."


def response_bytes(
    spec: InputSpec,
    *,
    encoding: str,
    return_weights: bool,
    diagnostics: str,
    return_output: bool = True,
) -> int:
    """An upper estimate of the response's size in `encoding` ("json", "base64", or v2's raw
    "binary" data), before anything is computed. Without `return_output` the output is not
    sent: it counts no bytes."""
    itemsize = spec.dtype.itemsize
    per_number = {"base64": itemsize * 4 / 3, "binary": itemsize}.get(
        encoding, _JSON_BYTES[max(itemsize, 4)]
    )
    rows = spec.batch * spec.heads * spec.n_q
    numbers = (rows * spec.d_v if return_output else 0) + (
        rows * spec.n_kv if return_weights else 0
    )
    size = numbers * per_number
    # Statistics are JSON lists on v1; binary tensors on v2 when its answer is binary.
    stat_bytes = (
        spec.accum_dtype.itemsize
        if encoding == "binary"
        else _JSON_BYTES[spec.accum_dtype.itemsize]
    )
    if diagnostics != "none":
        size += len(PER_HEAD_FIELDS) * spec.batch * spec.heads * stat_bytes
    if diagnostics == "full":
        size += len(PER_ROW_FIELDS) * rows * stat_bytes
    return int(size) + _ENVELOPE_BYTES


def answer_working_bytes(
    spec: InputSpec, *, encoding: str, return_weights: bool, diagnostics: str, response_bytes: int
) -> int:
    """The memory a request holds at its peak from compute to send, besides its body: the
    decoded inputs, the result tensors, and while they are encoded both the encoder's copy (the
    base64 text, or orjson's growing buffer) and the finished answer. A binary answer (v2) is
    written from the result tensors themselves: no copy. The in-flight limit reserves this
    before compute; once encoded, the request holds only its answer. The output tensor counts
    among the results even when it is not sent (return_output false): the compute makes it
    all the same; only its encoding is saved (response_bytes counts it then as nothing)."""
    itemsize = spec.dtype.itemsize
    rows = spec.batch * spec.heads * spec.n_q
    kv_rows = spec.batch * spec.kv_heads * spec.n_kv
    inputs = (rows * spec.d + kv_rows * (spec.d + spec.d_v)) * itemsize
    results = rows * spec.d_v * itemsize + (rows * spec.n_kv * itemsize if return_weights else 0)
    if diagnostics == "full":
        results += len(PER_ROW_FIELDS) * rows * spec.accum_dtype.itemsize
    if encoding == "binary":
        return inputs + results + _ENVELOPE_BYTES
    return inputs + results + 2 * response_bytes


def check_response_size(
    spec: InputSpec,
    *,
    encoding: str,
    return_weights: bool,
    diagnostics: str,
    settings: Settings,
    return_output: bool = True,
) -> int:
    """The response must fit SDPA_MAX_RESPONSE_BYTES in the encoding it would be sent in.
    -> its estimated size."""
    size = response_bytes(
        spec,
        encoding=encoding,
        return_weights=return_weights,
        diagnostics=diagnostics,
        return_output=return_output,
    )
    if size <= settings.max_response_bytes:
        return size
    advice = []
    if encoding == "json":
        as_base64 = response_bytes(
            spec,
            encoding="base64",
            return_weights=return_weights,
            diagnostics=diagnostics,
            return_output=return_output,
        )
        advice.append(f'response_encoding "base64" (about {as_base64 / MB:.3g} MB)')
    if return_weights:
        advice.append("no weights (return_weights false)")
    if diagnostics == "full":
        advice.append('diagnostics "summary" instead of "full"')
    advice.append("fewer queries per request")
    raise over_limit(
        ("body", "return_weights") if return_weights else ("body", "response_encoding"),
        f"the response would take about {size / MB:.3g} MB in {encoding}, above "
        f"SDPA_MAX_RESPONSE_BYTES = {settings.max_response_bytes / MB:.3g} MB; ask for "
        + ", or ".join(advice),
        kind="response_limit",
    )
