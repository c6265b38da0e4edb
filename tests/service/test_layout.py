"""The house's rules, read from the source: data flows one way (api -> serving -> runtime ->
sdpa_core), serving and runtime know nothing of HTTP frameworks, the wire models hold no torch,
and nothing refers to files that do not ship."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import service

SERVICE = Path(service.__file__).resolve().parent
REPO = SERVICE.parent

# room -> module prefixes its code must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    # The doors decode and answer; serving hands them what they need. No route computes, none
    # reaches the runtime or sdpa_core (serving turns their errors into ServiceErrors), and
    # the doors and the HTTP middlewares share no code but neutral modules (service.routes,
    # service.http_errors): neither imports the other.
    "api": ("sdpa_core", "torch", "service.runtime", "service.middleware"),
    "middleware": ("service.api",),
    "serving": ("fastapi", "starlette", "uvicorn", "service.api", "service.middleware"),
    "runtime": (
        "fastapi", "starlette", "uvicorn", "pydantic", "service.api", "service.serving",
        "service.wire", "service.middleware",
    ),
    "wire/models.py": ("torch", "sdpa_core"),
}  # fmt: skip

# room -> modules it may import although FORBIDDEN names a prefix of them
ALLOWED: dict[str, tuple[str, ...]] = {}


def imported_modules(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            yield node.module


def files_of(room: str) -> list[Path]:
    target = SERVICE / room
    return [target] if target.suffix == ".py" else sorted(target.rglob("*.py"))


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_each_room_imports_only_downstream(room: str) -> None:
    files = files_of(room)
    assert files, room
    for path in files:
        for module in imported_modules(path):
            if module in ALLOWED.get(room, ()):
                continue
            for prefix in FORBIDDEN[room]:
                inside = module == prefix or module.startswith(prefix + ".")
                assert not inside, f"{path.relative_to(REPO)} imports {module}"


def test_nothing_refers_to_files_that_do_not_ship() -> None:
    shipped = [
        path
        for package in (SERVICE, REPO / "sdpa_core", REPO / "sdpa_client")
        for pattern in ("*.py", "*.js", "*.html", "*.css")
        for path in package.rglob(pattern)
    ]
    for path in shipped:
        text = path.read_text(encoding="utf-8")
        for reference in ("DESIGN.md", "kernel-anchors", "reference/", "serving-anchors"):
            assert reference not in text, f"{path.relative_to(REPO)} mentions {reference}"


def test_every_package_ships_py_typed() -> None:
    for package in ("sdpa_core", "service", "sdpa_client"):
        assert (REPO / package / "py.typed").is_file(), package


# module -> modules it must not load, even through what it imports (a fresh interpreter)
NOT_LOADED: dict[str, tuple[str, ...]] = {
    "service.errors": ("torch", "fastapi", "starlette", "pydantic"),
    "service.wire.models": ("torch", "fastapi", "starlette"),
    "service.serving.pipeline": ("fastapi", "starlette.applications", "uvicorn"),
    "service.runtime.engine": ("fastapi", "starlette", "uvicorn", "pydantic"),
}


@pytest.mark.slow  # a fresh interpreter
@pytest.mark.parametrize("module", sorted(NOT_LOADED))
def test_a_room_loads_no_framework_it_must_not_know(module: str) -> None:
    forbidden = NOT_LOADED[module]
    probe = f"import sys, {module}; print(' '.join(m for m in {forbidden!r} if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "", f"importing {module} loads {done.stdout.strip()}"
