"""POST /v1/attention (and its alias POST /attention): one handler.

The hot path avoids FastAPI's body-parameter machinery: the handler reads the raw bytes, parses
them with pydantic_core.from_json, validates the envelope with pydantic and decodes tensors with
numpy (service.codec). The OpenAPI document still describes the body: the route declares it through
openapi_extra, and app.py adds the schemas to components.

Flow: parse + decode -> sdpa_core.validate_inputs (a 422 before queueing) -> limits -> a Job
-> the batcher (which runs the engine on the device thread) -> encode. Large bodies are decoded
and large results encoded on a worker thread, so the event loop never blocks on megabytes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import anyio.to_thread
import torch
from fastapi import APIRouter, Request
from starlette.responses import Response

from sdpa_core import Diagnostics, InputSpec, validate_inputs
from service.batcher import BatchResult
from service.cancellation import ClientDisconnected, cancel_on_disconnect
from service.codec import (
    Decoded,
    EncodingName,
    decode_int_list,
    decode_tensor,
    dumps,
    encode_tensor,
    finite_or_none,
    loads,
    to_numpy,
    wire_dtype_name,
)
from service.engine import AnalyzeJob, AttentionJob, AttentionOutcome
from service.errors import FieldError, InvalidRequest
from service.schemas import (
    ATTENTION_EXAMPLE,
    AttentionRequest,
    compute_responses,
    json_ref,
    validate_request,
)
from service.settings import Settings

router = APIRouter()

# Bodies (and results) above this size are decoded (encoded) on a worker thread: below it the
# work takes well under a few milliseconds on the loop, less than the thread hop would add to
# the small-payload latency; above it, parsing megabytes would stall every other request.
OFFLOAD_BYTES: Final = 1 << 20
# Status logged for a client that went away before its answer (nginx's "client closed request").
CLIENT_CLOSED: Final = 499

T = TypeVar("T")


# ---- shared by the compute routes ----------------------------------------------------------


async def off_loop_if(big: bool, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a worker thread when `big`, inline otherwise."""
    if big:
        return await anyio.to_thread.run_sync(fn, *args)
    return fn(*args)


@dataclass(frozen=True, slots=True)
class Masks:
    key_lengths: torch.Tensor | None
    key_padding_mask: Decoded | None
    attn_mask: Decoded | None


def decode_masks(
    key_lengths: list[Any] | int | None,
    key_padding_mask: Any,
    attn_mask: Any,
    *,
    max_elements: int,
) -> Masks:
    """The mask options of a request as tensors (None where absent)."""
    return Masks(
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
        ),
        attn_mask=None
        if attn_mask is None
        else decode_tensor(
            attn_mask, loc=("body", "attn_mask"), role="mask", max_elements=max_elements
        ),
    )


def over_limit(loc: tuple[str | int, ...], msg: str, *, kind: str = "limit") -> InvalidRequest:
    """A 422 for one field; `kind` is the error's type."""
    return InvalidRequest(msg, errors=[FieldError(loc=loc, msg=msg, type=kind)])


def request_id(request: Request) -> str:
    """The id the access log gave this request (a fresh one if it ran without the middleware)."""
    rid = getattr(request.state, "request_id", None)
    if not isinstance(rid, str):
        rid = uuid.uuid4().hex
        request.state.request_id = rid
    return rid


async def run_job(request: Request, job: AttentionJob | AnalyzeJob, *, deadline: float) -> Any:
    """Submit `job` to the batcher; cancel it if the client disconnects. -> BatchResult."""
    batcher = request.app.state.batcher
    return await cancel_on_disconnect(request, batcher.submit(job, deadline=deadline))


def response_meta(
    request: Request,
    batch: BatchResult[Any],
    *,
    device: str,
    dtype: torch.dtype,
    compute_ms: float,
) -> dict[str, Any]:
    """The meta fields every computed response carries (DESIGN.md, HTTP API)."""
    return {
        "device": device,
        "dtype": wire_dtype_name(dtype),
        "batch_size": batch.batch_size,
        "queue_ms": round(batch.queue_ms, 3),
        "compute_ms": round(compute_ms, 3),
        "request_id": request_id(request),
    }


