"""Ray Serve: the same service behind Ray's proxy, one batcher per replica (extra `ray`).

    serve run service.ray:app                                  # one replica, settings from SDPA_*
    serve run service.ray:build num_replicas=3 device=cpu      # args: Ray's keys and settings
    serve run service.ray:build min_replicas=1 max_replicas=8  # autoscaling on the backlog

`build(args)` returns the Ray Serve application; `app` is `build({})`. Importing this module
starts no Ray and builds no engine: the replicas build create_app() when Ray starts them.

Two deployments (`ingress` "retrying", the default):
- "sdpa": the replicas. Each runs create_app()'s FastAPI app and its lifespan (its own batcher,
  warm-up and drain) in its own process, and answers the requests the ingress hands it.
- "ingress": a thin HTTP deployment behind Ray's proxy, on the head node beside the proxy
  (proxy_location "HeadOnly", Ray's default). It reads a request whole, hands it to a replica
  through a DeploymentHandle and sends it again to another one if that replica died with it.
  Two replicas of it (ingress_replicas): when one dies the proxy routes to the other at once;
  the requests the dead one held get Ray's proxy's 500 (no service error envelope), which
  sdpa_client sends again (sdpa_client.retry), so no kind of replica is a single point of
  failure.
`ingress=direct` serves the FastAPI app itself as Ray's ingress (serve.ingress): one hop less,
but a replica that dies costs the requests it held a 500 from Ray's proxy.

Why the second hop. Every computation of this service is a pure function of its request, so a
request a dead replica dropped is always safe to send again; nobody but the client should
notice. Ray Serve 2.60 retries a request only while it is being placed: its router
(ray/serve/_private/router.py, route_and_send_request) tries another replica when the chosen
one rejects the request or dies before accepting it, but an accepted request whose replica dies
fails with ActorDiedError, and the proxy answers it 500 (http_util.get_http_response_status;
the 500s of ray-project/ray#47219). Ray's own advice is retries by the client (Anyscale's
production best practices; docs.ray.io serve/production-guide/fault-tolerance covers replica
replacement only), and a client cannot tell that 500 from a bug's. The HTTP proxy cannot replay
a body either: the replica pulls it from the proxy as it reads. A handle call carries the whole
request as its argument, so the ingress can send it again; that needs the request read whole
(the body limit bounds it) and costs an actor call per request (bench/ray.py measures it).
Ray 2.60's other road, HAProxy in front of replicas that serve HTTP themselves
(RAY_SERVE_ENABLE_HA_PROXY with direct ingress), retries connection failures only by default
(RAY_SERVE_HAPROXY_RETRY_ON=conn-failure), and HAProxy replays a request it already sent only
when it holds it whole in one buffer (RAY_SERVE_HAPROXY_TUNE_BUFSIZE, 16 KiB): a replica killed
mid-request would still cost larger requests their answer.

Readiness and liveness (check_health). Ray health-checks a replica once as the last step of
starting it, and treats a failure there as a failed start; a replica takes traffic only once
that check passed. So the first check waits for the warm-up (the kernels, the cost model) and
passes once /readyz would say ready: Ray routes nothing to a warming replica, and warming up
never counts as a failure. After that the check raises only when the replica is broken (its
device worker died, the warm-up failed): Ray replaces a replica after
REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD (3) failed checks in a row. A draining replica passes:
Ray drains only replicas it is stopping. HEALTH_CHECK_PERIOD_S is short (2 s, Ray's default is
10 s) because Ray's controller also learns that a replica died from its health check (the call
fails at once: ACTOR_CRASHED): a killed replica is replaced that much sooner; the check is one
small call on the replica's loop. HEALTH_CHECK_TIMEOUT_S (10 s) lets a loop busy with a large
body answer late without being killed for it.

Graceful shutdown. Ray stops routing to a replica it stops, waits for its requests in flight
(graceful_shutdown_wait_loop_s), then calls its __del__, which ends the app's lifespan: the
batcher's drain (settings.drain_timeout_s) and the flush of spans. graceful_shutdown_timeout_s
is the drain timeout plus a margin, after which Ray kills the replica.

Autoscaling (min_replicas/max_replicas). Ray 2.60 scales on requests in flight per replica
(target_ongoing_requests) by default, and takes a custom policy (AutoscalingConfig.policy) that
may read per-replica metrics the deployment reports (record_autoscaling_stats). The replicas
report their backlog (the cost model's estimate of the seconds of queued work, what
sdpa_backlog_seconds and Retry-After say) and BacklogPolicy asks for the replicas that bring
it to target_backlog_s each, as the KEDA trigger does on Kubernetes (deploy/k8s/base/hpa.yaml),
with requests in flight per replica as a fallback floor (target_ongoing_requests): one large
request holds a replica as long as a hundred small ones, which a count of requests misses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.exceptions import RayActorError
from starlette.requests import Request
from starlette.responses import Response

from service.settings import Settings

if TYPE_CHECKING:
    from fastapi import FastAPI
    from ray.serve.config import AutoscalingContext
    from ray.serve.handle import DeploymentHandle
    from uvicorn.lifespan.on import LifespanOn

    from service.serving.state import AppState

logger = logging.getLogger("sdpa.ray")
# Ray Serve's replica logger: what the ingress says lands in its replica's log
# (logs/serve/replica_<app>_ingress_<id>.log, with the request's id), as Ray's own messages do.
serve_logger = logging.getLogger("ray.serve")

# The variables of the process that builds the application (`serve run`) that reach the
# replicas, wherever Ray starts them: the service's settings and OpenTelemetry's. A replica's
# own environment fills in what they leave unset.
FORWARDED_ENV_PREFIXES: Final = ("SDPA_", "OTEL_")
# Settings that mean nothing inside Ray: Ray's proxy listens (serve.start's http_options), and
# replicas share nodes, so none opens the gRPC door (settings.grpc_port 0).
NOT_IN_RAY: Final = frozenset({"host", "port", "grpc_port"})

HEALTH_CHECK_PERIOD_S: Final = 2.0
HEALTH_CHECK_TIMEOUT_S: Final = 10.0
# The first health check waits this long at most for the warm-up (the statistics kernel
# compiles for tens of seconds on a cold inductor cache); past it the start fails, and Ray
# starts another replica.
WARM_UP_WAIT_S: Final = 600.0
# Ray checks every graceful_shutdown_wait_loop_s whether a stopping replica's requests are done
# (2 s by default: every stop would last that long).
SHUTDOWN_WAIT_LOOP_S: Final = 0.25
SHUTDOWN_MARGIN_S: Final = 10.0
# A request a dead replica dropped: sent again after these pauses (the router learns of the
# death from the failed call and routes the next attempt elsewhere).
RETRY_BACKOFF_S: Final = (0.05, 0.2, 0.5, 1.0)


# ---- the arguments -----------------------------------------------------------------------


class RayOptions(BaseModel):
    """The arguments of build() that configure Ray rather than the service.

    Values may be strings (`serve run service.ray:build num_replicas=3` passes them so).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # A fixed count, unless max_replicas asks for autoscaling.
    num_replicas: int = Field(default=1, ge=1, le=10_000)
    min_replicas: int | None = Field(default=None, ge=0, le=10_000)
    max_replicas: int | None = Field(default=None, ge=1, le=10_000)
    # Autoscaling: seconds of queued work per replica (BacklogPolicy); requests in flight per
    # replica, the fallback (default: max_batch_size, a full batch waiting).
    target_backlog_s: float = Field(default=2.0, gt=0.0, le=3600.0)
    target_ongoing_requests: float | None = Field(default=None, gt=0.0)
    # Requests one replica holds at once; beyond it they wait in Ray's router. Default: the
    # service's own queue plus a batch, so its queue decides (tenants, priorities, deadlines,
    # 503 + Retry-After).
    max_ongoing_requests: int | None = Field(default=None, ge=1, le=1_000_000)
    num_cpus: float = Field(default=1.0, ge=0.0)
    num_gpus: float = Field(default=0.0, ge=0.0)
    max_replicas_per_node: int | None = Field(default=None, ge=1)
    # "retrying": the thin ingress that resends what a dead replica dropped; "direct": the app
    # itself is Ray's ingress.
    ingress: Literal["retrying", "direct"] = "retrying"
    # Attempts per request through the retrying ingress (1 + retries).
    attempts: int = Field(default=4, ge=1, le=len(RETRY_BACKOFF_S) + 1)
    # Two by default: the proxy routes around a dead ingress replica at once, where with one it
    # answered 503/500 until Ray had started another. A request the dying ingress replica
    # held still fails in Ray's proxy (a 500 without this service's envelope, ray-project/ray
    # #47219): sdpa_client retries that, as any client of a pure function may (docs/client).
    ingress_replicas: int = Field(default=2, ge=1, le=1000)
    # The ingress sits on the head node, beside the one proxy (proxy_location "HeadOnly"): a
    # lost worker node then takes no ingress, and no request, with it. false: Ray places it.
    ingress_on_head: bool = True

    def autoscaling(self) -> bool:
        return self.max_replicas is not None


