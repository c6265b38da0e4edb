"""The house's rules, read from the source: data flows one way (edge -> api -> serving ->
runtime -> sdpa_core), serving and runtime know nothing of HTTP frameworks, the wire models hold
no torch, and nothing refers to files that do not ship. And watched at work: a v1 request's walk
enters each room once, in order (docs/architecture.md); a request's state travels between the
rooms in its Exchange, never under string keys of the ASGI scope's state; the gRPC door writes
no log line, metric or span of its own (the one recorder does)."""

from __future__ import annotations

import ast
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, Final

import pytest

import service
from tests.support.app import in_process_client, small_settings

SERVICE = Path(service.__file__).resolve().parent
REPO = SERVICE.parent

# room -> module prefixes its code must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    # The doors decode and answer; serving hands them what they need. No route computes, none
    # reaches the runtime or sdpa_core (serving turns their errors into ServiceErrors), and
    # the doors and the HTTP middlewares share no code but neutral modules (service.routes,
    # service.http_errors): neither imports the other.
    "api": ("sdpa_core", "torch", "service.runtime", "service.middleware", "service.protocol"),
    "middleware": ("service.api", "service.runtime"),
    # The HTTP/1.1 layer below ASGI: it knows no application room.
    "protocol": (
        "fastapi", "starlette", "service.api", "service.middleware", "service.serving",
        "service.runtime",
    ),
    "serving": (
        "fastapi", "starlette", "uvicorn", "service.api", "service.middleware", "service.protocol",
    ),
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


# ---- the Exchange: no string keys between rooms, one recorder -------------------------------


def reads_of_scope_state(path: Path) -> Iterator[str]:
    """Where a module reads or writes the ASGI scope's state (Starlette's request.state):
    `request.state`, `<x>.scope.state`, `scope["state"]`, `.get("state")`,
    `.setdefault("state", ...)`. The application's own state (`app.state`) is not it."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Attribute) and node.attr == "state":
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "request") or (
                isinstance(owner, ast.Attribute) and owner.attr == "scope"
            ):
                yield f"line {node.lineno}: {ast.unparse(node)}"
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            if node.slice.value == "state":
                yield f"line {node.lineno}: {ast.unparse(node)}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            first = node.args[0] if node.args else None
            asks = node.func.attr in ("get", "setdefault")
            if asks and isinstance(first, ast.Constant) and first.value == "state":
                yield f"line {node.lineno}: {ast.unparse(node)}"


@pytest.mark.parametrize("room", ["api", "serving", "runtime", "middleware"])
def test_no_room_reads_the_scopes_state_keys(room: str) -> None:
    """A request's state travels in its Exchange (service.serving.exchange), set by the edge
    and read through exchange_of(), never under string keys in scope["state"]."""
    for path in files_of(room):
        found = list(reads_of_scope_state(path))
        assert not found, f"{path.relative_to(REPO)} reads the scope's state: {found}"


def test_the_checker_finds_a_read_of_the_scopes_state(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "t = request.state.tenant\n"
        "scope.setdefault('state', {})['tenant'] = 'a'\n"
        "rid = scope['state']['request_id']\n"
        "s = request.app.state.sdpa\n"  # the application's state: not a request's
    )
    assert len(list(reads_of_scope_state(sample))) == 3


def test_the_grpc_door_has_no_log_metric_or_span_code_of_its_own() -> None:
    """The gRPC servicer fills in its calls' Exchanges; the one recorder (service.access_log)
    writes their log lines, metrics and spans, as for the HTTP edge."""
    source = (SERVICE / "api" / "grpc.py").read_text(encoding="utf-8")
    for code in (
        "sdpa.access", "json_fields", "requests_total", "request_duration_seconds",
        "start_grpc", "start_http", "ServerSpan", ".end(", "datetime",
    ):  # fmt: skip
        assert code not in source, f"service/api/grpc.py has {code!r}"
    assert "recorder.record(" in source


# ---- a v1 request's walk --------------------------------------------------------------------

# The rooms a request walks through, in order (docs/architecture.md, "A v1 request's walk").
WALK = ("middleware", "api", "serving", "runtime", "sdpa_core")


# The middlewares' closures handed down as ASGI's receive and send are ASGI's own channel back
# up (a body read, an answer sent), not a call back up the stack: what runs inside one is left
# out of the walk.
CHANNEL: Final = "channel"


def room_of(frame: FrameType) -> str | None:
    """The room whose code `frame` runs, CHANNEL for a middleware's receive or send, or None
    (a library, a neutral module of service)."""
    path = Path(frame.f_code.co_filename)
    for room in WALK:
        base = REPO / "sdpa_core" if room == "sdpa_core" else SERVICE / room
        if path.is_relative_to(base):
            if room == "middleware" and "<locals>" in frame.f_code.co_qualname:
                return CHANNEL
            return room
    return None


def rooms_on_stack(frame: FrameType | None) -> tuple[str, ...]:
    """The rooms of the frames on a stack, outermost first, each run of one room once; what
    runs inside a middleware's receive or send left out."""
    rooms: list[str] = []
    while frame is not None:
        room = room_of(frame)
        if room == CHANNEL:
            rooms.clear()  # everything inner to it is the channel's
        elif room is not None and (not rooms or rooms[-1] != room):
            rooms.append(room)
        frame = frame.f_back
    return tuple(reversed(rooms))


def test_a_v1_request_enters_each_room_once_in_order() -> None:
    """Every call made while one v1 request is served, on every thread (the event loop, the
    device thread): the rooms on its stack, outermost first, are a subsequence of the walk, so
    no room is entered twice and nothing calls back up the stack (serving into the in-flight
    middleware or the disconnect watch, as it once did through closures); and the request's
    walk reaches every room."""
    stacks: set[tuple[str, ...]] = set()
    recording = threading.Event()

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and recording.is_set():
            stacks.add(rooms_on_stack(frame))

    threading.setprofile(profile)  # the threads started from here on: the app's
    try:
        with in_process_client(small_settings()) as client:
            sys.setprofile(profile)
            recording.set()
            try:
                response = client.post(
                    "/v1/attention",
                    json={"q": [[1.0, 0.0]], "k": [[1.0, 0.0], [0.0, 1.0]], "v": [[1.0], [2.0]]},
                )
            finally:
                recording.clear()
                sys.setprofile(None)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]  # None: no profiling
    assert response.status_code == 200, response.text
    order = {room: index for index, room in enumerate(WALK)}
    # The request's own calls: those under the edge. (The device thread's idle work, the
    # health monitor's samples that the batcher runs between batches, is not the request's.)
    walked = [rooms for rooms in stacks if rooms and rooms[0] == "middleware"]
    for rooms in walked:
        ranks = [order[room] for room in rooms]
        assert ranks == sorted(set(ranks)), f"a call back up the stack: {' -> '.join(rooms)}"
    assert max(walked, key=len)[:4] == WALK[:4]  # and sdpa_core, on this thread or the device's
