"""Service settings, read from the environment (prefix SDPA_) only when create_app() runs."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Final, Literal

from pydantic import AliasChoices, Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.tenants import ANONYMOUS, check_weights, parse_weights, tenants_by_key

MiB = 1024 * 1024
# An API key travels in a header (Authorization: Bearer <key>, or X-API-Key), which the server
# reads as Latin-1 while the configured key is UTF-8: only printable ASCII reads the same both
# ways. A key outside it could never match what a client sends, so it fails start-up instead.
_API_KEY: Final = re.compile(r"[\x20-\x7e]+")


def _check_api_keys(keys: Iterable[str], *, source: str) -> None:
    for number, key in enumerate(keys, start=1):
        if not _API_KEY.fullmatch(key):
            # The key itself is a secret: say which one by position only.
            raise ValueError(
                f"{source}: key #{number} holds a character other than printable ASCII (0x20-0x7E)"
            )


class Settings(BaseSettings):
    """Every knob of the service. Bounds are validated: a bad value fails start-up."""

    # hide_input_in_errors: a start-up error must not print SDPA_API_KEYS back.
    model_config = SettingsConfigDict(
        env_prefix="SDPA_", extra="forbid", frozen=True, hide_input_in_errors=True
    )

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # The Open Inference Protocol over gRPC (service.api.grpc), beside HTTP on `host`; 8001 is
    # Triton's port. 0 turns the gRPC door off.
    grpc_port: int = Field(default=8001, ge=0, le=65535)
    # Streams (calls) one gRPC connection may have open at once (HTTP/2's
    # SETTINGS_MAX_CONCURRENT_STREAMS; grpc's own default is unbounded): service.grpc_limits.
    # A client that opens more at once before it has read the server's SETTINGS gets those
    # refused (REFUSED_STREAM, never processed: UNAVAILABLE in grpc's clients); 256 leaves room
    # for the e2e suite's 200 calls at once on one channel.
    grpc_max_streams: int = Field(default=256, ge=1, le=1_000_000)
    # auto = cuda when available, else cpu.
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")

    # OpenTelemetry traces (service.tracing), by the standard variable, not an SDPA_ one:
    # OTEL_TRACES_EXPORTER "otlp" (or "console") turns tracing on; unset or "none" leaves it
    # off, with no tracer and no cost. The exporter's own OTEL_* variables (endpoint, protocol,
    # service name, sampler, ...) are read by the OpenTelemetry SDK when tracing starts.
    otel_traces_exporter: str = Field(
        default="none",
        validation_alias=AliasChoices("OTEL_TRACES_EXPORTER", "otel_traces_exporter"),
        pattern=r"^(none|otlp|console)(,(none|otlp|console))*$",
    )

    max_batch_size: int = Field(default=32, ge=1, le=4096)
    max_batch_delay_ms: float = Field(default=0.0, ge=0.0, le=10_000.0)
    max_queue: int = Field(default=1024, ge=1, le=1_000_000)
    request_timeout_ms: float = Field(default=30_000.0, gt=0.0, le=3_600_000.0)
    # Estimated device time of one tile of a long request: what a short request waits behind
    # it at most (about), and how soon its deadline or departure stops it.
    slice_ms: float = Field(default=50.0, ge=1.0, le=60_000.0)

    max_body_bytes: int = Field(default=128 * MiB, ge=1024, le=16 * 1024 * MiB)
    max_elements: int = Field(default=2**26, ge=1, le=2**34)
    max_weights_elements: int = Field(default=2**26, ge=1, le=2**36)
    # The work one request may cost, in the cost model's fused-equivalent FLOPs (see
    # service.runtime.policy.CostModel); "auto" = what the device does in max_compute_s,
    # measured at warm-up.
    max_request_flops: float | Literal["auto"] = "auto"
    max_compute_s: float = Field(default=10.0, gt=0.0, le=3600.0)
    # The response's size in the encoding it would be sent in, estimated before compute.
    max_response_bytes: int = Field(default=256 * MiB, ge=1024, le=64 * 1024 * MiB)
    # Bodies being read plus answers not yet sent, all requests together; None = a quarter of
    # the memory the process may use (its cgroup's limit, else the machine's).
    max_inflight_bytes: int | None = Field(default=None, ge=1024)
    # A client that sends no byte of its request for read_timeout_s is dropped (408 before its
    # headers are complete), and its headers must be complete within read_timeout_s of their
    # first byte; one that reads none of its response for send_timeout_s is dropped and its
    # result freed; a connection beyond max_connections closes the one doing least (the
    # longest with incomplete headers, else the longest idle), or gets 503 when all are busy
    # (service.protocol).
    read_timeout_s: float = Field(default=15.0, gt=0.0, le=3600.0)
    send_timeout_s: float = Field(default=60.0, gt=0.0, le=3600.0)
    max_connections: int = Field(default=2048, ge=1, le=1_000_000)
    # Below the application (service.protocol): a request's line and header
    # lines together (431 past it), how many header lines (431), and how many requests one
    # connection may have waiting unanswered before the server stops reading it (pipelining:
    # backpressure, never a 4xx).
    max_header_bytes: int = Field(default=32 * 1024, ge=1024, le=1024 * 1024)
    max_headers: int = Field(default=100, ge=8, le=10_000)
    max_pipelined_requests: int = Field(default=8, ge=1, le=1024)
    # A request body's minimum rate, in bytes per second (Apache mod_reqtimeout's
    # body=...,MinRate=...): a body must arrive within read_timeout_s of the app's first read
    # of it, extended by one second for every min_body_rate bytes received (time the server
    # itself does not read does not count); past it the connection closes. 0 = no minimum rate
    # (the idle timer alone). What it costs an attacker: holding a connection whose request the
    # app holds (never closed to make room) takes min_body_rate bytes a second, so holding all
    # of max_connections takes min_body_rate x max_connections: 64 MiB/s (537 Mbit/s) at the
    # defaults, where one byte every few seconds per connection used to do. A client that
    # reconnects still holds a connection for up to twice read_timeout_s per connection (silent
    # until just before the idle timer, then one byte of a head, which has read_timeout_s to
    # complete), as a client that stalls always could.
    min_body_rate: int = Field(default=32 * 1024, ge=0, le=1024 * 1024 * 1024)

    # Compile the chunked path's statistics kernel (sdpa_core.compile_kernels: inductor, which
    # needs a C++ compiler) at warm-up on a CPU device: diagnostics on large tiles then cost
    # 8-17% less (BENCHMARKS.md, issue 26). It takes seconds at start (tens on a cold inductor
    # cache); off, or when compiling fails, the eager loop computes the same numbers.
    compile_kernels: bool = True

    # Comma-separated keys, or a JSON list. Empty = authentication off. Each entry is `key` or
    # `name=key`: the name is the tenant (service.tenants).
    api_keys: Annotated[tuple[SecretStr, ...], NoDecode] = ()
    # A file with one key per line ('#' comments allowed); merged with api_keys.
    api_keys_file: Path | None = None
    # The one key GET /metrics answers (X-API-Key or Bearer), never a tenant's: the metrics
    # name every tenant, tag and count. Unset, /metrics is open as before (behind the tenants'
    # keys when they are set). Set it wherever keys are.
    metrics_key: SecretStr | None = None

    # Tenants (service.runtime.queue): "name=w,..." weights of the fair shares (default 1 each);
    # the share of MAX_QUEUE one tenant may hold before its requests get 429 (default 0.5, and
    # 1 when only one tenant can exist); priority levels within a tenant (1 the highest), the
    # level of a request that names none (or 0).
    tenant_weights: Annotated[dict[str, float], NoDecode] = Field(default_factory=dict)
    tenant_max_queue_share: float | None = Field(default=None, gt=0.0, le=1.0)
    priority_levels: int = Field(default=3, ge=1, le=1000)
    default_priority: int = Field(default=2, ge=1, le=1000)

    # Attention health (service.serving.health): the share of requests that did not ask for
    # diagnostics whose summary is still computed for the metrics, when the device is idle;
    # the key positions whose share of a row's attention is sink_share; how many distinct
    # request tags label the health metrics before the rest count as "other" (each tag is a
    # set of series in Prometheus: the bound keeps its memory bounded). The tap sends one tag
    # per layer ("{model}/layer{i}"): 256 tags hold 8 models of 32 layers, or one 32-layer
    # model several times over beside the clients' own tags. A tag costs 128 series (five
    # histograms' buckets, sums, counts and _created; three counters) plus 3 per head it
    # exports (sdpa_attention_head_*{tag,head}): 164 for a 12-head layer, 224 for a 32-head
    # one. Heads at index health_max_heads and beyond are not exported per head (0: no
    # per-head series), so 256 tags cost at most 256 x (128 + 3 x 64) = 81,920 series.
    health_sample_rate: float = Field(default=0.01, ge=0.0, le=1.0)
    # At most 64: sinks are the first few tokens (StreamingLLM keeps 4), and with key padding
    # the flash path scores the sink keys apart, [B, H, N_q, sink_tokens] floats per call.
    health_sink_tokens: int = Field(default=4, ge=0, le=64)
    health_max_tags: int = Field(default=256, ge=1, le=10_000)
    health_max_heads: int = Field(default=64, ge=0, le=1024)

    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    drain_timeout_s: float = Field(default=30.0, ge=0.0, le=3600.0)

    @field_validator("max_request_flops", mode="before")
    @classmethod
    def _flops_number_or_auto(cls, value: object) -> object:
        if isinstance(value, str) and value.strip().lower() != "auto":
            try:
                return float(value)
            except ValueError:
                raise ValueError('a positive number of FLOPs, or "auto"') from None
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("max_request_flops")
    @classmethod
    def _positive_flops(cls, value: float | str) -> float | str:
        if isinstance(value, float) and not (0.0 < value < float("inf")):
            raise ValueError('a positive number of FLOPs, or "auto"')
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("tenant_weights", mode="before")
    @classmethod
    def _parse_tenant_weights(cls, value: object) -> object:
        return parse_weights(value) if isinstance(value, str) else value

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_api_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(key.strip() for key in value.split(",") if key.strip())
        return value

    @field_validator("api_keys")
    @classmethod
    def _visible_ascii_api_keys(cls, value: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        _check_api_keys((key.get_secret_value() for key in value), source="SDPA_API_KEYS")
        return value

    # The keys of api_keys_file, read and checked once, when the settings are validated.
    _file_keys: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _api_keys_file_is_usable(self) -> Settings:
        self._file_keys = self._read_api_keys_file()  # a bad file fails start-up
        self.tenant_keys()  # one key under two names fails start-up
        check_weights(self.tenant_weights, self.tenant_names())
        if self.default_priority > self.priority_levels:
            raise ValueError(
                f"SDPA_DEFAULT_PRIORITY {self.default_priority} is past SDPA_PRIORITY_LEVELS "
                f"{self.priority_levels}"
            )
        return self

    def _read_api_keys_file(self) -> tuple[str, ...]:
        if self.api_keys_file is None:
            return ()
        try:
            text = self.api_keys_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            msg = f"SDPA_API_KEYS_FILE: cannot read {self.api_keys_file}: {exc}"
            raise ValueError(msg) from None
        keys = [line.strip() for line in text.splitlines()]
        keys = [key for key in keys if key and not key.startswith("#")]
        _check_api_keys(keys, source=f"SDPA_API_KEYS_FILE ({self.api_keys_file})")
        return tuple(keys)

    def tenant_keys(self) -> dict[str, str]:
        """Every configured key (SDPA_API_KEYS plus the lines of SDPA_API_KEYS_FILE) -> the
        name of its tenant."""
        entries = [key.get_secret_value() for key in self.api_keys] + list(self._file_keys)
        return tenants_by_key(entries, source="SDPA_API_KEYS / SDPA_API_KEYS_FILE")

    def resolved_api_keys(self) -> frozenset[str]:
        """All configured keys, without their names."""
        return frozenset(self.tenant_keys())

    def tenant_names(self) -> frozenset[str]:
        """The tenants that can exist: the keys' names, or "anonymous" without keys."""
        return frozenset(self.tenant_keys().values()) or frozenset({ANONYMOUS})

    def queue_share(self) -> float:
        """The share of MAX_QUEUE one tenant may hold: SDPA_TENANT_MAX_QUEUE_SHARE, else 0.5,
        or 1 when only one tenant can exist."""
        if self.tenant_max_queue_share is not None:
            return self.tenant_max_queue_share
        return 1.0 if len(self.tenant_names()) <= 1 else 0.5