@dataclass(frozen=True)
class Plan:
    """build()'s arguments, checked: Ray's options, the settings' arguments and the forwarded
    environment (the replicas build Settings from the last two)."""

    options: RayOptions
    settings_args: dict[str, Any]
    env: dict[str, str]
    settings: Settings


def parse_args(args: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> Plan:
    """Split and check build()'s arguments: Ray's (RayOptions) and the service's settings
    (Settings field names, lower case: device, max_batch_size, ...).

    Raises:
        ValueError: an unknown key, a setting that means nothing inside Ray, or a bad value
            (the message names the key).
    """
    environ = os.environ if environ is None else environ
    ray_keys = set(RayOptions.model_fields)
    settings_keys = set(Settings.model_fields)
    unknown = sorted(str(key) for key in args if key not in ray_keys | settings_keys)
    if unknown:
        raise ValueError(
            f"service.ray.build: unknown argument(s) {', '.join(unknown)}. Ray's: "
            f"{', '.join(sorted(ray_keys))}; and the service's settings by name "
            "(device, max_batch_size, ...: SDPA_<NAME> in lower case)"
        )
    misplaced = sorted(key for key in args if key in NOT_IN_RAY)
    if misplaced:
        raise ValueError(
            f"service.ray.build: {', '.join(misplaced)} cannot be set inside Ray: Ray's proxy "
            "listens (serve.start(http_options=...)), and the gRPC door stays off (replicas "
            "share nodes)"
        )
    try:
        options = RayOptions(**{k: v for k, v in args.items() if k in ray_keys})
    except ValidationError as exc:
        raise ValueError(f"service.ray.build: {_errors(exc)}") from None
    settings_args = {k: v for k, v in args.items() if k in settings_keys}
    env = {k: v for k, v in environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
    try:
        # Read the way a replica will read them: the forwarded environment, then the args.
        with _environment(env):
            settings = Settings(**settings_args)
    except ValidationError as exc:
        raise ValueError(f"service.ray.build: settings: {_errors(exc)}") from None
    _check_plan(options, settings)
    return Plan(options=options, settings_args=settings_args, env=env, settings=settings)


def _errors(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'value'}: {error['msg']}"
        for error in exc.errors()
    )


def _check_plan(options: RayOptions, settings: Settings) -> None:
    if options.min_replicas is not None and options.max_replicas is None:
        raise ValueError("service.ray.build: min_replicas needs max_replicas (autoscaling)")
    if options.max_replicas is not None:
        low = options.min_replicas if options.min_replicas is not None else 1
        if low > options.max_replicas:
            raise ValueError(
                f"service.ray.build: min_replicas {low} is past max_replicas {options.max_replicas}"
            )
    if settings.device.startswith("cuda") and options.num_gpus <= 0:
        # Ray hides every GPU from an actor that asked for none (CUDA_VISIBLE_DEVICES="").
        raise ValueError(
            f"service.ray.build: device {settings.device} needs num_gpus > 0 (Ray shows a "
            "replica only the GPUs it asked for)"
        )


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ with exactly `env`'s SDPA_*/OTEL_* variables, restored afterwards."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
    for key in saved:
        del os.environ[key]
    os.environ.update(env)
    try:
        yield
    finally:
        for key in env:
            os.environ.pop(key, None)
        os.environ.update(saved)


# ---- autoscaling -------------------------------------------------------------------------


class BacklogPolicy:
    """Ray autoscaling policy: the replicas that bring the backlog to target_backlog_s each.

    Ray calls it on its controller every control loop with an AutoscalingContext; it returns
    the replicas wanted (Ray applies min/max, the scaling factors and the up/down delays).
    `backlog_seconds` is what each replica reported (record_autoscaling_stats), averaged by Ray
    over look_back_period_s. Requests in flight over target_ongoing_requests is a floor: a
    replica still warming up reports no backlog.

    Self-contained on purpose: Ray pickles it by value (AutoscalingPolicy.serialize_policy
    registers this module with cloudpickle.register_pickle_by_value), so it names nothing of
    this module.
    """

    def __init__(self, target_backlog_s: float, target_ongoing_requests: float) -> None:
        self.target_backlog_s = target_backlog_s
        self.target_ongoing_requests = target_ongoing_requests

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        if ctx.current_num_replicas == 0:
            return float(ctx.target_num_replicas), {}
        reported = (ctx.aggregated_metrics or {}).get("backlog_seconds", {})
        by_backlog = sum(reported.values()) / self.target_backlog_s
        by_requests = ctx.total_num_requests / self.target_ongoing_requests
        return max(by_backlog, by_requests), {}


# ---- the replicas ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Forwarded:
    """An HTTP request read whole by the ingress: what a replica's ASGI scope needs."""

    method: str
    path: str
    # The route prefix Ray's proxy matched ("" for "/"): the app routes path minus it.
    root_path: str
    raw_path: bytes
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None
    scheme: str
    http_version: str


@dataclass(frozen=True, slots=True)
class Reply:
    """The app's complete answer to a Forwarded request."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


def _use_the_process(settings: Settings) -> None:
    """What `sdpa-service serve` sets for its process (service.server.serve), for a replica's:
    Ray runs each replica in a worker process of its own."""
    from service.server import OPENMP_DEFAULTS, SWITCH_INTERVAL_S, JsonFormatter

    for name, value in OPENMP_DEFAULTS.items():
        os.environ.setdefault(name, value)  # before torch is first imported, by the app
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # JSON lines on stderr (Ray keeps them in the worker's log) for the service's loggers only:
    # the rest of the process logs the way Ray configured it.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    sdpa = logging.getLogger("sdpa")
    sdpa.handlers[:] = [handler]
    sdpa.setLevel(settings.log_level.upper())
    sdpa.propagate = False
    logging.getLogger("sdpa.access").setLevel(logging.INFO)


def _replica_settings(settings_args: Mapping[str, Any], env: Mapping[str, str]) -> Settings:
    os.environ.update(env)  # the process is the replica's
    return Settings(**settings_args, grpc_port=0)


class _Replica:
    """What both kinds of replica share: the app, its health, its backlog, its end."""

    _app: FastAPI | None = None
    _checked_once: bool = False

    def _build_app(self, settings_args: Mapping[str, Any], env: Mapping[str, str]) -> FastAPI:
        settings = _replica_settings(settings_args, env)
        _use_the_process(settings)
        from service.app import create_app

        self._app = create_app(settings, own_process=True)
        return self._app

    def _state(self) -> AppState | None:
        if self._app is None:
            return None
        from service.api.deps import state_of

        return state_of(self._app)

    async def check_health(self) -> None:
        """Ray's health check: see the module docstring. Raises while the replica is broken."""
        state = self._state()
        if state is None:
            raise RuntimeError("the app is not built")
        if not self._checked_once:
            # Ray's first check ends the replica's start: wait for the warm-up.
            give_up = time.monotonic() + WARM_UP_WAIT_S
            # Polled: the warm-up leaves only AppState's fields behind (service.app._warm_up).
            while _warming_up(state) and time.monotonic() < give_up:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        reason = state.not_ready_reason()
        if reason is not None and not state.draining():
            raise RuntimeError(f"replica not serving: {reason}")
        self._checked_once = True

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The backlog (seconds of queued work, the cost model's estimate) for BacklogPolicy."""
        state = self._state()
        if state is None or state.batcher is None or not state.warmed_up:
            return {"backlog_seconds": 0.0}
        return {"backlog_seconds": state.batcher.backlog_seconds()}


def _warming_up(state: AppState) -> bool:
    batcher = state.batcher
    if batcher is None:
        return True
    return batcher.running and state.warmup_error is None and not state.warmed_up


class SDPAReplica(_Replica):
    """A replica behind the retrying ingress: runs the app and its lifespan itself and answers
    Forwarded requests through it, in process (no socket)."""

    # Ray awaits an async constructor (ray.serve._private.replica: _call_func_or_gen); mypy
    # knows no such thing.
    async def __init__(  # type: ignore[misc]
        self, settings_args: dict[str, Any], env: dict[str, str]
    ) -> None:
        from uvicorn.config import Config
        from uvicorn.lifespan.on import LifespanOn

        app = self._build_app(settings_args, env)
        # uvicorn's lifespan driver, as Ray's own ingress wrapper uses it
        # (ray.serve._private.http_util.ASGIAppReplicaWrapper).
        self._lifespan: LifespanOn = LifespanOn(
            Config(app, lifespan="on", log_config=None, access_log=False)
        )
        self._lifespan.logger = logger
        await self._lifespan.startup()
        if self._lifespan.should_exit:
            raise RuntimeError("the app's lifespan failed to start (see the replica's log)")
        self._answering: set[asyncio.Task[None]] = set()

    async def forward(self, request: Forwarded) -> Reply:
        """Run `request` through the app; the whole answer."""
        app = self._app
        if app is None:
            raise RuntimeError("the app is not built")
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version,
            "method": request.method,
            "scheme": request.scheme,
            "path": request.path,
            "raw_path": request.raw_path,
            "query_string": request.query_string,
            "root_path": request.root_path,
            "headers": request.headers,
            "client": request.client,
            "server": None,
            "state": dict(self._lifespan.state),
        }
        left = asyncio.Event()
        body_read = False

        async def receive() -> dict[str, Any]:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            # Then only the client's departure (service.api.disconnect waits for it).
            await left.wait()
            return {"type": "http.disconnect"}

        status = 0
        headers: list[tuple[bytes, bytes]] = []
        chunks: list[bytes] = []

        async def send(message: dict[str, Any]) -> None:
            nonlocal status, headers
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                chunks.append(bytes(message.get("body", b"")))

        task = asyncio.ensure_future(app(scope, receive, send))  # type: ignore[arg-type]
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)
        try:
            # Shielded: a cancelled call (the client left, so Ray cancelled it) reaches the app
            # as its client's disconnect, which drops the queued work, not as a cancellation
            # in the middle of its middlewares.
            await asyncio.shield(task)
        except asyncio.CancelledError:
            left.set()
            raise
        except Exception:
            # Starlette re-raises a bug of ours after it answered 500: keep that answer.
            if status == 0:
                raise
            logger.exception("the app raised after answering %d", status)
        finally:
            left.set()
        return Reply(status=status, headers=headers, body=b"".join(chunks))

    async def __del__(self) -> None:
        """Ray's graceful shutdown: end the lifespan, which drains the batcher."""
        lifespan: LifespanOn | None = getattr(self, "_lifespan", None)
        if lifespan is not None:
            await lifespan.shutdown()


