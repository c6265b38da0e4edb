"""The application's state: what every door reads, owned by one application.

create_app() makes one AppState; the lifespan fills in the engine, the batcher and the health
monitor. The HTTP routes read it through service.api.deps, the gRPC door (service.api.grpc) is
given it. It lives here, in serving, so that the doors reach the runtime only through it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import torch

from sdpa_core import flash_kernels
from service.access_log import Recorder
from service.metrics import Metrics
from service.runtime.batcher import DynamicBatcher
from service.runtime.engine import Engine
from service.runtime.jobs import Outcome, PreparedJob
from service.runtime.policy import CostModel
from service.serving.health import HealthMonitor
from service.serving.inflight import InflightBytes
from service.settings import Settings

if TYPE_CHECKING:
    from service.tracing import Tracing

Batcher = DynamicBatcher[PreparedJob, Outcome]

TORCH_VERSION: Final = torch.__version__


@dataclass(eq=False)
class AppState:
    """Everything the doors read, owned by one application."""

    settings: Settings
    metrics: Metrics
    auth_enabled: bool
    max_inflight_bytes: int  # SDPA_MAX_INFLIGHT_BYTES, or its default for this process
    # What the requests in flight hold against it, every door together (service.serving.inflight).
    inflight: InflightBytes
    # OpenTelemetry (service.tracing), None when OTEL_TRACES_EXPORTER leaves it off.
    tracing: Tracing | None = None
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
    # The one recorder (service.access_log): every door's finished requests, as the access-log
    # line, the metrics and the span.
    recorder: Recorder = field(init=False)

    def __post_init__(self) -> None:
        self.recorder = Recorder(self.metrics, self.tracing)

    def flash_kernels(self) -> dict[str, dict[str, object]]:
        """The flash path's kernels this process has, each with whether it runs and why not
        (/v1/info's "kernels"): the doors read sdpa_core's registry through here."""
        return {kernel.name: kernel.as_dict() for kernel in flash_kernels()}

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

    def device_name(self) -> str:
        """The device the engine runs on ("cpu", "cuda:0"), or the setting until it starts."""
        return str(self.engine.device) if self.engine is not None else self.settings.device

    def running_batcher(self) -> Batcher:
        """The batcher, which exists from the lifespan's start (requests arrive only after it)."""
        if self.batcher is None:
            raise RuntimeError("a compute request arrived before the lifespan started the batcher")
        return self.batcher
