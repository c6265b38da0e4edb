"""Every command and code block in README.md, and in the docs pages that hold commands, runs as
written against a live server.

A page's fenced blocks are read in order and each is run as a reader would run it, with one
substitution: the page's addresses, 127.0.0.1:8000 (HTTP) and 127.0.0.1:8001 (gRPC), become the
test server's (free ports, so that the test never talks to a server someone else runs, and runs
beside other tests). Shell blocks (```bash) run with bash, line by line as one script; Python
blocks run with this interpreter, the venv's (`.venv/bin/python`, the one the pages name), in
the repository's root. Excluded: the lines `make serve`, `make test` and `make monitor` (they
serve or monitor until stopped, or run the whole suite, this test included: it is what CI's
.ci/run calls), and `pip install` (it would change this venv: tests/client/test_fresh_install.py
installs the client into a fresh one). Any other kind of block fails the test until it is given
a way to run here. A docs page with blocks that are not run here is listed in PAGES_NOT_RUN
with where they are checked instead; a new page with blocks fails the test until it is run or
listed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.support.live_server import REPO_ROOT, LiveServer, free_port, live_server

pytestmark = pytest.mark.xdist_group("readme")

README = REPO_ROOT / "README.md"
README_ADDRESS = "127.0.0.1:8000"
GRPC_ADDRESS = "127.0.0.1:8001"
EXCLUDED_COMMANDS = ("make serve", "make test", "make monitor", "pip install")
# The docs pages whose blocks run here (README.md's run in the tests above them).
PAGES_RUN = (
    "docs/getting-started.md",
    "docs/api/v1.md",
    "docs/api/grpc.md",
    "docs/client/index.md",
)
# Pages with blocks that cannot run here, and where they are checked instead.
PAGES_NOT_RUN = {
    "docs/api/v2-rest.md": "tests/e2e/test_v2_readme.py runs its tritonclient example",
    "docs/architecture.md": "the house's tree, no command: tests/service/test_layout.py checks it",
    "docs/client/tap.md": "a model and batches of your own; tests/e2e/test_tap_minilm.py taps one",
    "docs/monitoring.md": "make monitor runs until stopped: tests/e2e/test_monitor.py runs it",
    "docs/operations/container.md": "docker and buildah: tests/deploy/test_container.py",
    "docs/operations/kubernetes.md": "kubectl and a cluster: tests/deploy/test_k8s.py",
    "docs/operations/ray.md": "Ray Serve's CLI: tests/e2e/test_ray_cluster.py",
    "docs/operations/tracing.md": "serves until stopped: tests/e2e/test_tracing_live.py",
}
RUN_TIMEOUT_S = 180  # a Python block imports torch: tens of seconds on a loaded 2-core machine


@dataclass(frozen=True)
class Block:
    language: str
    code: str

    def runnable(self) -> str:
        """The block as it runs here: the excluded `make` lines left out (shell blocks)."""
        if self.language != "bash":
            return self.code
        lines = self.code.splitlines()
        return "\n".join(line for line in lines if not line.startswith(EXCLUDED_COMMANDS))


def readme_blocks(page: Path = README) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    return [
        Block(language, code)
        for language, code in re.findall(r"^```(\w*)\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    ]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path=tmp_path_factory.mktemp("readme")) as srv:
        yield srv


def run_block(block: Block, server: LiveServer, grpc_port: int | None = None) -> str:
    """Run `block` against `server` (its gRPC door on `grpc_port`); its stdout (the test fails
    on a non-zero exit)."""
    address = server.url.removeprefix("http://")
    code = block.runnable().replace(README_ADDRESS, address)
    if grpc_port is not None:
        code = code.replace(GRPC_ADDRESS, f"127.0.0.1:{grpc_port}")
    command = ["bash", "-euo", "pipefail", "-c", code]
    if block.language == "python":
        command = [sys.executable, "-c", code]
    proc = subprocess.run(
        command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=REPO_ROOT
    )
    assert proc.returncode == 0, f"{block.language} block failed:\n{code}\n{proc.stderr}"
    return proc.stdout


def reference_causal_attention() -> np.ndarray:
    """The README's curl and core example in float64: q = k = v = [[1,0],[2,0],[3,0]], causal."""
    x = np.array([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]])
    scores = x @ x.T / np.sqrt(2.0)
    scores[np.triu_indices(3, k=1)] = -np.inf
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    return np.asarray(weights @ x)