class SDPADirectReplica(_Replica):
    """A replica that is Ray's ingress itself (serve.ingress, below): Ray runs the app's
    lifespan, and ends it before __del__."""

    def __init__(self, settings_args: dict[str, Any], env: dict[str, str]) -> None:
        self._settings_args = settings_args
        self._env = env

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Ray 2.60 builds a late-bound ingress app here, in the replica, after __init__.
        return self._build_app(self._settings_args, self._env)


class RetryingIngress:
    """Ray's HTTP ingress: each request read whole and handed to a replica; sent again to
    another if its replica died with it (module docstring)."""

    def __init__(self, replicas: DeploymentHandle[Any], attempts: int) -> None:
        self._replicas = replicas.options(method_name="forward")
        self._attempts = attempts

    async def __call__(self, request: Request) -> Response:
        scope = request.scope
        forwarded = Forwarded(
            method=scope["method"],
            path=scope["path"],
            root_path=scope.get("root_path", ""),
            raw_path=scope.get("raw_path") or scope["path"].encode(),
            query_string=scope.get("query_string", b""),
            headers=list(scope["headers"]),
            body=await request.body(),
            client=tuple(scope["client"]) if scope.get("client") else None,
            scheme=scope.get("scheme", "http"),
            http_version=scope.get("http_version", "1.1"),
        )
        reply = await self._answer(forwarded)
        response = Response(content=reply.body, status_code=reply.status)
        # The app's own headers, content-length included, less the request id it echoed: Ray's
        # proxy adds the same X-Request-ID itself (http_util.RequestIdMiddleware).
        sent_id = request.headers.get("x-request-id", "").encode()
        response.raw_headers = [
            (name, value)
            for name, value in reply.headers
            if not (name.lower() == b"x-request-id" and value == sent_id)
        ]
        return response

    async def _answer(self, forwarded: Forwarded) -> Reply:
        for attempt in range(1, self._attempts + 1):
            call = self._replicas.remote(forwarded)
            try:
                reply: Reply = await call
                return reply
            except asyncio.CancelledError:
                call.cancel()  # type: ignore[no-untyped-call]  # ray 2.60 leaves it untyped
                raise
            except RayActorError as exc:
                # ActorDiedError: the replica died with the request (ray.kill, OOM, a lost
                # node); ActorUnavailableError: it cannot be reached, and may be computing
                # still. Either way the computation is pure: sending it again is safe.
                if attempt == self._attempts:
                    serve_logger.warning(
                        "gave up after %d attempts: %s", attempt, type(exc).__name__
                    )
                    return _bad_gateway(attempt)
                serve_logger.warning(
                    "a replica dropped a request (%s); sending it again", type(exc).__name__
                )
                await asyncio.sleep(RETRY_BACKOFF_S[attempt - 1])
        raise AssertionError("unreachable")  # the loop returns on its last attempt