def deadline_for(timeout_ms: float | None, settings: Settings, *, started: float) -> float:
    """time.monotonic() instant by which the request must have left the queue."""
    ms = settings.request_timeout_ms if timeout_ms is None else timeout_ms
    return started + ms / 1000.0


def server_timing(**phases_ms: float) -> str:
    """Server-Timing header value: decode;dur=0.41, queue;dur=0.02, ..."""
    return ", ".join(f"{name};dur={ms:.3f}" for name, ms in phases_ms.items())


def json_response(content: bytes, *, timing: str) -> Response:
    """A 200 with a body dumps() wrote, and the Server-Timing header."""
    return Response(
        content=content, media_type="application/json", headers={"Server-Timing": timing}
    )


def client_closed() -> Response:
    # Nobody reads this; it exists so the access log records what happened.
    return Response(status_code=CLIENT_CLOSED)


# ---- the attention route -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PreparedAttention:
    job: AttentionJob
    encoding: EncodingName
    timeout_ms: float | None


def check_attention_limits(spec: InputSpec, *, return_weights: bool, settings: Settings) -> None:
    """The output, and the weights when asked for, must fit the element limits."""
    rows = spec.batch * spec.heads * spec.n_q
    out_elements = rows * spec.d_v
    if out_elements > settings.max_elements:
        raise over_limit(
            ("body", "v"),
            f"the output [..., H, N_q, D_v] would hold {out_elements} elements, above the limit "
            f"of {settings.max_elements} per tensor (SDPA_MAX_ELEMENTS); send fewer sequences, "
            "heads or queries per request",
        )
    weights = rows * spec.n_kv
    if return_weights and weights > settings.max_weights_elements:
        raise over_limit(
            ("body", "return_weights"),
            f"the attention weights [..., H, N_q, N_kv] would hold {weights} elements, above "
            f"SDPA_MAX_WEIGHTS_ELEMENTS = {settings.max_weights_elements}. Ask for diagnostics "
            'without weights instead (return_weights: false, diagnostics: "summary" or "full"): '
            "they are computed in O(N) memory. Or send fewer queries or keys per request.",
        )


def prepare_attention(body: bytes, settings: Settings) -> PreparedAttention:
    """Body bytes -> a validated AttentionJob. Raises InvalidRequest / SdpaError (422)."""
    req = validate_request(loads(body), AttentionRequest)
    limit = settings.max_elements
    q = decode_tensor(req.q, loc=("body", "q"), role="float", max_elements=limit)
    k = decode_tensor(req.k, loc=("body", "k"), role="float", max_elements=limit)
    v = decode_tensor(req.v, loc=("body", "v"), role="float", max_elements=limit)
    masks = decode_masks(req.key_lengths, req.key_padding_mask, req.attn_mask, max_elements=limit)
    kpm = None if masks.key_padding_mask is None else masks.key_padding_mask.tensor
    attn_mask = None if masks.attn_mask is None else masks.attn_mask.tensor
    spec = validate_inputs(
        q.tensor,
        k.tensor,
        v.tensor,
        causal=req.causal,
        key_lengths=masks.key_lengths,
        key_padding_mask=kpm,
        attn_mask=attn_mask,
        scale=req.scale,
    )
    check_attention_limits(spec, return_weights=req.return_weights, settings=settings)
    job = AttentionJob(
        q=q.tensor,
        k=k.tensor,
        v=v.tensor,
        causal=req.causal,
        key_lengths=masks.key_lengths,
        key_padding_mask=kpm,
        attn_mask=attn_mask,
        scale=req.scale,
        return_weights=req.return_weights,
        diagnostics=req.diagnostics,
        checked=spec,
    )
    return PreparedAttention(
        job=job, encoding=req.response_encoding or q.encoding, timeout_ms=req.timeout_ms
    )


def diagnostics_json(diagnostics: Diagnostics | None) -> dict[str, Any] | None:
    """Diagnostics as JSON: summary scalars, per-head and per-row numpy arrays (nested lists)."""
    if diagnostics is None:
        return None
    summary: dict[str, Any] = {}
    for name, value in diagnostics.summary.as_dict().items():
        summary[name] = value if isinstance(value, int) else finite_or_none(float(value))
    per_head = {name: to_numpy(t) for name, t in diagnostics.per_head.as_dict().items()}
    per_row = (
        None
        if diagnostics.per_row is None
        else {name: to_numpy(t) for name, t in diagnostics.per_row.as_dict().items()}
    )
    return {"summary": summary, "per_head": per_head, "per_row": per_row}