def test_the_readme_has_only_blocks_this_test_can_run() -> None:
    blocks = readme_blocks()
    assert {b.language for b in blocks} <= {"bash", "python"}, [b.language for b in blocks]
    commands = [line for b in blocks if b.language == "bash" for line in b.code.splitlines()]
    # The two commands stay in the README exactly as CI's .ci/run expects the test command.
    assert any(line.startswith("make serve") for line in commands)
    assert any(line.startswith("make test") for line in commands)
    assert "make test" in (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8")
    # What is left to run: a curl, the client example and the core example at least.
    assert sum(1 for b in blocks if b.runnable().strip()) >= 3


def test_every_readme_block_runs(server: LiveServer) -> None:
    expected = reference_causal_attention()
    checked: set[str] = set()
    for block in readme_blocks():
        if not block.runnable().strip():
            continue  # only excluded commands
        stdout = run_block(block, server)
        assert stdout.strip(), f"the block printed nothing:\n{block.code}"
        if block.language == "bash" and "curl" in block.code:
            assert README_ADDRESS in block.code
            answer = json.loads(stdout)
            output = np.array(answer["output"]["data"])
            np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-6)
            weights = np.array(answer["weights"]["data"])
            np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=1e-6)
            assert weights[0, 1] == weights[0, 2] == weights[1, 2] == 0.0  # causal
            assert answer["diagnostics"]["summary"]["masked_rows"] == 0
            checked.add("curl")
        elif "SDPAClient" in block.code:
            assert README_ADDRESS in block.code
            # print(result.output.shape, result.diagnostics.summary)
            assert stdout.startswith("(1, 4, 64, 64) "), stdout
            assert "entropy" in stdout
            assert "masked_rows" in stdout
            checked.add("client")
        elif "from sdpa_core import attention" in block.code:
            # print(res.output, res.weights, res.diagnostics.summary): torch prints 4 decimals
            for row in expected:
                assert f"[{row[0]:.4f}, 0.0000]" in stdout, stdout
            assert "masked_rows=0" in stdout
            checked.add("core")
    assert checked == {"curl", "client", "core"}


# ---- the docs pages ---------------------------------------------------------------------------


def test_every_docs_page_with_blocks_is_run_or_says_where_it_is_checked() -> None:
    with_blocks = {
        str(page.relative_to(REPO_ROOT))
        for page in (REPO_ROOT / "docs").rglob("*.md")
        if readme_blocks(page)
    }
    assert with_blocks == set(PAGES_RUN) | set(PAGES_NOT_RUN)
    for page in PAGES_RUN:
        blocks = readme_blocks(REPO_ROOT / page)
        assert {b.language for b in blocks} <= {"bash", "python"}, page


@pytest.fixture(scope="module")
def docs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, int]]:
    grpc_port = free_port()
    env = {"SDPA_GRPC_PORT": str(grpc_port)}
    with live_server(env, tmp_path=tmp_path_factory.mktemp("docs")) as srv:
        yield srv, grpc_port


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES_RUN)
def test_every_block_of_the_docs_pages_runs(docs_server: tuple[LiveServer, int], page: str) -> None:
    server, grpc_port = docs_server
    expected = reference_causal_attention()
    ran = 0
    for block in readme_blocks(REPO_ROOT / page):
        if not block.runnable().strip():
            continue  # only excluded commands
        stdout = run_block(block, server, grpc_port)
        ran += 1
        if "print(" in block.code or "curl" in block.code:
            assert stdout.strip(), f"the block printed nothing:\n{block.code}"
        if block.language == "bash" and "curl" in block.code:
            output = np.array(json.loads(stdout)["output"]["data"])
            np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-6)
        elif "SDPAClient" in block.code and "print(" in block.code:
            assert stdout.startswith("(1, 4, 64, 64) "), stdout
        elif "from sdpa_core import attention" in block.code:
            for row in expected:
                assert f"[{row[0]:.4f}, 0.0000]" in stdout, stdout
        elif "tritonclient.grpc" in block.code:
            assert GRPC_ADDRESS in block.code
            assert stdout.strip() == "(1, 4, 64, 64) (1, 4, 64)"
    assert ran >= 1, page
