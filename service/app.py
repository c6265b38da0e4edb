"""create_app(settings): the FastAPI application, its lifespan and its error handlers.

Request flow: middlewares (access log -> API key -> body limit / content type) -> route ->
parse + decode (schemas, codec) -> sdpa_core.validate_inputs (422 before queueing) -> the
DynamicBatcher -> Engine.run_batch on the device thread -> encode.

This module is the one place that maps exceptions to HTTP responses: ServiceError subclasses to
their status, sdpa_core's SdpaError to 422 with the parameter's loc, routing errors (404/405) to
problem+json, and anything else to a generic 500 whose traceback goes to the log only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from importlib import metadata
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi_offline import FastAPIOffline
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from sdpa_core import SdpaError
from service.access_log import AccessLogMiddleware
from service.auth import ApiKeyMiddleware
from service.batcher import DynamicBatcher
from service.body_limit import BodyLimitMiddleware
from service.engine import Engine, resolve_device
from service.errors import FieldError, ServiceError
from service.metrics import Metrics
from service.problems import problem_response, service_error_response
from service.routes import analyze, attention, health, ui
from service.schemas import REQUEST_MODELS, RESPONSE_MODELS, field_errors
from service.settings import Settings

logger = logging.getLogger("sdpa.app")

# Where the docs pages' scripts and styles are served (GET /docs, GET /redoc use them).
DOCS_ASSETS = "/docs-assets"

DESCRIPTION = """\
Scaled dot-product attention as an HTTP service that explains itself: outputs, attention
weights and diagnostics (entropy, score variance before and after scaling, saturation,
softmax-gradient health, fully masked rows), and a comparison of score-scaling strategies.

Tensors travel as `{"dtype", "shape", "data"}` (nested lists), `{"dtype", "shape", "b64"}`
(little-endian bytes: the fast path) or a bare nested list. Every error is
`application/problem+json` with `errors[].loc` naming the field.
"""


def _version() -> str:
    try:
        return metadata.version("sdpa-service")
    except metadata.PackageNotFoundError:  # a checkout that was never installed
        return "0.0.0+unknown"


# ---- lifespan ------------------------------------------------------------------------------


async def _warm_up(app: FastAPI, engine: Engine, batcher: DynamicBatcher[Any, Any]) -> None:
    """One real attention call on the device thread; /readyz turns 200 after it."""
    try:
        await batcher.run_on_device(engine.warmup)
    except Exception as exc:
        # Stay alive (liveness) but never ready: the log says why.
        logger.exception("warm-up on %s failed", engine.device)
        app.state.warmup_error = repr(exc)
        return
    app.state.warmed_up = True
    logger.info("warmed up on %s", engine.device)


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    engine = Engine(resolve_device(settings.device), metrics=app.state.metrics)
    batcher = DynamicBatcher(
        engine.run_batch,
        group_key=engine.group_key,
        # The batcher cuts batches by the engine's cost (padded score bytes) as well as by count,
        # so it never takes more than the engine runs in one call.
        batch_cost=engine.batch_cost,
        max_batch_cost=engine.max_batch_cost,
        max_batch_size=settings.max_batch_size,
        max_batch_delay_s=settings.max_batch_delay_ms / 1000.0,
        max_queue=settings.max_queue,
        metrics=app.state.metrics,
    )
    app.state.engine = engine
    app.state.batcher = batcher
    await batcher.start()
    # Warm-up runs beside serving, so liveness answers at once and readiness tells the truth.
    warm_up = asyncio.create_task(_warm_up(app, engine, batcher))
    try:
        yield
    finally:
        # Idempotent: service.server drains on SIGTERM before the lifespan ends.
        await batcher.drain(settings.drain_timeout_s)
        warm_up.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await warm_up


# ---- error handlers ------------------------------------------------------------------------


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


async def _on_service_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServiceError)
    return service_error_response(exc)


async def _on_sdpa_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SdpaError)
    parts = [exc.message]
    if exc.expected is not None:
        parts.append(f"expected {exc.expected}")
    if exc.got is not None:
        parts.append(f"got {exc.got}")
    error = FieldError(
        loc=("body", *exc.param.split(".")), msg="; ".join(parts), type=_snake(type(exc).__name__)
    )
    return problem_response(status=422, detail=str(exc), errors=[error])


async def _on_request_validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    errors = field_errors(exc.errors(), prefix=())
    detail = f"{len(errors)} invalid field(s)" if errors else "invalid request"
    return problem_response(status=422, detail=detail, errors=errors)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return problem_response(status=exc.status_code, detail=str(exc.detail), headers=exc.headers)


async def _on_device_oom(request: Request, exc: Exception) -> Response:
    # Memory on the device is shared by whatever runs at the moment: a retry may well fit.
    logger.warning("device out of memory: %s", exc)
    return problem_response(
        status=503,
        detail="the device ran out of memory; retry later, or send a smaller request",
        headers={"Retry-After": "1"},
    )


async def _on_unhandled(request: Request, exc: Exception) -> Response:
    rid = getattr(request.state, "request_id", None)
    logger.exception("unhandled error (request_id=%s)", rid, exc_info=exc)
    detail = "internal server error" + (f"; request id {rid}" if rid else "")
    # Starlette runs this handler in ServerErrorMiddleware, outside the access log's send
    # wrapper: echo the id here, so that the one response an operator must trace carries it.
    headers = {"X-Request-ID": rid} if isinstance(rid, str) else None
    return problem_response(status=500, detail=detail, headers=headers)


# ---- OpenAPI -------------------------------------------------------------------------------


def _openapi_document(app: FastAPI, *, auth: bool) -> dict[str, Any]:
    """FastAPI's document plus our wire schemas (the hot routes declare their bodies by $ref)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    _, defs = models_json_schema(
        [(model, "validation") for model in REQUEST_MODELS]
        + [(model, "serialization") for model in RESPONSE_MODELS],
        ref_template="#/components/schemas/{model}",
    )
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {}).update(defs.get("$defs", {}))
    if auth:
        components["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"},
        }
        schema["security"] = [{"bearer": []}, {"apiKey": []}]
        for path in ("/healthz", "/readyz"):
            for operation in schema["paths"].get(path, {}).values():
                operation["security"] = []
    app.openapi_schema = schema
    return schema