def encode_attention(
    outcome: AttentionOutcome, *, encoding: EncodingName, meta: dict[str, Any]
) -> bytes:
    result = outcome.result
    payload = {
        "output": encode_tensor(result.output, encoding=encoding),
        "weights": None
        if result.weights is None
        else encode_tensor(result.weights, encoding=encoding),
        "diagnostics": diagnostics_json(result.diagnostics),
        "meta": meta,
    }
    return dumps(payload)


async def attention(request: Request) -> Response:
    """Scaled dot-product attention, with optional weights and diagnostics."""
    started = time.monotonic()
    settings: Settings = request.app.state.settings
    body = await request.body()
    received = time.monotonic()
    big = len(body) > OFFLOAD_BYTES
    prepared = await off_loop_if(big, prepare_attention, body, settings)
    decoded = time.monotonic()

    deadline = deadline_for(prepared.timeout_ms, settings, started=started)
    try:
        batch = await run_job(request, prepared.job, deadline=deadline)
    except ClientDisconnected:
        return client_closed()
    computed = time.monotonic()
    outcome = batch.value
    if not isinstance(outcome, AttentionOutcome):  # the engine answered another job kind
        raise TypeError(f"engine returned {type(outcome).__name__} for an attention job")
    request.state.batch_size = batch.batch_size

    result = outcome.result
    meta = {
        "path": result.path,
        "backend": result.backend,
        **response_meta(
            request,
            batch,
            device=outcome.device,
            dtype=prepared.job.q.dtype,
            compute_ms=outcome.compute_ms,
        ),
    }
    out_elements = result.output.numel() + (0 if result.weights is None else result.weights.numel())
    if result.diagnostics is not None and result.diagnostics.per_row is not None:
        # "full" adds six per-row tensors [..., H, N_q]; at long N_q they dominate the response.
        out_elements += 6 * result.diagnostics.per_row.entropy.numel()
    content = await off_loop_if(
        out_elements * 4 > OFFLOAD_BYTES,
        lambda: encode_attention(outcome, encoding=prepared.encoding, meta=meta),
    )
    encoded = time.monotonic()
    wait_ms = (computed - decoded) * 1000.0
    timing = server_timing(
        read=(received - started) * 1000.0,
        decode=(decoded - received) * 1000.0,
        queue=batch.queue_ms,
        compute=outcome.compute_ms,
        # What the wait held besides queue and compute: the device thread hop, batching.
        dispatch=max(0.0, wait_ms - batch.queue_ms - outcome.compute_ms),
        encode=(encoded - computed) * 1000.0,
    )
    return json_response(content, timing=timing)


_ATTENTION_BODY: Final[dict[str, Any]] = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {
                "schema": {"$ref": "#/components/schemas/AttentionRequest"},
                "example": ATTENTION_EXAMPLE,
            }
        },
    }
}

ATTENTION_SUMMARY: Final = "Scaled dot-product attention"
ATTENTION_DESCRIPTION: Final = (
    "softmax(q kᵀ · scale + mask) · v over q [..., H, N_q, D], k [..., H_kv, N_kv, D], "
    "v [..., H_kv, N_kv, D_v]. Tensors travel as {dtype, shape, data} (nested lists), "
    "{dtype, shape, b64} (little-endian bytes, the fast path) or a bare nested list. "
    "Masks combine by logical AND: causal, key_lengths, key_padding_mask (True = padding), "
    "attn_mask (bool True = attend, or an additive float bias). A fully masked row yields "
    "zeros. The Server-Timing header splits the server's time into read, decode, queue, "
    "compute, dispatch and encode."
)


for _path, _operation_id, _summary in (
    ("/v1/attention", "attention", ATTENTION_SUMMARY),
    ("/attention", "attention_alias", "Alias of POST /v1/attention"),
):
    router.add_api_route(
        _path,
        attention,
        methods=["POST"],
        operation_id=_operation_id,
        summary=_summary,
        description=ATTENTION_DESCRIPTION,
        openapi_extra=_ATTENTION_BODY,
        responses=compute_responses(json_ref("AttentionResponse"), "The attention result."),
        tags=["attention"],
    )
