"""service.ray without a cluster: build()'s arguments, the autoscaling policy's arithmetic, and
a replica's request path (the app, its lifespan and its health check) in a process of its own,
as Ray would run it, with no Ray around it. Skipped without ray (the `ray` extra).

The multi-node behaviour (replicas on nodes, deaths under load) is tests/e2e/test_ray_cluster.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="needs ray[serve] (the `ray` extra)")

from ray import serve

from service.ray import (
    HEALTH_CHECK_PERIOD_S,
    BacklogPolicy,
    RetryingIngress,
    SDPAReplica,
    build,
    parse_args,
)
from tests.support.live_server import REPO_ROOT


def _deployments(app: serve.Application) -> dict[str, Any]:
    """The application's deployments by name (the ingress's first init arg is the replicas)."""
    ingress = app._bound_deployment
    found = {ingress.name: ingress}
    for arg in ingress.init_args:
        if isinstance(arg, serve.Application):
            found[arg._bound_deployment.name] = arg._bound_deployment
    return found


def test_importing_service_ray_starts_nothing() -> None:
    code = (
        "import sys, ray, service.ray; print(int('torch' in sys.modules), "
        "int(ray.is_initialized()), int(hasattr(service.ray, 'app')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    # No torch (no engine), no Ray started; `app` (build({})) is there for `serve run`.
    assert out.stdout.split() == ["0", "0", "1"]


def test_build_reads_string_args_as_serve_run_passes_them() -> None:
    app = build({"num_replicas": "3", "max_batch_size": "16", "device": "cpu"})
    deployments = _deployments(app)
    assert set(deployments) == {"ingress", "sdpa"}
    replicas = deployments["sdpa"]
    assert replicas.func_or_class is SDPAReplica
    assert replicas.num_replicas == 3
    config = replicas._deployment_config
    assert config.health_check_period_s == HEALTH_CHECK_PERIOD_S
    # The drain timeout (30 s) and a margin before Ray kills a stopping replica.
    assert config.graceful_shutdown_timeout_s == 40.0
    # The service's queue (1024) and a batch: Ray's cap never decides before it does.
    assert replicas.max_ongoing_requests == 1024 + 16
    settings_args, _env = replicas.init_args
    assert settings_args == {"max_batch_size": "16", "device": "cpu"}
    ingress = deployments["ingress"]
    assert ingress.func_or_class is RetryingIngress
    assert ingress.ray_actor_options["resources"] == {"node:__internal_head__": 0.001}
    assert ingress.init_args[1] == 4  # attempts
    assert ingress.num_replicas == 2  # the proxy routes around a dead one


def test_direct_ingress_is_the_app_itself() -> None:
    app = build({"ingress": "direct", "num_replicas": "2"})
    deployments = _deployments(app)
    assert set(deployments) == {"sdpa"}
    assert deployments["sdpa"].num_replicas == 2


def test_autoscaling_uses_the_backlog_policy() -> None:
    app = build({"min_replicas": "2", "max_replicas": "6", "target_backlog_s": "1.5"})
    config = _deployments(app)["sdpa"]._deployment_config.autoscaling_config
    assert (config.min_replicas, config.max_replicas) == (2, 6)
    assert config.policy.policy_function == "service.ray:BacklogPolicy"
    assert config.policy.policy_kwargs == {
        "target_backlog_s": 1.5,
        "target_ongoing_requests": 32.0,
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"replicas": "3"}, "unknown argument(s) replicas"),
        ({"port": "8000"}, "port cannot be set inside Ray"),
        ({"grpc_port": "8001"}, "grpc_port cannot be set inside Ray"),
        ({"num_replicas": "three"}, "num_replicas: Input should be a valid integer"),
        ({"max_batch_size": "0"}, "settings: max_batch_size"),
        ({"device": "cuda"}, "device cuda needs num_gpus > 0"),
        ({"min_replicas": "2"}, "min_replicas needs max_replicas"),
        ({"min_replicas": "5", "max_replicas": "2"}, "min_replicas 5 is past max_replicas 2"),
        ({"ingress": "nginx"}, "ingress: Input should be 'retrying' or 'direct'"),
    ],
)
def test_bad_args_fail_naming_the_key(args: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=r"^service\.ray\.build: ") as raised:
        build(args)
    assert message in str(raised.value)


def test_the_environment_reaches_the_replicas_and_args_win() -> None:
    plan = parse_args(
        {"max_batch_size": "8"},
        environ={"SDPA_MAX_BATCH_SIZE": "64", "SDPA_MAX_QUEUE": "100", "HOME": "/root"},
    )
    assert plan.env == {"SDPA_MAX_BATCH_SIZE": "64", "SDPA_MAX_QUEUE": "100"}
    assert (plan.settings.max_batch_size, plan.settings.max_queue) == (8, 100)


def _context(*, replicas: int, backlogs: list[float], requests: float) -> Any:
    return SimpleNamespace(
        current_num_replicas=replicas,
        target_num_replicas=replicas,
        aggregated_metrics={"backlog_seconds": {f"r{i}": b for i, b in enumerate(backlogs)}},
        total_num_requests=requests,
    )


def test_backlog_policy_wants_the_replicas_that_bring_the_backlog_to_target() -> None:
    policy = BacklogPolicy(target_backlog_s=2.0, target_ongoing_requests=32.0)
    # 9 s of queued work over 2 s per replica: 4.5 replicas (Ray rounds up, within bounds).
    assert policy(_context(replicas=2, backlogs=[5.0, 4.0], requests=10))[0] == 4.5
    # Many small requests in flight and no backlog yet (warming up): the request count decides.
    assert policy(_context(replicas=2, backlogs=[0.0, 0.0], requests=160))[0] == 5.0
    assert policy(_context(replicas=3, backlogs=[0.0] * 3, requests=0))[0] == 0.0
    no_metrics = SimpleNamespace(
        current_num_replicas=1, target_num_replicas=1, aggregated_metrics=None,
        total_num_requests=64,
    )  # fmt: skip
    assert policy(no_metrics)[0] == 2.0


# A replica as Ray runs it, in a process of its own (it sets process-wide things: torch's
# threads, the switch interval, the service's loggers), driven the way Ray drives it.
REPLICA_SCRIPT = textwrap.dedent(
    """
    import asyncio, base64, json, sys
    import numpy as np
    from service.ray import Forwarded, SDPAReplica

    def post(path, body, **extra):
        return Forwarded(
            method="POST", path=path, root_path="", raw_path=path.encode(), query_string=b"",
            headers=[(b"content-type", b"application/json"), (b"x-request-id", b"abc")],
            body=json.dumps(body).encode(), client=("127.0.0.1", 1), scheme="http",
            http_version="1.1", **extra,
        )

    async def main():
        replica = SDPAReplica.__new__(SDPAReplica)
        await replica.__init__({"device": "cpu", "compile_kernels": "false"}, {})
        await replica.check_health()  # Ray's first check: waits for the warm-up
        out = {"ready": replica._state().not_ready_reason()}
        x = np.arange(8, dtype=np.float32).reshape(1, 2, 4) / 8
        t = {"dtype": "float32", "shape": [1, 2, 4], "b64": base64.b64encode(x.tobytes()).decode()}
        reply = await replica.forward(post("/v1/attention", {"q": t, "k": t, "v": t}))
        out["status"] = reply.status
        out["headers"] = {k.decode(): v.decode() for k, v in reply.headers}
        out["body"] = json.loads(reply.body)
        bad = await replica.forward(post("/v1/attention", {"q": t}))
        out["bad_status"] = bad.status
        # A call Ray cancels (its client left): the app hears a disconnect, the work is dropped.
        long = post("/v1/analyze", {"synthetic": {"n_q": 4096, "n_k": 4096, "d_k": 64}})
        call = asyncio.ensure_future(replica.forward(long))
        await asyncio.sleep(0.3)
        call.cancel()
        try:
            await call
        except asyncio.CancelledError:
            out["cancelled"] = True
        out["stats"] = await replica.record_autoscaling_stats()
        await replica.__del__()  # Ray's graceful shutdown: the lifespan ends, the batcher drains
        out["drained"] = replica._state().draining()
        print("RESULT " + json.dumps(out))

    asyncio.run(main())
    """
)


@pytest.mark.slow
def test_a_replica_answers_forwarded_requests_through_the_app() -> None:
    out = subprocess.run(
        [sys.executable, "-c", REPLICA_SCRIPT],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result["ready"] is None
    assert result["status"] == 200
    assert result["headers"]["content-type"] == "application/json"
    assert result["headers"]["x-request-id"] == "abc"
    assert int(result["headers"]["content-length"]) > 0
    assert result["body"]["output"]["shape"] == [1, 2, 4]
    assert result["bad_status"] == 422
    assert result["cancelled"] is True
    assert set(result["stats"]) == {"backlog_seconds"}
    assert result["drained"] is True
