"""create_app(settings, *, engine=None): the FastAPI application, its lifespan and its rooms.

Request flow (docs/architecture.md): the protocol layer (service.protocol) -> the edge, which
makes the request's Exchange (service.middleware.access_log) -> API key -> content encoding ->
in-flight bytes -> body limit -> a thin route (service.api) -> serving's pipeline (decode,
admit, queue, compute, encode) -> the runtime's batcher, which runs the engine on the device
thread; the one recorder (service.access_log) turns the finished Exchange into the log line,
the metrics and the span. Errors map to responses in service.errors and the envelopes of
service.http_errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any, Final

import torch
from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from sdpa_core import compile_kernels
from service.api import analyze, attention, health, observe, ui, v2
from service.api.deps import state_of
from service.api.errors import install_error_handlers
from service.api.openapi import openapi_document
from service.metrics import Metrics
from service.middleware.access_log import AccessLogMiddleware
from service.middleware.auth import ApiKeyMiddleware
from service.middleware.body_limit import BodyLimitMiddleware
from service.middleware.content_encoding import ContentEncodingMiddleware
from service.middleware.drain import ConnectionCloseWhileDrainingMiddleware
from service.middleware.inflight import InflightBytesMiddleware, default_inflight_bytes
from service.middleware.metrics_key import METRICS_PATHS, MetricsKeyMiddleware
from service.protocol import unsent_bytes
from service.routes import OPEN_PATHS
from service.runtime.batcher import BatcherConfig, BatcherPolicy, DynamicBatcher
from service.runtime.device import keep_intra_op_threads, resolve_device
from service.runtime.engine import Engine
from service.runtime.heap import TRIM_EVERY_S, heap_trimmer, trim_heap_every
from service.runtime.policy import job_work
from service.serving.health import HealthMonitor
from service.serving.inflight import InflightBytes
from service.serving.state import AppState, Batcher
from service.settings import Settings
from service.tracing import Tracing
from service.version import VERSION

logger = logging.getLogger("sdpa.app")

# Where the docs pages' scripts and styles are served (GET /docs, GET /redoc use them).
DOCS_ASSETS: Final = "/docs-assets"

DESCRIPTION: Final = """\
Scaled dot-product attention as an HTTP service that explains itself: outputs, attention
weights and diagnostics (entropy, score variance before and after scaling, saturation,
softmax-gradient health, fully masked rows), and a comparison of score-scaling strategies.

