"""The docs' tritonclient example (docs/api/v2-rest.md, moved there from the README) runs as
written against a real server (only its address changed to the test server's), and prints what
the page implies."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.support.live_server import REPO_ROOT, LiveServer, live_server

pytest.importorskip("tritonclient.http")
pytestmark = pytest.mark.xdist_group("v2-readme")

DOCS_PAGE = REPO_ROOT / "docs" / "api" / "v2-rest.md"
README_ADDRESS = "127.0.0.1:8000"


def readme_tritonclient_example() -> str:
    text = DOCS_PAGE.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    examples = [b for b in blocks if "import tritonclient.http" in b]
    assert len(examples) == 1, "the v2 REST page has one tritonclient example"
    assert README_ADDRESS in examples[0]
    return examples[0]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(tmp_path=tmp_path_factory.mktemp("v2-readme")) as srv:
        yield srv


def test_readme_tritonclient_example_runs(server: LiveServer) -> None:
    code = readme_tritonclient_example().replace(README_ADDRESS, server.url.removeprefix("http://"))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT
    )
    assert proc.returncode == 0, proc.stderr
    shapes, entropy = proc.stdout.strip().splitlines()
    assert shapes == "(1, 4, 64, 64) (1, 4, 64)"
    # Causal attention over 64 keys: the mean row entropy lies between 0 and log(64).
    assert 0.0 < float(entropy) < 4.16
