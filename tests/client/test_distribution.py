"""sdpa_client as a distribution: its version, its dependencies, and names of its own."""

from __future__ import annotations

import ast
import inspect
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import sdpa_client
from sdpa_client import version

REPO_ROOT = Path(__file__).resolve().parents[2]


def project_table(pyproject: Path) -> dict[str, object]:
    with pyproject.open("rb") as f:
        table: dict[str, object] = tomllib.load(f)["project"]
    return table


def test_the_two_pyprojects_give_the_same_version() -> None:
    root = project_table(REPO_ROOT / "pyproject.toml")
    client = project_table(REPO_ROOT / "sdpa_client" / "pyproject.toml")
    assert client["version"] == root["version"]


def test_the_standalone_client_needs_numpy_and_httpx_only() -> None:
    client = project_table(REPO_ROOT / "sdpa_client" / "pyproject.toml")
    dependencies = client["dependencies"]
    assert isinstance(dependencies, list)
    assert sorted(dependencies) == ["httpx>=0.27,<1", "numpy>=1.26,<3"]
    assert client["requires-python"] == ">=3.11"


def test_version_comes_from_the_installed_distribution() -> None:
    installed = [d for d in version.DISTRIBUTIONS if _is_installed(d)]
    if not installed:
        pytest.skip("neither sdpa-client nor sdpa-service is installed here")
    assert sdpa_client.__version__ == metadata.version(installed[0])
    assert sdpa_client.__version__ == project_table(REPO_ROOT / "pyproject.toml")["version"]


def test_an_uninstalled_checkout_says_its_version_is_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert version.installed_version() == version.UNKNOWN_VERSION == "0+unknown"


def _is_installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def public_names() -> dict[str, str]:
    """Every public name that a module of sdpa_client defines at top level -> that module."""
    names: dict[str, str] = {}
    for path in sorted((REPO_ROOT / "sdpa_client").rglob("*.py")):
        module = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                defined = [node.name]
            elif isinstance(node, ast.Assign):
                defined = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defined = [node.target.id]
            else:
                defined = []
            names.update({n: module for n in defined if not n.startswith("_")})
    return names


def test_no_public_name_collides_with_the_server_s() -> None:
    import sdpa_core
    from service import errors as service_errors

    taken = {name.lower(): f"sdpa_core.{name}" for name in sdpa_core.__all__}
    for name, value in vars(service_errors).items():
        if inspect.isclass(value) and value.__module__ == service_errors.__name__:
            taken.setdefault(name.lower(), f"service.errors.{name}")
    names = public_names()
    assert {"SDPAClient", "AttentionResponse", "SUMMARY_STAT_NAMES", "Encoding"} <= names.keys()
    clashes = {
        f"{module}.{name}": taken[name.lower()]
        for name, module in names.items()
        if name.lower() in taken
    }
    assert clashes == {}
