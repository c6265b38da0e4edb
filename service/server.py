"""Run the service: one uvicorn worker, JSON logs, graceful drain on SIGTERM/SIGINT.

Shutdown sequence on the first SIGTERM or SIGINT:
1. The batcher's `drain(settings.drain_timeout_s)` starts at once. From that moment /readyz
   answers 503 (the batcher is draining) and every new request that reaches the batcher gets
   503 + Retry-After (ShuttingDown); queued and in-flight work finishes within the timeout.
   From that moment too, every response says `Connection: close`
   (service.middleware.drain), so keep-alive clients do not reuse a connection that will close.
2. When the drain returns, the listener stays open until a quiet moment: no connection accepted
   and no request begun for QUIET_S (at most LINGER_S). New work gets 503 + Retry-After
   meanwhile, and a client that honours it is away when the listener closes: a connection
   still in the listen backlog at that moment would be reset with its request unanswered.
3. Then uvicorn is told to exit (should_exit): it closes the listening socket, gives idle
   connections a short grace for a request already on its way (GuardedHttpToolsProtocol.
   shutdown), lets open responses finish (at most RESPONSE_FLUSH_TIMEOUT_S), runs the lifespan
   shutdown and serve() returns 0. If the drain timed out with a batch still computing (its requests
   got 503), the process exits at once instead (os._exit(0)): the interpreter would otherwise
   join the device thread and wait for that batch, without bound if a kernel hangs.
A second signal exits at once (exit code 128 + signal number), without waiting for anything.

Worst case from the first signal to the exit: drain_timeout_s + LINGER_S +
RESPONSE_FLUSH_TIMEOUT_S plus a little; orchestrator grace periods (docker stop -t, compose
stop_grace_period, Kubernetes terminationGracePeriodSeconds minus the preStop sleep) must
exceed it.

How uvicorn 0.54 handles signals (checked in its server.py): Server.serve() wraps the run in
`capture_signals()`, which installs `Server.handle_exit` with signal.signal() for SIGINT and
SIGTERM, and afterwards RE-RAISES every captured signal with the original handlers restored.
The re-raise would turn a clean drain into death by SIGTERM (exit -15) or a KeyboardInterrupt,
so DrainingServer overrides handle_exit and never records the signal in _captured_signals.
"""

from __future__ import annotations

import asyncio
import json
import logging
import logging.config
import os
import socket
import sys
import time
from datetime import UTC, datetime
from types import FrameType
from typing import TYPE_CHECKING, Any, Final

import orjson
import uvicorn

from service.settings import Settings

if TYPE_CHECKING:  # the app's modules load torch: `healthcheck` and `analyze` never import them
    from service.api.deps import AppState

logger = logging.getLogger("sdpa.server")

