"""GET /healthz, /readyz, /v1/info and /metrics.

/healthz is liveness: 200 whenever the process serves HTTP. /readyz is readiness: 200 only after
the warm-up call ran on the device and while the batcher runs and is not draining, so an
orchestrator sends traffic only where it will be computed (Triton's probes answering before a
model is usable are a known problem of other servers).
"""

from __future__ import annotations

import math
from typing import Any, Final

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import PlainTextResponse, Response

from service.api.deps import MetricsDep, StateDep
from service.api.openapi import UNAUTHORIZED_DOC, json_ref, problem_doc
from service.http_errors import problem_response
from service.serving.exchange import exchange_of
from service.serving.state import TORCH_VERSION, AppState
from service.version import VERSION
from service.wire.codec import FLOAT_DTYPE_NAMES, dumps

router = APIRouter()


def _json(payload: Any) -> Response:
    return Response(content=dumps(payload), media_type="application/json")


def _ok(schema: str, description: str, example: Any) -> dict[str, Any]:
    content = {"application/json": {"schema": json_ref(schema), "example": example}}
    return {"description": description, "content": content}


_INFO_EXAMPLE: Final = {
    "version": VERSION,
    "device": "cpu",
    "torch_version": "2.13.0+cpu",
    "diagnostics_kernel": "compiled",
    "kernels": {
        "triton": {"device": "cuda", "available": False, "reason": "no CUDA device"},
        "cpu_flash": {"device": "cpu", "available": True, "reason": ""},
    },
    "dtypes": list(FLOAT_DTYPE_NAMES),
    "limits": {
        "max_body_bytes": 134217728,
        "max_elements": 67108864,
        "max_weights_elements": 67108864,
        "request_timeout_ms": 30000.0,
        "max_request_flops": 1.14e12,
        "max_compute_s": 10.0,
        "max_response_bytes": 268435456,
        "max_inflight_bytes": 6317703168,
        "read_timeout_s": 15.0,
        "send_timeout_s": 60.0,
        "max_connections": 2048,
        "max_header_bytes": 32768,
        "max_headers": 100,
        "max_pipelined_requests": 8,
        "min_body_rate": 32768,
    },
    "cost_model": {
        "calibrated": True,
        "paths": {
            "fused": {"gflops_per_second": 127.5, "d_floor": 30, "overhead_ms": 0.05},
            "dense": {"gflops_per_second": 49.9, "d_floor": 63, "overhead_ms": 0.9},
            "chunked": {"gflops_per_second": 49.6, "d_floor": 59, "overhead_ms": 0.9},
            "analyze": {"gflops_per_second": 11.2, "d_floor": 96, "overhead_ms": 4.0},
        },
    },
    "batching": {
        "max_batch_size": 32,
        "max_batch_delay_ms": 0.0,
        "max_queue": 1024,
        "slice_ms": 50.0,
        "backlog_seconds": 0.0,
    },
    "tenants": {
        "max_queue_share": 1.0,
        "max_queue_per_tenant": 1024,
        "priority_levels": 3,
        "default_priority": 2,
        "tenants": [{"name": "anonymous", "weight": 1.0, "share": 1.0, "backlog_seconds": 0.0}],
    },
    "auth": False,
}


@router.get(
    "/healthz",
    operation_id="healthz",
    summary="Liveness",
    responses={200: _ok("HealthOut", "The process serves HTTP.", {"status": "ok"})},
    tags=["health"],
)
async def healthz() -> Response:
    return _json({"status": "ok"})


@router.get(
    "/readyz",
    operation_id="readyz",
    summary="Readiness",
    responses={
        200: _ok("HealthOut", "Warmed up on the device; accepting work.", {"status": "ready"}),
        503: problem_doc("Not ready: warming up, or draining on shutdown.", retry_after=True),
    },
    tags=["health"],
)
async def readyz(state: StateDep) -> Response:
    reason = state.not_ready_reason()
    if reason is None:
        return _json({"status": "ready"})
    return problem_response(status=503, detail=f"not ready: {reason}", headers={"Retry-After": "1"})


