"""The application's state, typed, and the dependencies routes declare to read it.

create_app() stores one AppState on app.state; the lifespan fills in the engine and the
batcher. Routes take `state: StateDep` (or a narrower alias) instead of reading app.state's
untyped attributes.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from service.metrics import Metrics
from service.runtime.batcher import DynamicBatcher
from service.runtime.engine import Engine
from service.runtime.jobs import Outcome, PreparedJob
from service.runtime.policy import CostModel
from service.serving.health import HealthMonitor
from service.settings import Settings

Batcher = DynamicBatcher[PreparedJob, Outcome]


@dataclass(eq=False)
class AppState:
    """Everything the routes read, owned by one application."""

    settings: Settings
    metrics: Metrics
    auth_enabled: bool
    max_inflight_bytes: int  # SDPA_MAX_INFLIGHT_BYTES, or its default for this process
    # Set by the lifespan: None until it starts.
    engine: Engine | None = None
    batcher: Batcher | None = None
    health: HealthMonitor | None = None
    warmed_up: bool = False
    warmup_error: str | None = None
    # How diagnostics' statistics run: "compiled" (sdpa_core's kernel, at warm-up) or
    # "eager", with the reason when compiling was asked and failed.
    diagnostics_kernel: str = "eager"
    # Measured on the device at warm-up; a slow CPU's figures until then (they err on the side
    # of refusing).
    cost_model: CostModel = field(default_factory=CostModel.uncalibrated)
    # Set once the drain has ended (service.server, or the lifespan's own drain): the batcher
    # takes no more work, so a request still reading or decoding its body can never be
    # computed; it is answered 503 at once rather than left to be cancelled by the exit.
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    def draining(self) -> bool:
        """True once the service began shutting down (the batcher refuses new work)."""
        return self.batcher is not None and self.batcher.draining

    def not_ready_reason(self) -> str | None:
        """Why the service is not ready, or None when it is."""
        if self.batcher is None:
            return "starting"
        if self.batcher.draining:
            return "draining: the service is shutting down"
        if not self.batcher.running:
            return "the device worker is not running"
        if self.warmup_error is not None:
            return "warm-up on the device failed (see the server log)"
        if not self.warmed_up:
            return "warming up on the device"
        return None


def state_of(app: FastAPI) -> AppState:
    """The AppState create_app() stored on the application."""
    state = app.state.sdpa
    if not isinstance(state, AppState):  # an app not built by create_app(): our bug
        raise TypeError("app.state.sdpa is not an AppState: build the app with create_app()")
    return state


async def _state_dep(request: Request) -> AppState:
    # async: FastAPI runs a sync dependency on a worker thread, a cost on every request.
    return state_of(request.app)


def running_batcher(state: AppState) -> Batcher:
    """The batcher, which exists from the lifespan's start (requests arrive only after it)."""
    if state.batcher is None:
        raise RuntimeError("a compute request arrived before the lifespan started the batcher")
    return state.batcher


def request_id(request: Request) -> str:
    """The id the access log gave this request (a fresh one if it ran without the middleware)."""
    rid = getattr(request.state, "request_id", None)
    if not isinstance(rid, str):
        rid = uuid.uuid4().hex
        request.state.request_id = rid
    return rid


StateDep = Annotated[AppState, Depends(_state_dep)]


async def _settings_dep(state: StateDep) -> Settings:
    return state.settings


async def _metrics_dep(state: StateDep) -> Metrics:
    return state.metrics


SettingsDep = Annotated[Settings, Depends(_settings_dep)]
MetricsDep = Annotated[Metrics, Depends(_metrics_dep)]
