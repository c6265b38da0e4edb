"""Run the service: one uvicorn worker, JSON logs, graceful drain on SIGTERM/SIGINT.

Shutdown sequence on the first SIGTERM or SIGINT:
1. The batcher's `drain(settings.drain_timeout_s)` starts at once. From that moment /readyz
   answers 503 (the batcher is draining) and every new request that reaches the batcher gets
   503 + Retry-After (ShuttingDown); queued and in-flight work finishes within the timeout.
   From that moment too, every response says `Connection: close`
   (service.middleware.drain), so keep-alive clients do not reuse a connection that will close.
   When the drain returns, AppState.stopping is set: a request still reading or decoding its
   body can never be computed, and is answered 503 at once.
2. The listener stays open until a quiet moment: no connection accepted and no request begun
   for QUIET_S (at most LINGER_S). New work gets 503 + Retry-After meanwhile, and a client
   that honours it is away when the listener closes: a connection still in the listen backlog
   at that moment would be reset with its request unanswered.
3. Then uvicorn is told to exit (should_exit): it closes the listening socket and asks every
   connection to shut down (GuardedHttpToolsProtocol.shutdown): one without a request in the
   app gets shutdown_idle_grace_s (0.5 s) for a request's headers to complete and then closes,
   however slowly a client sends them; one with a request in the app closes after its answer,
   and nothing pipelined behind it is read. Connections and responses get
   RESPONSE_FLUSH_TIMEOUT_S in all, after which uvicorn cancels the requests' tasks; then it
   runs the lifespan shutdown.
4. The tasks still running are cancelled and get LEFTOVER_TASKS_S to end; asyncio.run would
   wait for one that ignores its cancellation without bound, so the process exits at once
   (os._exit(0), logs flushed) if one is left. So it does when, once the loop is closed, a
   thread of ours is still busy: the interpreter would join it. A request's task cancelled
   while a worker thread decodes its body ends, but the thread runs on (anyio 4's to_thread; its
   threads are not daemons): a 128 MiB JSON body still decoding kept the exit waiting 63 s. The
   device thread with a batch the drain timed out on would keep it waiting without bound if a
   kernel hangs.
A second signal exits at once (exit code 128 + signal number), without waiting for anything.

The gRPC door (service.api.grpc, on SDPA_GRPC_PORT unless it is 0) runs in the same event loop.
Its port is bound before the lifespan starts, so a port in use fails start-up at once, saying
which (gRPC's default SO_REUSEPORT is off: a second server would otherwise share the port
silently); it starts serving once the lifespan has started, with the HTTP listener. On the first
signal it follows the drain: calls that arrive while the batcher drains are answered UNAVAILABLE
(Retry-After in their trailing metadata), calls queued or computing are answered as the
batcher finishes them, and once the drain has ended the gRPC server stops taking calls and
gives those still encoding or sending RESPONSE_FLUSH_TIMEOUT_S to finish (beside step 2's
linger, so within the bound below); the process waits for it before step 4.

Worst case from the first signal to the exit, whatever clients do (worst_case_exit_s):
drain_timeout_s + LINGER_S + 0.1 s (uvicorn's pause after asking connections to shut down) +
RESPONSE_FLUSH_TIMEOUT_S + LEFTOVER_TASKS_S + THREAD_JOIN_S, plus the lifespan shutdown (its
drain returns at once the second time) and a little: 38.85 s and a little with the default 30 s
drain timeout. Orchestrator grace periods (docker stop -t, compose stop_grace_period,
Kubernetes terminationGracePeriodSeconds minus the preStop sleep) must exceed it.

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
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from types import FrameType
from typing import TYPE_CHECKING, Any, Final, NoReturn

import orjson
import uvicorn
from uvicorn.config import STARTUP_FAILURE

from service.settings import Settings

if TYPE_CHECKING:  # the app's modules load torch: `healthcheck` and `analyze` never import them
    from service.serving.state import AppState

logger = logging.getLogger("sdpa.server")

# After the batcher drained, responses are computed; this bounds only writing them out.
RESPONSE_FLUSH_TIMEOUT_S = 5
# After the drain, the listener closes once no connection or request came for QUIET_S (clients
# told Retry-After: 1 are away), or after LINGER_S under a steady stream of new ones.
QUIET_S = 0.25
LINGER_S = 3.0
# After uvicorn's shutdown: how long the tasks still running get to end once cancelled, and
# how long threads of ours still running get to end, before the process leaves without them.
LEFTOVER_TASKS_S = 0.5
THREAD_JOIN_S = 0.25
# uvicorn 0.54's Server.shutdown sleeps this long after asking each connection to shut down.
UVICORN_SHUTDOWN_PAUSE_S = 0.1


def worst_case_exit_s(drain_timeout_s: float) -> float:
    """Seconds from the first SIGTERM to the exit at most, whatever clients do, less the lifespan
    shutdown and the process's own exit (module docstring)."""
    return (
        drain_timeout_s
        + LINGER_S
        + UVICORN_SHUTDOWN_PAUSE_S
        + RESPONSE_FLUSH_TIMEOUT_S
        + LEFTOVER_TASKS_S
        + THREAD_JOIN_S
    )


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
    """uvicorn.Server whose first exit signal drains the batcher before uvicorn shuts down, and
    which serves the gRPC door beside HTTP when `grpc_port` is given (module docstring)."""

    def __init__(
        self,
        config: uvicorn.Config,
        *,
        state: AppState,
        drain_timeout_s: float,
        grpc_port: int | None = None,
    ) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout_s = drain_timeout_s
        self.grpc_port = grpc_port
        self.exit_signal: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._grpc: GrpcServer | None = None
        self._grpc_stopping: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        if self.grpc_port is not None:
            self._grpc = bind_grpc(self.state, host=self.config.host, port=self.grpc_port)
        try:
            await super().serve(sockets=sockets)
        finally:
            await self._grpc_stopped(grace_s=None)  # at once, unless the drain stopped it
        if self.started:
            await end_leftover_tasks()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)  # the lifespan, then the HTTP listener
        if self._grpc is not None and not self.should_exit:
            await self._grpc.server.start()
            logger.info(
                "gRPC serving",
                extra={"json_fields": {"host": self.config.host, "grpc_port": self._grpc.port}},
            )

    def _stop_grpc_soon(self, grace_s: float | None) -> None:
        """Stop taking gRPC calls now; those in flight get grace_s to finish (None: none), in a
        task of its own."""
        if self._grpc is not None and self._grpc_stopping is None:
            stop = self._grpc.server.stop(grace_s)
            self._grpc_stopping = asyncio.get_running_loop().create_task(stop)

    async def _grpc_stopped(self, *, grace_s: float | None) -> None:
        """Stop the gRPC server (if the drain has not) and wait until it has stopped."""
        if self._grpc is None:
            return
        self._stop_grpc_soon(grace_s)
        if self._grpc_stopping is not None:
            await self._grpc_stopping

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
                # No request can be computed any more: those still reading or decoding answer 503.
                self.state.stopping.set()
                logger.info("drained")
                # gRPC takes no more calls; those still encoding or sending get their time
                # beside the linger (module docstring).
                self._stop_grpc_soon(RESPONSE_FLUSH_TIMEOUT_S)
                await linger_until_quiet()
        except Exception:
            logger.exception("drain failed; shutting down anyway")
        finally:
            self.should_exit = True