Tensors travel as `{"dtype", "shape", "data"}` (nested lists), `{"dtype", "shape", "b64"}`
(little-endian bytes: the fast path) or a bare nested list. Every error is
`application/problem+json` with `errors[].loc` naming the field.
"""


# ---- lifespan ------------------------------------------------------------------------------


async def _warm_up(state: AppState, engine: Engine, batcher: DynamicBatcher[Any, Any]) -> None:
    """Real attention calls on the device thread, then the cost model measured there;
    /readyz turns 200 after both."""
    try:
        if state.settings.compile_kernels and engine.device.type == "cpu":
            kernel = await batcher.run_on_device(compile_kernels)
            state.diagnostics_kernel = "compiled" if kernel.compiled else f"eager ({kernel.reason})"
        await batcher.run_on_device(engine.warmup)
        state.cost_model = await batcher.run_on_device(engine.calibrate)
    except Exception as exc:
        # Stay alive (liveness) but never ready: the log says why.
        logger.exception("warm-up on %s failed", engine.device)
        state.warmup_error = repr(exc)
        return
    state.warmed_up = True
    logger.info("warmed up on %s", engine.device, extra={"json_fields": state.cost_model.as_json()})


async def _give_intra_op_threads_to_the_device_thread(batcher: Batcher, threads: int) -> None:
    """torch's intra-op (OpenMP) threads for the device thread alone; every other thread
    (the event loop, the decoding and encoding workers) runs its torch calls inline.

    libgomp gives each thread that starts a parallel region a team of its own. Once the
    teams together hold more threads than the process has CPUs, it cuts every idle worker's
    spin to almost nothing, so the device thread's workers sleep and are woken again between
    the small kernels of the chunked path, whatever GOMP_SPINCOUNT says (BENCHMARKS.md). The
    device thread keeps `threads`: the count torch chose, read when the app was built (the
    process default is 1 after a first lifespan).
    """
    await batcher.run_on_device(functools.partial(keep_intra_op_threads, threads))
    # The process default, which threads take at their first torch call, and this thread's.
    torch.set_num_threads(1)


def _lifespan(engine: Engine | None, *, device_threads: int | None) -> Any:
    """The lifespan: start the batcher (with `engine`, or one built for the settings' device),
    warm up beside serving, drain on the way out. device_threads: the app is the process's (as
    `serve` runs it), so on the CPU it gives torch's intra-op threads, this many, to the device
    thread alone (a process-wide setting), and the heap's free pages go back to the OS
    periodically (service.runtime.heap)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = state_of(app)
        settings = state.settings
        # A fresh event per lifespan: an asyncio.Event belongs to the loop that first waits on
        # it, and a test may run an app's lifespan more than once.
        state.stopping = asyncio.Event()
        running = (
            engine
            if engine is not None
            else Engine(resolve_device(settings.device), metrics=state.metrics)
        )
        running.report_to(state.metrics)
        running.sink_tokens = settings.health_sink_tokens
        if running.device.type == "cuda":
            device = running.device
            state.metrics.track_device_memory(lambda: torch.cuda.memory_allocated(device))
        health = HealthMonitor(
            metrics=state.metrics,
            diagnose=running.diagnose,
            sample_rate=settings.health_sample_rate,
            max_tags=settings.health_max_tags,
            max_heads=settings.health_max_heads,
            tenant_weights={
                n: settings.tenant_weights.get(n, 1.0) for n in settings.tenant_names()
            },
        )
        policy = running.policy
        batcher: Batcher = DynamicBatcher(
            running.run_batch,
            BatcherPolicy(
                group_key=policy.group_key,
                # The batcher cuts batches by the engine's cost (padded score bytes) as well as
                # by count, so it never takes more than the engine runs in one call.
                batch_cost=policy.batch_cost,
                # Each request's estimated device seconds (the cost model, recalibrated at
                # warm-up): the backlog behind Retry-After and sdpa_backlog_seconds.
                work_seconds=lambda prepared: state.cost_model.seconds(*job_work(prepared)),
                # A request of more than one slice of that work runs alone in tiles, between
                # which its deadline and client are checked and short batches run: sdpa_core's
                # run, stepped as it is; each tile observed, the result made the Outcome.
                start_long=running.start_long,
                note_tile=running.note_tile,
                finish_long=running.finish_long,
            ),
            BatcherConfig(
                max_batch_size=settings.max_batch_size,
                max_queue=settings.max_queue,
                max_batch_delay_s=settings.max_batch_delay_ms / 1000.0,
                max_batch_cost=policy.max_batch_cost,
                slice_s=settings.slice_ms / 1000.0,
                # Fair shares across tenants (service.runtime.queue), and each one's queue share.
                tenant_weights={
                    name: settings.tenant_weights.get(name, 1.0) for name in settings.tenant_names()
                },
                tenant_queue_share=settings.queue_share(),
            ),
            metrics=state.metrics,
            # Sampled health summaries run on the device only while nothing is queued.
            idle_work=health.next_sample,
        )
        health.on_offer = batcher.wake
        state.engine = running
        state.batcher = batcher
        state.health = health
        await batcher.start()
        if device_threads is not None and running.device.type == "cpu":
            await _give_intra_op_threads_to_the_device_thread(batcher, device_threads)
        # Warm-up runs beside serving, so liveness answers at once and readiness tells the truth.
        warm_up = asyncio.create_task(_warm_up(state, running, batcher))
        trim = heap_trimmer() if device_threads is not None else None
        trimming = (
            None if trim is None else asyncio.create_task(trim_heap_every(TRIM_EVERY_S, trim))
        )
        try:
            yield
        finally:
            # Idempotent: service.server drains on SIGTERM before the lifespan ends.
            await batcher.drain(settings.drain_timeout_s)
            state.stopping.set()
            health.drop_pending()
            for task in (warm_up, trimming):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if state.tracing is not None:
                # The spans not exported yet, flushed in bounded time (off the loop: the
                # exporter's HTTP call blocks).
                await asyncio.to_thread(state.tracing.force_flush)

    return lifespan