@router.get(
    "/v1/info",
    operation_id="info",
    summary="Version, device, limits and batching",
    responses={
        200: _ok("InfoOut", "What this server runs and accepts.", _INFO_EXAMPLE),
        401: UNAUTHORIZED_DOC,
    },
    tags=["health"],
)
async def info(request: Request, state: StateDep) -> Response:
    settings, cost = state.settings, state.cost_model
    return _json(
        {
            "version": VERSION,
            "device": state.device_name(),
            "torch_version": TORCH_VERSION,
            "diagnostics_kernel": state.diagnostics_kernel,
            "kernels": state.flash_kernels(),
            "dtypes": list(FLOAT_DTYPE_NAMES),
            "limits": {
                "max_body_bytes": settings.max_body_bytes,
                "max_elements": settings.max_elements,
                "max_weights_elements": settings.max_weights_elements,
                "request_timeout_ms": settings.request_timeout_ms,
                # In the cost model's fused-equivalent FLOPs (auto: max_compute_s of them).
                "max_request_flops": cost.work_limit(
                    settings.max_request_flops, settings.max_compute_s
                ),
                "max_compute_s": settings.max_compute_s,
                "max_response_bytes": settings.max_response_bytes,
                "max_inflight_bytes": state.max_inflight_bytes,
                "read_timeout_s": settings.read_timeout_s,
                "send_timeout_s": settings.send_timeout_s,
                "max_connections": settings.max_connections,
                "max_header_bytes": settings.max_header_bytes,
                "max_headers": settings.max_headers,
                "max_pipelined_requests": settings.max_pipelined_requests,
                "min_body_rate": settings.min_body_rate,
            },
            "cost_model": cost.as_json(),
            "batching": {
                "max_batch_size": settings.max_batch_size,
                "max_batch_delay_ms": settings.max_batch_delay_ms,
                "max_queue": settings.max_queue,
                "slice_ms": settings.slice_ms,
                "backlog_seconds": 0.0
                if state.batcher is None
                else round(state.batcher.backlog_seconds(), 3),
            },
            # A keyed caller sees its own tenant only (names, weights and backlogs are others').
            "tenants": _tenants(
                state, viewer=exchange_of(request.scope).tenant if state.auth_enabled else None
            ),
            "auth": state.auth_enabled,
        }
    )


def _tenants(state: AppState, *, viewer: str | None) -> dict[str, object]:
    """The tenants, their weights and shares (service.tenants): names only, never keys; with
    a `viewer` (a keyed caller's tenant), that tenant's entry alone."""
    settings, batcher = state.settings, state.batcher
    names = sorted(settings.tenant_names())
    weights = {name: settings.tenant_weights.get(name, 1.0) for name in names}
    total = sum(weights.values())
    share = settings.queue_share()
    return {
        "max_queue_share": share,
        "max_queue_per_tenant": max(1, math.floor(settings.max_queue * share)),
        "priority_levels": settings.priority_levels,
        "default_priority": settings.default_priority,
        "tenants": [
            {
                "name": name,
                "weight": weight,
                "share": round(weight / total, 6),
                "backlog_seconds": 0.0
                if batcher is None
                else round(batcher.tenant_backlog_seconds(name), 3),
            }
            for name, weight in weights.items()
            if viewer is None or name == viewer
        ],
    }


@router.get(
    "/metrics",
    operation_id="metrics",
    summary="Prometheus metrics",
    responses={
        200: {
            "description": "Prometheus text exposition format.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        401: UNAUTHORIZED_DOC,
    },
    tags=["health"],
    response_class=PlainTextResponse,
)
async def metrics(metrics: MetricsDep) -> Response:
    # Off the event loop, one rendering at a time, shared by the scrapes waiting for it and
    # spaced by its cost (service.metrics.Renderings): 256 tags of 64-head layers take 0.7 s.
    text = await metrics.renderings.latest()
    return Response(content=text, media_type=CONTENT_TYPE_LATEST)