def _bad_gateway(attempts: int) -> Reply:
    import orjson

    from service.errors import PROBLEM_JSON, problem_payload

    body = orjson.dumps(
        problem_payload(
            status=502,
            detail=f"the replicas died with this request {attempts} times; it is safe to retry",
        )
    )
    headers = [
        (b"content-type", PROBLEM_JSON.encode()),
        (b"content-length", str(len(body)).encode()),
    ]
    return Reply(status=502, headers=headers, body=body)


# ---- the application ---------------------------------------------------------------------


def build(args: Mapping[str, Any]) -> serve.Application:
    """The Ray Serve application for `args` (`serve run service.ray:build key=value ...`).

    Args:
        args: Ray's options (RayOptions: num_replicas, min_replicas/max_replicas,
            target_backlog_s, max_ongoing_requests, num_cpus, num_gpus, ingress, attempts, ...)
            and the service's settings by field name (device, max_batch_size, ...). The SDPA_*
            and OTEL_* variables of this process reach the replicas too; args win.

    Returns:
        The application: the retrying ingress bound to the replicas, or the replicas as Ray's
        ingress (ingress=direct).

    Raises:
        ValueError: an unknown key or a bad value, named.
    """
    plan = parse_args(args)
    options, settings = plan.options, plan.settings
    max_ongoing = options.max_ongoing_requests or settings.max_queue + settings.max_batch_size
    deployment_options: dict[str, Any] = {
        "name": "sdpa",
        "max_ongoing_requests": max_ongoing,
        "ray_actor_options": {"num_cpus": options.num_cpus, "num_gpus": options.num_gpus},
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S,
        "graceful_shutdown_wait_loop_s": SHUTDOWN_WAIT_LOOP_S,
        "graceful_shutdown_timeout_s": settings.drain_timeout_s + SHUTDOWN_MARGIN_S,
    }
    if options.max_replicas_per_node is not None:
        deployment_options["max_replicas_per_node"] = options.max_replicas_per_node
    if options.autoscaling():
        deployment_options["autoscaling_config"] = _autoscaling_config(options, settings)
    else:
        deployment_options["num_replicas"] = options.num_replicas
    init_args = (plan.settings_args, plan.env)
    if options.ingress == "direct":
        direct = serve.ingress()(SDPADirectReplica)
        return serve.deployment(**deployment_options)(direct).bind(*init_args)
    replicas = serve.deployment(**deployment_options)(SDPAReplica).bind(*init_args)
    ingress_actor: dict[str, Any] = {"num_cpus": 0}
    if options.ingress_on_head:
        ingress_actor["resources"] = {"node:__internal_head__": 0.001}
    # An ingress replica only waits on the replicas: it holds what they all hold, its share.
    most_replicas = options.max_replicas or options.num_replicas
    ingress_cap = math.ceil(max_ongoing * most_replicas / options.ingress_replicas)
    ingress = serve.deployment(
        name="ingress",
        num_replicas=options.ingress_replicas,
        max_ongoing_requests=max(ingress_cap, 1024),
        ray_actor_options=ingress_actor,
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
        graceful_shutdown_timeout_s=settings.drain_timeout_s + 2 * SHUTDOWN_MARGIN_S,
    )(RetryingIngress)
    return ingress.bind(replicas, options.attempts)


def _autoscaling_config(options: RayOptions, settings: Settings) -> dict[str, Any]:
    target_ongoing = options.target_ongoing_requests or float(settings.max_batch_size)
    return {
        "min_replicas": options.min_replicas if options.min_replicas is not None else 1,
        "max_replicas": options.max_replicas,
        "target_ongoing_requests": target_ongoing,
        # As the KEDA ScaledObject does: up at once, down slowly (a stopped replica drains).
        "upscale_delay_s": 15.0,
        "downscale_delay_s": 300.0,
        "policy": {
            "policy_function": f"{__name__}:BacklogPolicy",
            "policy_kwargs": {
                "target_backlog_s": options.target_backlog_s,
                "target_ongoing_requests": target_ongoing,
            },
        },
    }


def __getattr__(name: str) -> Any:
    # `app` is built on first use, not at import: `serve run service.ray:app` reads it, and
    # importing the module (for build, for tests) reads no environment.
    if name == "app":
        return build({})
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