# After the batcher drained, responses are computed; this bounds only writing them out.
RESPONSE_FLUSH_TIMEOUT_S = 5
# After the drain, the listener closes once no connection or request came for QUIET_S (clients
# told Retry-After: 1 are away), or after LINGER_S under a steady stream of new ones.
QUIET_S = 0.25
LINGER_S = 3.0


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, then the record's `json_fields`.

    The access log puts its fields in `json_fields`; they are merged at the top level (they
    include their own "ts", which wins). Exceptions go in "exc_info" as text, in the log only.
    """

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "json_fields", None)
        if isinstance(fields, dict):
            payload.update(fields)
        if record.exc_info:
            payload["exc_info"] = self.formatException(record.exc_info)
        # orjson: 0.3 us instead of 6 us (json.dumps) for an access-log line, one per request.
        return orjson.dumps(payload, default=str).decode()


def logging_config(level: str) -> dict[str, Any]:
    """dictConfig for uvicorn's log_config: every logger writes JSON lines to stderr.

    uvicorn's own access logger is silenced (and access_log=False in the Config): our
    AccessLogMiddleware writes the access log, with the request id and the route template.
    """
    upper = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": f"{__name__}.JsonFormatter"}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "json",
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": upper, "propagate": False},
            "uvicorn.error": {"level": upper},
            "uvicorn.access": {"handlers": [], "level": "CRITICAL", "propagate": False},
            "sdpa": {"handlers": ["stderr"], "level": upper, "propagate": False},
            # The access log stays on at INFO even when the rest is at WARNING.
            "sdpa.access": {"level": "INFO"},
        },
        "root": {"handlers": ["stderr"], "level": upper},
    }


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains the batcher before uvicorn shuts down."""

    def __init__(self, config: uvicorn.Config, *, state: AppState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.exit_signal: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a Python signal handler on the main thread, between two bytecodes of the event
        # loop: only set flags and hand the work to the loop (call_soon_threadsafe wakes it).
        # Deliberately NOT recorded in self._captured_signals: see the module docstring.
        if self.exit_signal is not None:
            # Second signal: the operator wants out now. uvicorn's own force_exit would still
            # wait for the listening socket to close, and the device worker thread (mid-batch)
            # would hold the interpreter open, so end the process here. os.write: no logging
            # locks in a signal handler.
            line = {
                "ts": datetime.now(UTC).isoformat(timespec="milliseconds"),
                "level": "warning",
                "logger": logger.name,
                "msg": "second signal: exiting without finishing the drain",
                "signal": sig,
            }
            os.write(2, (json.dumps(line) + "\n").encode())
            os._exit(128 + sig)
        self.exit_signal = sig
        if self._loop is None or not self.started:
            # Still starting: nothing was admitted yet, so a plain uvicorn exit loses nothing.
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        batcher = self.state.batcher
        try:
            if batcher is not None:
                logger.info(
                    "draining", extra={"json_fields": {"drain_timeout_s": self.drain_timeout_s}}
                )
                await batcher.drain(self.drain_timeout_s)
                logger.info("drained")
                await linger_until_quiet()
        except Exception:
            logger.exception("drain failed; shutting down anyway")
        finally:
            self.should_exit = True


async def linger_until_quiet() -> None:
    """Return once no connection was accepted and no request began for QUIET_S, or after
    LINGER_S (module docstring, step 2)."""
    from service.middleware.connections import last_activity

    give_up = time.monotonic() + LINGER_S
    while (now := time.monotonic()) < give_up:
        quiet_for = now - last_activity()
        if quiet_for >= QUIET_S:
            return
        await asyncio.sleep(min(QUIET_S - quiet_for, give_up - now))


# OpenMP (libgomp: torch's CPU thread pool) lets an idle worker spin for a while after every
# parallel region before it sleeps. With no more cores than busy threads (the event loop, the
# device thread, a co-located client) the spin takes the event loop's core: small requests at
# concurrency 16 lost about 40% of their throughput on 2 cores whenever libgomp did not throttle
# the spin by itself (it does so only once it runs more threads than there are cores, which
# depended on which threads had happened to call torch). PASSIVE: idle workers sleep at once.
# libgomp reads it when torch is first imported; an operator's own value wins (GOMP_SPINCOUNT
# too, which libgomp puts before the policy: the app gives torch's threads to the device
# thread alone, so a spin set there is not throttled away; README "Operations").
OPENMP_DEFAULTS: Final = {"OMP_WAIT_POLICY": "PASSIVE"}
SWITCH_INTERVAL_S: Final = 0.001


def serve(settings: Settings) -> int:
    """Serve create_app(settings) until a signal; return the process exit code (0 = clean).

    A second signal ends the process at once with os._exit(128 + signal), see handle_exit.
    """
    for name, value in OPENMP_DEFAULTS.items():
        os.environ.setdefault(name, value)  # before torch is imported (by the app, below)
    # Imported here so that `sdpa-service healthcheck` / `analyze` never import the app.
    from service.api.deps import state_of
    from service.app import create_app
    from service.middleware.connections import guarded_protocol

    # The device thread runs Python between its kernels (the chunked path's key-block loop),
    # holding the GIL for up to the switch interval (5 ms by default) each time the event
    # loop waits for it; a small request needs the GIL several times on its way through.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    log_config = logging_config(settings.log_level)
    logging.config.dictConfig(log_config)
    # Our JSON lines carry none of these, and the access log writes a record per request: skip
    # collecting them (the logging HOWTO's "Optimization" table; _srcfile = None spares a stack
    # walk to find the caller's file and line on every record).
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging._srcfile = None
    # Python warnings (torch's UserWarnings...) as JSON lines too, not bare text on stderr.
    logging.captureWarnings(True)
    app = create_app(settings, own_process=True)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        # Read and send timeouts and the connection cap live in the protocol layer, which
        # uvicorn leaves without them (service.middleware.connections).
        http=guarded_protocol(
            read_timeout_s=settings.read_timeout_s,
            send_timeout_s=settings.send_timeout_s,
            max_connections=settings.max_connections,
        ),
        workers=1,
        lifespan="on",
        log_config=log_config,
        log_level=settings.log_level,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=RESPONSE_FLUSH_TIMEOUT_S,
    )
    state = state_of(app)
    server = DrainingServer(config, state=state, drain_timeout_s=settings.drain_timeout_s)
    try:
        server.run()
    except SystemExit as exc:
        # uvicorn exits this way when start-up fails (bind error, lifespan failure).
        code = exc.code
        return code if isinstance(code, int) else 1
    if not server.started:
        return 1
    batcher = state.batcher
    if batcher is not None and batcher.device_busy:
        # The drain timed out with a batch still computing (its requests were answered 503).
        # The interpreter would join the device thread at exit and wait for that batch, for
        # ever if a kernel hangs: leave without it, as the shutdown bound above promises.
        logger.warning("exiting with a batch still on the device (the drain timed out)")
        logging.shutdown()
        os._exit(0)
    return 0
