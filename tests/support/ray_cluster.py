"""A real multi-node Ray cluster on loopback for the Ray Serve tests (service.ray).

ray.cluster_utils.Cluster starts a head and worker nodes as processes of this machine, each a
raylet of its own (DESIGN.md "Past one machine"; reference/live-models-kernels-and-scale.md
"Ray on one machine, for real"): `ray start` cannot, as Ray rewrites 127.0.0.1 to the
interface's address and workers then refuse to join. One HTTP proxy, on the head
(proxy_location "HeadOnly"), on a free loopback port; RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING=0
lets it spread requests over every node's replicas (it sent all to the head's otherwise).

Import this module only after pytest.importorskip("ray").
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import ray._private.ray_constants as ray_constants
from ray import serve
from ray.cluster_utils import Cluster

# Set before the first node starts: every Ray process inherits them.
RAY_ENV: dict[str, str] = {
    # Nodes on 127.0.0.1: Ray's single-host mode (its default on macOS and Windows). The driver
    # read it when ray was imported: local_cluster() sets ray_constants.ENABLE_RAY_CLUSTER too.
    # Name no node_ip_address: with "127.0.0.1" given, the driver was sent to the interface's
    # address, where nothing listened.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # A cluster on loopback for a test: no token (Ray 2.60 may otherwise write one to
    # ~/.ray/auth_token and turn token authentication on for every later cluster).
    "RAY_AUTH_MODE": "disabled",
    # Serve's own logs stay in the session's folder, not on the test's output.
    "RAY_SERVE_LOG_TO_STDERR": "0",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LocalCluster:
    """The running cluster: the proxy's URL and the nodes."""

    cluster: Cluster
    url: str
    temp_dir: str
    workers: list[Any] = field(default_factory=list)  # ray._private.node.Node

    def replicas(self, app: str = "default", deployment: str = "sdpa") -> list[dict[str, Any]]:
        """The deployment's replicas as Serve's controller knows them: state, node_id,
        actor_name, pid (the controller's details; serve.status() has counts only)."""
        client = serve.context._get_global_client()
        details = client.get_serve_details()
        deployments = details["applications"][app]["deployments"]
        return list(deployments[deployment]["replicas"])

    def count_in_logs(self, text: str) -> int:
        """Lines holding `text` in the logs of every Ray process of the session (the workers'
        stderr: where a replica's own loggers write)."""
        count = 0
        for path in Path(self.temp_dir).glob("**/logs/**/*"):
            if path.is_file() and path.suffix in (".err", ".out", ".log"):
                with path.open("rb") as lines:
                    count += sum(text.encode() in line for line in lines)
        return count

    def running(self, app: str = "default", deployment: str = "sdpa") -> list[dict[str, Any]]:
        return [r for r in self.replicas(app, deployment) if r["state"] == "RUNNING"]

    def wait_for_running(
        self, count: int, *, timeout_s: float, app: str = "default", deployment: str = "sdpa"
    ) -> list[dict[str, Any]]:
        """Wait until exactly `count` replicas run and the application is RUNNING."""
        give_up = time.monotonic() + timeout_s
        while True:
            running = self.running(app, deployment)
            status = serve.status().applications[app].status
            if len(running) == count and status == "RUNNING":
                return running
            if time.monotonic() > give_up:
                states = [(r["state"], r["node_id"]) for r in self.replicas(app, deployment)]
                raise TimeoutError(
                    f"{len(running)} of {count} replicas running, application {status}, "
                    f"after {timeout_s} s: {states}"
                )
            time.sleep(0.2)


@contextmanager
def local_cluster(
    *,
    workers: int = 2,
    head_cpus: float = 2,
    worker_cpus: float = 1,
    env: Mapping[str, str] | None = None,
    system_config: Mapping[str, Any] | None = None,
) -> Iterator[LocalCluster]:
    """A head and `workers` worker nodes on loopback, the driver connected, Serve started with
    its one proxy on a free port. Everything is torn down on the way out, whatever happened."""
    saved = {name: os.environ.get(name) for name in (*RAY_ENV, *(env or {}), "RAY_TMPDIR")}
    # A short path of our own: Ray puts unix sockets under it (107 bytes at most).
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    os.environ.update(RAY_ENV)
    os.environ.update(env or {})
    os.environ["RAY_TMPDIR"] = temp_dir
    # Read at `import ray` (ray._private.ray_constants), which came before: checked at each
    # use (services.get_node_ip_address), so setting it here keeps the driver on loopback.
    cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    head_args: dict[str, Any] = {
        "num_cpus": head_cpus,
        "include_dashboard": False,
        "_system_config": dict(system_config or {}),
    }
    cluster: Cluster | None = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args=head_args)
        nodes = [cluster.add_node(num_cpus=worker_cpus) for _ in range(workers)]
        cluster.wait_for_nodes(timeout=60)
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        yield LocalCluster(
            cluster=cluster, url=f"http://127.0.0.1:{port}", temp_dir=temp_dir, workers=nodes
        )
    finally:
        try:
            if ray.is_initialized():
                try:
                    serve.shutdown()
                finally:
                    ray.shutdown()
        finally:
            if cluster is not None:
                cluster.shutdown()
            ray_constants.ENABLE_RAY_CLUSTER = cluster_mode
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            shutil.rmtree(temp_dir, ignore_errors=True)
