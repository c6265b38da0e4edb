"""service.ray on a real three-node Ray cluster on loopback (issues 28 and 40): three replicas
answer as the float64 reference says, from at least two nodes, and every kind of replica the
app has killed in turn under a closed loop of sdpa_client at its default retries (a computing
replica, then one of the two ingress replicas, each while it holds requests), then a worker
node lost (its raylet and workers SIGKILLed), cost the client no request: Ray replaces what
died (the replica counts come back), the retrying ingress sends again what a dead computing
replica dropped, and the client sends again what a dead ingress replica dropped (Ray's proxy
answers those 500 without the service's envelope: ray-project/ray#47219); nor do the replicas
Ray stops in a redeploy (they drain).

About two minutes on two loaded cores; skipped without ray (`pip install sdpa-service[ray]`).
Run with `-s` to see the figures.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("ray.serve", reason="needs ray[serve] (the `ray` extra)")

import ray
from ray import serve

from sdpa_client import NO_RETRY, SDPAClient
from service.ray import build
from tests.support.ray_cluster import LocalCluster, local_cluster
from tests.support.v2_cases import Case, assert_close, expected, make_case, mask_cases

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

REPLICAS = 3
INGRESSES = 2  # service.ray's default ingress_replicas
# Strings, as `serve run service.ray:build num_replicas=3 ...` passes them. No kernel compile:
# a replica started after a death warms up in seconds (tests/e2e/test_kernel.py tests it).
ARGS = {
    "num_replicas": "3",
    "device": "cpu",
    "compile_kernels": "false",
    "log_level": "warning",
    "drain_timeout_s": "10",
    # A lone request waits this long for company before its batch runs: every replica holds
    # requests most of the time, so a replica that dies always takes some with it (the victims
    # are chosen among the replicas that hold some), and the ingress's retry is exercised.
    "max_batch_delay_ms": "500",
}
CLIENTS = 4
LOAD_MAX_S = 240.0  # the closed loop stops by then whatever happens
LOAD_MAX_REQUESTS = 50_000
RESTORE_S = 150.0


@dataclass
class Load:
    """A closed loop of CLIENTS sdpa_client threads, each checking every answer against the
    float64 reference; bounded in time and count."""

    url: str
    case: Case
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    answered_at: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        want = expected(self.case).output
        give_up = time.monotonic() + LOAD_MAX_S

        def loop() -> None:
            # sdpa_client's default retries (RetryPolicy()): what its users get.
            with SDPAClient(self.url, timeout=60) as client:
                while not self.stop.is_set() and time.monotonic() < give_up:
                    if len(self.answered_at) + len(self.failures) >= LOAD_MAX_REQUESTS:
                        return
                    try:
                        got = client.attention(
                            self.case.q, self.case.k, self.case.v, diagnostics="none"
                        )
                        assert_close(got.output, want, "FP32")
                    except Exception as exc:  # counted: the test fails on any
                        with self.lock:
                            self.failures.append(f"{time.monotonic():.2f} {exc!r}"[:300])
                    else:
                        with self.lock:
                            self.answered_at.append(time.monotonic())

        self.threads = [threading.Thread(target=loop, daemon=True) for _ in range(CLIENTS)]
        for thread in self.threads:
            thread.start()

    def answered_between(self, start: float, end: float) -> int:
        with self.lock:
            return sum(start <= t < end for t in self.answered_at)

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=90)
        assert not any(t.is_alive() for t in self.threads), "a client thread is stuck"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    started = time.monotonic()
    with local_cluster(workers=2, head_cpus=2, worker_cpus=1) as local:
        print(f"\ncluster of 3 nodes up in {time.monotonic() - started:.1f} s")
        yield local


def wait_until(
    cluster: LocalCluster, done: Callable[[list[dict[str, Any]]], bool], what: str
) -> tuple[list[dict[str, Any]], float]:
    """Wait (at most RESTORE_S) until REPLICAS replicas run and `done(replicas)`; the replicas
    and the seconds it took."""
    started = time.monotonic()
    while True:
        running = cluster.wait_for_running(REPLICAS, timeout_s=RESTORE_S)
        if done(running):
            return running, time.monotonic() - started
        if time.monotonic() - started > RESTORE_S:
            raise TimeoutError(f"{what}: not within {RESTORE_S} s: {running}")
        time.sleep(0.2)


def busy(candidates: list[dict[str, Any]]) -> dict[str, Any]:
    """One of `candidates` that holds a request now, by Ray's own count (its replica actor's
    get_num_ongoing_requests), waiting a little for one."""
    give_up = time.monotonic() + 30.0
    while time.monotonic() < give_up:
        for replica in candidates:
            actor = ray.get_actor(replica["actor_name"], namespace="serve")
            if ray.get(actor.get_num_ongoing_requests.remote(), timeout=10) > 0:
                return replica
        time.sleep(0.02)
    raise TimeoutError(f"none of {[r['actor_name'] for r in candidates]} holds a request")


RETRIED = "sending it again"  # what the ingress logs when it resends a dropped request


def test_three_replicas_answer_from_two_nodes_and_lose_nothing_when_one_dies(
    cluster: LocalCluster,
) -> None:
    started = time.monotonic()
    serve.run(build(ARGS), name="default", route_prefix="/", blocking=False)
    running = cluster.wait_for_running(REPLICAS, timeout_s=RESTORE_S)
    print(f"3 replicas running in {time.monotonic() - started:.1f} s")
    nodes = {replica["node_id"] for replica in running}
    assert len(nodes) >= 2, f"all replicas on one node: {running}"

    # Answers against the float64 reference, every mask option, through Ray's proxy.
    with SDPAClient(cluster.url, retry=NO_RETRY, timeout=60) as client:
        for name, case in mask_cases().items():
            got = client.attention(
                case.q, case.k, case.v, causal=case.causal, key_lengths=case.key_lengths,
                key_padding_mask=case.key_padding_mask, attn_mask=case.attn_mask,
                scale=case.scale, temperature=case.temperature, diagnostics="none",
            )  # fmt: skip
            try:
                assert_close(got.output, expected(case).output, case.datatype)
            except AssertionError as exc:
                raise AssertionError(f"case {name}") from exc
        assert client.readyz()

    load = Load(cluster.url, make_case((2, 4, 64, 32), seed=3))
    load.start()
    try:
        time.sleep(3.0)
        # A replica holding requests dies (SIGKILL of its worker process).
        victim = busy(running)
        killed_at = time.monotonic()
        ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)
        running, took = wait_until(
            cluster,
            lambda reps: victim["actor_name"] not in {r["actor_name"] for r in reps},
            "a killed replica replaced",
        )
        retried_after_kill = cluster.count_in_logs(RETRIED)
        print(f"killed replica replaced in {took:.1f} s; {retried_after_kill} requests resent")
        time.sleep(2.0)

        # An ingress replica holding requests dies: the proxy routes to the other one, the
        # requests the dead one held come back to the client as Ray's 500, and it sends them
        # again; Ray starts another ingress replica.
        ingresses = cluster.wait_for_running(INGRESSES, timeout_s=RESTORE_S, deployment="ingress")
        ingress = busy(ingresses)
        ingress_killed_at = time.monotonic()
        ray.kill(ray.get_actor(ingress["actor_name"], namespace="serve"), no_restart=True)
        give_up = time.monotonic() + RESTORE_S
        while True:
            ingresses = cluster.running(deployment="ingress")
            names = {r["actor_name"] for r in ingresses}
            if len(ingresses) == INGRESSES and ingress["actor_name"] not in names:
                break
            assert time.monotonic() < give_up, f"the ingress not restored: {ingresses}"
            time.sleep(0.2)
        print(f"killed ingress replica replaced in {time.monotonic() - ingress_killed_at:.1f} s")
        time.sleep(2.0)

        # A worker node whose replica holds requests is lost, every process of it at once: its
        # replicas' and then its raylet and the rest (remove_node alone SIGKILLs the raylet, and
        # a replica whose raylet died may still finish what it holds before it notices).
        workers = {node.node_id: node for node in cluster.workers}
        lost = workers[busy([r for r in running if r["node_id"] in workers])["node_id"]]
        lost_at = time.monotonic()
        for replica in running:
            if replica["node_id"] == lost.node_id:
                os.kill(replica["pid"], signal.SIGKILL)
        cluster.cluster.remove_node(lost, allow_graceful=False)
        running, took = wait_until(
            cluster,
            lambda reps: lost.node_id not in {r["node_id"] for r in reps},
            "the replicas of a lost node replaced",
        )
        retried_after_loss = cluster.count_in_logs(RETRIED)
        print(
            f"lost node's replicas replaced in {took:.1f} s; "
            f"{retried_after_loss - retried_after_kill} requests resent"
        )
        time.sleep(2.0)
        status = serve.status().applications["default"]
        assert status.status == "RUNNING"
        assert status.deployments["sdpa"].replica_states.get("RUNNING") == REPLICAS
        assert status.deployments["ingress"].replica_states.get("RUNNING") == INGRESSES

        # A redeploy with two replicas: Ray stops replicas (a new deploy of the Python API is a
        # new code version, so it replaces them all, one by one); a stopped replica drains (its
        # requests finish, then its lifespan ends) and loses nothing either.
        before = {r["actor_name"] for r in running}
        scaled_at = time.monotonic()
        serve.run(build({**ARGS, "num_replicas": "2"}), name="default", blocking=False)
        after = cluster.wait_for_running(2, timeout_s=RESTORE_S)
        kept = len(before & {r["actor_name"] for r in after})
        print(f"redeployed with 2 replicas in {time.monotonic() - scaled_at:.1f} s ({kept} kept)")
        time.sleep(2.0)
    finally:
        load.finish()
    ended = time.monotonic()

    answered, failed = len(load.answered_at), len(load.failures)
    print(f"closed loop of {CLIENTS}: {answered} answered, {failed} failed")
    assert load.failures == [], load.failures[:10]
    # Each death dropped requests, and the ingress sent them again: no request was lost to luck.
    assert retried_after_kill > 0
    assert retried_after_loss > retried_after_kill
    # The load ran through every death and the redeploy.
    assert load.answered_between(killed_at, ingress_killed_at) > 0
    assert load.answered_between(ingress_killed_at, lost_at) > 0
    assert load.answered_between(lost_at, scaled_at) > 0
    assert load.answered_between(scaled_at, ended) > 0