# ---- the factory ---------------------------------------------------------------------------


def create_app(settings: Settings | None = None) -> FastAPI:
    """The service. `settings` None reads them from the environment (SDPA_*), here only."""
    settings = settings if settings is not None else Settings()
    metrics = Metrics()
    api_keys = settings.resolved_api_keys()

    # A FastAPI app whose /docs and /redoc pages load Swagger UI and ReDoc from this service
    # (DOCS_ASSETS), not from a CDN: they work on a cluster without internet access.
    app = FastAPIOffline(
        title="sdpa-service",
        version=_version(),
        description=DESCRIPTION,
        lifespan=_lifespan,
        static_url=DOCS_ASSETS,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.warmed_up = False
    app.state.warmup_error = None
    app.state.auth_enabled = bool(api_keys)

    app.add_exception_handler(ServiceError, _on_service_error)
    app.add_exception_handler(SdpaError, _on_sdpa_error)
    app.add_exception_handler(RequestValidationError, _on_request_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    app.add_exception_handler(torch.OutOfMemoryError, _on_device_oom)
    app.add_exception_handler(Exception, _on_unhandled)

    app.include_router(attention.router)
    app.include_router(analyze.router)
    app.include_router(health.router)
    app.include_router(ui.router)

    # add_middleware puts each new one outermost: the order below is innermost first, so a
    # request meets the access log, then the API key check, then the body limit.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes, metrics=metrics)
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=api_keys, metrics=metrics)
    app.add_middleware(AccessLogMiddleware, metrics=metrics)

    def openapi() -> dict[str, Any]:
        return _openapi_document(app, auth=bool(api_keys))

    app.openapi = openapi  # type: ignore[method-assign]
    return app