# ---- the factory ---------------------------------------------------------------------------


def create_app(
    settings: Settings | None = None,
    *,
    engine: Engine | None = None,
    own_process: bool = False,
    tracing: Tracing | None = None,
) -> FastAPI:
    """The service.

    Args:
        settings: None reads them from the environment (SDPA_*), here and nowhere else.
        engine: the engine to run jobs on; None builds one for settings.device when the
            lifespan starts. Tests pass their own (a CPU engine with a small batch budget).
        own_process: the process is the app's (`serve`, a Ray replica): on the CPU its
            lifespan gives torch's intra-op threads to the device thread alone, and it returns
            the heap's free pages to the OS periodically, process-wide things that an app
            inside another program (a test) must not do.
        tracing: the spans' Tracing (a test's, with an in-memory exporter); None: the one
            the settings ask for (OTEL_TRACES_EXPORTER), or none.

    Returns:
        The FastAPI application; its lifespan starts the batcher and warms up the device.
    """
    settings = settings if settings is not None else Settings()
    metrics = Metrics()
    api_keys = settings.tenant_keys()

    # A FastAPI app whose /docs and /redoc pages load Swagger UI and ReDoc from this service
    # (DOCS_ASSETS), not from a CDN: they work on a cluster without internet access.
    app = FastAPIOffline(
        title="sdpa-service",
        version=VERSION,
        description=DESCRIPTION,
        lifespan=_lifespan(engine, device_threads=torch.get_num_threads() if own_process else None),
        static_url=DOCS_ASSETS,
    )
    max_inflight_bytes = settings.max_inflight_bytes or default_inflight_bytes()
    state = AppState(
        settings=settings,
        metrics=metrics,
        auth_enabled=bool(api_keys),
        max_inflight_bytes=max_inflight_bytes,
        # Answers waiting in the protocol layer's write buffers count too.
        inflight=InflightBytes(max_inflight_bytes, unsent=unsent_bytes),
        # None unless OTEL_TRACES_EXPORTER turns tracing on: then the recorder makes no span.
        tracing=tracing if tracing is not None else Tracing.from_settings(settings),
    )
    app.state.sdpa = state
    install_error_handlers(app)

    routers = (
        attention.router,
        analyze.router,
        health.router,
        observe.router,
        ui.router,
        v2.router,
    )
    for router in routers:
        app.include_router(router)

    # add_middleware puts each new one outermost: the order below is innermost first, so a
    # request meets the access log, then the API key check, then the inflation of a gzip or
    # deflate body, then the in-flight bytes, then the body limit (both count inflated bytes).
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes, metrics=metrics)
    app.add_middleware(
        InflightBytesMiddleware,
        max_bytes=state.max_inflight_bytes,
        max_body_bytes=settings.max_body_bytes,
        metrics=metrics,
        ledger=state.inflight,
    )
    app.add_middleware(
        ContentEncodingMiddleware, max_body_bytes=settings.max_body_bytes, metrics=metrics
    )
    metrics_key = settings.metrics_key.get_secret_value() if settings.metrics_key else None
    if metrics_key:
        app.add_middleware(MetricsKeyMiddleware, key=metrics_key, metrics=metrics)
    if api_keys:
        guarded = METRICS_PATHS if metrics_key else ()
        app.add_middleware(
            ApiKeyMiddleware, keys=api_keys, metrics=metrics, guarded_elsewhere=guarded
        )
    app.add_middleware(ConnectionCloseWhileDrainingMiddleware, draining=state.draining)
    # The edge, outermost: the request's Exchange, which the rooms inside fill in and the one
    # recorder (state.recorder, the gRPC door's too) turns into the log line, the metrics and
    # the span; its time holds every refusal. A refusal before routing is labelled with the
    # route it was made at (route_template).
    included = [route for router in routers for route in router.routes]
    app.add_middleware(AccessLogMiddleware, recorder=state.recorder, included=included)

    def openapi() -> dict[str, Any]:
        return openapi_document(app, auth=bool(api_keys), open_paths=OPEN_PATHS)

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override
    return app
