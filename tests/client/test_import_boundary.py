"""sdpa_client stands alone: it loads neither torch nor the server stack, in code or at run time.

Its only third-party dependencies are numpy and httpx; rich (the loadtest's progress bar) is
imported only when installed, matplotlib and uvloop through importlib when asked for.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = REPO_ROOT / "sdpa_client"

FORBIDDEN = ("torch", "fastapi", "pydantic", "uvicorn", "starlette", "sdpa_core", "service")
DEPENDENCIES = {"numpy", "httpx"}
OPTIONAL = {"rich"}


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.parametrize("module", ["sdpa_client", "sdpa_client.loadtest", "sdpa_client.loadgen"])
def test_a_fresh_interpreter_imports_it_without_the_server_stack(module: str) -> None:
    code = (
        f"import json, sys, {module}\n"
        f"names = {list(FORBIDDEN)!r}\n"
        "print(json.dumps(sorted(n for n in names if n in sys.modules"
        " or any(m.startswith(n + '.') for m in sys.modules))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == []


def imported_top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


# The live-model tap runs inside the model's process and uses its torch (and, for Hugging Face
# models, transformers through importlib; opentelemetry when installed): the extra "tap".
TAP = PACKAGE / "tap"
TAP_DEPENDENCIES = {"torch"}


@pytest.mark.parametrize(
    "path",
    sorted(p for p in PACKAGE.rglob("*.py") if TAP not in p.parents),
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_every_import_is_stdlib_numpy_httpx_or_itself(path: Path) -> None:
    # Also catches imports inside functions, which the fresh-interpreter test cannot see.
    allowed = set(sys.stdlib_module_names) | DEPENDENCIES | OPTIONAL | {"sdpa_client"}
    assert imported_top_level_names(path) - allowed == set()
    assert imported_top_level_names(path) & set(FORBIDDEN) == set()


@pytest.mark.parametrize("path", sorted(TAP.rglob("*.py")), ids=lambda p: p.name)
def test_the_tap_adds_torch_and_nothing_of_the_server(path: Path) -> None:
    allowed = set(sys.stdlib_module_names) | DEPENDENCIES | TAP_DEPENDENCIES | {"sdpa_client"}
    assert imported_top_level_names(path) - allowed == set()


@pytest.mark.slow  # a fresh interpreter
def test_importing_the_tap_loads_torch_but_not_the_server_stack() -> None:
    code = (
        "import json, sys, sdpa_client.tap\n"
        f"names = {list(FORBIDDEN)!r}\n"
        "print(json.dumps(sorted(n for n in names if n in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == ["torch"]
