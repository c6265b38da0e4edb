"""GET /healthz, /readyz, /v1/info and /metrics.

/healthz is liveness: 200 whenever the process serves HTTP. /readyz is readiness: 200 only after
the warm-up call ran on the device and while the batcher runs and is not draining, so an
orchestrator sends traffic only where it will be computed (Triton's probes answering before a
model is usable are the anchor's known bug, see reference/serving-anchors.md 3.4).
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, Final

import torch
from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import PlainTextResponse, Response

from service.codec import dumps
from service.problems import problem_response
from service.schemas import UNAUTHORIZED_DOC, json_ref, problem_doc
from service.settings import Settings

router = APIRouter()

DTYPES: Final = ("float16", "bfloat16", "float32", "float64")


def _version() -> str:
    try:
        return metadata.version("sdpa-service")
    except metadata.PackageNotFoundError:  # running from a checkout that was never installed
        return "0.0.0+unknown"


def _json(payload: Any) -> Response:
    return Response(content=dumps(payload), media_type="application/json")


def _ok(schema: str, description: str, example: Any) -> dict[str, Any]:
    content = {"application/json": {"schema": json_ref(schema), "example": example}}
    return {"description": description, "content": content}


_INFO_EXAMPLE: Final = {
    "version": "0.1.0",
    "device": "cpu",
    "torch_version": "2.13.0+cpu",
    "dtypes": list(DTYPES),
    "limits": {
        "max_body_bytes": 134217728,
        "max_elements": 67108864,
        "max_weights_elements": 67108864,
        "request_timeout_ms": 30000.0,
    },
    "batching": {"max_batch_size": 32, "max_batch_delay_ms": 0.0, "max_queue": 1024},
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


def not_ready_reason(request: Request) -> str | None:
    """Why the service is not ready, or None when it is."""
    state = request.app.state
    batcher = getattr(state, "batcher", None)
    if batcher is None:
        return "starting"
    if batcher.draining:
        return "draining: the service is shutting down"
    if not batcher.running:
        return "the device worker is not running"
    if getattr(state, "warmup_error", None) is not None:
        return "warm-up on the device failed (see the server log)"
    if not getattr(state, "warmed_up", False):
        return "warming up on the device"
    return None


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
async def readyz(request: Request) -> Response:
    reason = not_ready_reason(request)
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
async def info(request: Request) -> Response:
    settings: Settings = request.app.state.settings
    engine = getattr(request.app.state, "engine", None)
    return _json(
        {
            "version": _version(),
            "device": str(engine.device) if engine is not None else settings.device,
            "torch_version": torch.__version__,
            "dtypes": list(DTYPES),
            "limits": {
                "max_body_bytes": settings.max_body_bytes,
                "max_elements": settings.max_elements,
                "max_weights_elements": settings.max_weights_elements,
                "request_timeout_ms": settings.request_timeout_ms,
            },
            "batching": {
                "max_batch_size": settings.max_batch_size,
                "max_batch_delay_ms": settings.max_batch_delay_ms,
                "max_queue": settings.max_queue,
            },
            "auth": bool(getattr(request.app.state, "auth_enabled", False)),
        }
    )


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
async def metrics(request: Request) -> Response:
    registry = request.app.state.metrics.registry
    return Response(content=generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
