"""POST /v1/analyze: compare divisors of the raw scores q.k (none, sqrt_dk, dk, ...).

On q and k from the request, or on seeded synthetic ones. The job takes the same queue and device
worker as attention requests (as a group of one), so it counts against the same limits, metrics
and deadlines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final

import anyio.to_thread
import torch
from fastapi import APIRouter, Request
from starlette.responses import Response

from sdpa_core import ScalingReport, make_synthetic_qk, validate_inputs
from service.cancellation import ClientDisconnected
from service.codec import decode_tensor, dumps, finite_or_none, loads
from service.engine import AnalyzeJob, AnalyzeOutcome
from service.routes.attention import (
    client_closed,
    deadline_for,
    decode_masks,
    json_response,
    over_limit,
    response_meta,
    run_job,
    server_timing,
)
from service.schemas import (
    ANALYZE_EXAMPLE,
    AnalyzeRequest,
    CustomStrategy,
    Synthetic,
    compute_responses,
    json_ref,
    validate_request,
)
from service.settings import Settings

router = APIRouter()

_TORCH_DTYPES: Final = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


@dataclass(frozen=True, slots=True)
class PreparedAnalyze:
    job: AnalyzeJob
    timeout_ms: float | None


def _synthetic(syn: Synthetic, settings: Settings) -> tuple[torch.Tensor, torch.Tensor]:
    for name, n in (("n_q", syn.n_q), ("n_k", syn.n_k)):
        elements = syn.heads * n * syn.d_k
        if elements > settings.max_elements:
            raise over_limit(
                ("body", "synthetic", name),
                f"heads x {name} x d_k = {elements} elements exceed the limit of "
                f"{settings.max_elements} per tensor (SDPA_MAX_ELEMENTS)",
            )
    # Refuse work over the score limit before drawing any random numbers (the same limit
    # prepare_analyze applies to given q and k, checked here first because drawing is costly).
    scores = syn.heads * syn.n_q * syn.n_k
    if scores > settings.max_weights_elements:
        raise over_limit(
            ("body", "synthetic"),
            f"heads x n_q x n_k = {scores} scores exceed the limit of "
            f"{settings.max_weights_elements} (SDPA_MAX_WEIGHTS_ELEMENTS)",
        )
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


def prepare_analyze(body: bytes, settings: Settings) -> PreparedAnalyze:
    """Body bytes -> a validated AnalyzeJob. Raises InvalidRequest / SdpaError (422)."""
    req = validate_request(loads(body), AnalyzeRequest)
    limit = settings.max_elements
    if req.synthetic is not None:
        q, k = _synthetic(req.synthetic, settings)
        where: tuple[str | int, ...] = ("body", "synthetic")
    else:
        # AnalyzeRequest guarantees both.
        assert req.q is not None
        assert req.k is not None
        q = decode_tensor(req.q, loc=("body", "q"), role="float", max_elements=limit).tensor
        k = decode_tensor(req.k, loc=("body", "k"), role="float", max_elements=limit).tensor
        where = ("body", "k")
    masks = decode_masks(req.key_lengths, req.key_padding_mask, req.attn_mask, max_elements=limit)
    kpm = None if masks.key_padding_mask is None else masks.key_padding_mask.tensor
    attn_mask = None if masks.attn_mask is None else masks.attn_mask.tensor
    # v = k: the analysis needs no values, and k passes every check that v must.
    spec = validate_inputs(
        q,
        k,
        k,
        causal=req.causal,
        key_lengths=masks.key_lengths,
        key_padding_mask=kpm,
        attn_mask=attn_mask,
    )
    scores = spec.batch * spec.heads * spec.n_q * spec.n_kv
    if scores > settings.max_weights_elements:
        raise over_limit(
            where,
            f"the analysis holds the [..., H, N_q, N_kv] scores: {scores} elements, above "
            f"SDPA_MAX_WEIGHTS_ELEMENTS = {settings.max_weights_elements}; use fewer queries or "
            "keys (a few hundred of each estimate the statistics well)",
        )
    strategies = (
        None
        if req.strategies is None
        else tuple(
            (s.name, s.divisor) if isinstance(s, CustomStrategy) else s for s in req.strategies
        )
    )
    job = AnalyzeJob(
        q=q,
        k=k,
        strategies=strategies,
        causal=req.causal,
        key_lengths=masks.key_lengths,
        key_padding_mask=kpm,
        attn_mask=attn_mask,
    )
    return PreparedAnalyze(job=job, timeout_ms=req.timeout_ms)


def report_json(report: ScalingReport) -> dict[str, Any]:
    return {
        "d_k": int(report.d_k),
        "raw_score_variance": finite_or_none(float(report.raw_score_variance)),
        "recommended_divisor": finite_or_none(float(report.recommended_divisor)),
        "strategies": [
            {
                "name": s.name,
                "divisor": finite_or_none(float(s.divisor)),
                "score_variance": finite_or_none(float(s.score_variance)),
                "entropy": finite_or_none(float(s.entropy)),
                "normalized_entropy": finite_or_none(float(s.normalized_entropy)),
                "max_weight": finite_or_none(float(s.max_weight)),
                "saturated_fraction": finite_or_none(float(s.saturated_fraction)),
                "grad_health": finite_or_none(float(s.grad_health)),
            }
            for s in report.strategies
        ],
    }


async def analyze(request: Request) -> Response:
    """Compare scaling strategies of the raw attention scores."""
    started = time.monotonic()
    settings: Settings = request.app.state.settings
    body = await request.body()
    received = time.monotonic()
    # Always off the loop: synthetic inputs are generated here, and analysis is not a hot path.
    prepared = await anyio.to_thread.run_sync(prepare_analyze, body, settings)
    decoded = time.monotonic()
    deadline = deadline_for(prepared.timeout_ms, settings, started=started)
    try:
        batch = await run_job(request, prepared.job, deadline=deadline)
    except ClientDisconnected:
        return client_closed()
    computed = time.monotonic()
    outcome = batch.value
    if not isinstance(outcome, AnalyzeOutcome):  # the engine answered another job kind
        raise TypeError(f"engine returned {type(outcome).__name__} for an analyze job")
    request.state.batch_size = batch.batch_size
    payload = report_json(outcome.report)
    payload["meta"] = response_meta(
        request,
        batch,
        device=outcome.device,
        dtype=prepared.job.q.dtype,
        compute_ms=outcome.compute_ms,
    )
    content = dumps(payload)
    timing = server_timing(
        read=(received - started) * 1000.0,
        decode=(decoded - received) * 1000.0,
        queue=batch.queue_ms,
        compute=outcome.compute_ms,
        encode=(time.monotonic() - computed) * 1000.0,
    )
    return json_response(content, timing=timing)


router.add_api_route(
    "/v1/analyze",
    analyze,
    methods=["POST"],
    operation_id="analyze",
    summary="Compare score-scaling strategies",
    description=(
        "How does dividing the raw scores q·k by each divisor shape the softmax? For each "
        "strategy (none, sqrt_dk, dk, dk_quarter, two_sqrt_dk and custom {name, divisor}): "
        "score variance, entropy, normalized entropy, max weight, saturated fraction and "
        "gradient health. Also the raw score variance and the recommended divisor (the std of "
        "the raw scores). Runs on q and k from the request, or on seeded synthetic data."
    ),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": json_ref("AnalyzeRequest"),
                    "example": ANALYZE_EXAMPLE,
                }
            },
        }
    },
    responses=compute_responses(json_ref("AnalyzeResponse"), "The scaling report."),
    tags=["analysis"],
)