async def end_leftover_tasks() -> None:
    """Cancel the tasks still running after uvicorn's shutdown and give them LEFTOVER_TASKS_S;
    exit the process if some did not end (module docstring, step 4)."""
    current = asyncio.current_task()
    leftover = [task for task in asyncio.all_tasks() if task is not current]
    for task in leftover:
        task.cancel()
    if not leftover:
        return
    _, pending = await asyncio.wait(leftover, timeout=LEFTOVER_TASKS_S)
    if pending:
        # asyncio.run would wait for them (each on a worker thread), without bound.
        exit_now(f"exiting with {len(pending)} tasks still waiting (on worker threads)")


@dataclass(frozen=True)
class GrpcServer:
    """The gRPC door's server (grpc.aio), bound to its port but maybe not started."""

    server: Any  # grpc.aio.Server (grpcio ships no type stubs here)
    port: int


def bind_grpc(state: AppState, *, host: str, port: int) -> GrpcServer:
    """The gRPC door on host:port, bound (not started). A port that cannot be bound ends
    start-up, with uvicorn's start-up failure code and a log line that says what to do."""
    from service.api.grpc import build_server  # grpc and the door load only when it is on

    try:
        server, bound = build_server(state, host=host, port=port)
    except OSError as exc:
        logger.error(
            "%s; move the gRPC door to a free port (--grpc-port N, or SDPA_GRPC_PORT=N) or "
            "turn it off (--no-grpc, or SDPA_GRPC_PORT=0)",
            exc,
            extra={"json_fields": {"host": host, "grpc_port": port}},
        )
        sys.exit(STARTUP_FAILURE)
    return GrpcServer(server=server, port=bound)


def exit_now(reason: str) -> NoReturn:
    """Log `reason`, flush the logs and end the process with status 0, waiting for nothing."""
    logger.warning(reason)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def busy_threads(timeout_s: float) -> list[threading.Thread]:
    """The threads besides this one that the interpreter would join at exit and that are still
    running after `timeout_s` (in all)."""
    give_up = time.monotonic() + timeout_s
    threads = [
        thread
        for thread in threading.enumerate()
        if thread is not threading.current_thread() and not thread.daemon
    ]
    for thread in threads:
        thread.join(max(0.0, give_up - time.monotonic()))
    return [thread for thread in threads if thread.is_alive()]


async def linger_until_quiet() -> None:
    """Return once no connection was accepted and no request began for QUIET_S, or after
    LINGER_S (module docstring, step 2)."""
    from service.protocol import last_activity

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
    from service.protocol import guarded_protocol

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
    state = state_of(app)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        # Header, pipelining, read, send and connection bounds live in the protocol layer,
        # which uvicorn leaves without them (service.protocol).
        http=guarded_protocol(
            read_timeout_s=settings.read_timeout_s,
            send_timeout_s=settings.send_timeout_s,
            max_connections=settings.max_connections,
            max_header_bytes=settings.max_header_bytes,
            max_headers=settings.max_headers,
            max_pipelined_requests=settings.max_pipelined_requests,
            min_body_rate=settings.min_body_rate,
            metrics=state.metrics,
        ),
        # The service has no WebSocket route; an upgraded connection would leave the protocol
        # above, and every bound with it.
        ws="none",
        workers=1,
        lifespan="on",
        log_config=log_config,
        log_level=settings.log_level,
        access_log=False,
        server_header=False,
        timeout_graceful_shutdown=RESPONSE_FLUSH_TIMEOUT_S,
    )
    server = DrainingServer(
        config,
        state=state,
        drain_timeout_s=settings.drain_timeout_s,
        # The gRPC door, on SDPA_GRPC_PORT (0: off).
        grpc_port=settings.grpc_port or None,
    )
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
        exit_now("exiting with a batch still on the device (the drain timed out)")
    busy = busy_threads(THREAD_JOIN_S)
    if busy:
        # A worker still decoding a body the drain gave up on, say: the interpreter would join
        # it at exit, for as long as it takes (module docstring, step 4).
        exit_now(f"exiting with {len(busy)} threads still busy: {[t.name for t in busy]}")
    return 0
