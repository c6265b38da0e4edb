"""A small Dockerfile reader for the tests: instructions, stages, exec-form CMD and HEALTHCHECK.

It reads the Dockerfile AS WRITTEN (line continuations joined, comments dropped) so that the
tests run exactly the commands the image would run.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "Dockerfile"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, COPY, ...
    args: str  # the rest of the logical line
    line: int  # 1-based line where it starts


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None

    def env(self) -> dict[str, str]:
        """ENV key=value pairs of this stage (later ones win), with quotes removed."""
        values: dict[str, str] = {}
        for inst in self.all("ENV"):
            for token in shlex.split(inst.args):
                key, sep, value = token.partition("=")
                assert sep, f"ENV on line {inst.line}: use the key=value form"
                values[key] = value
        return values


def instructions(text: str) -> list[Instruction]:
    """Logical instructions: continuation lines joined, comments and blank lines dropped."""
    result: list[Instruction] = []
    buffer: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not buffer and (not stripped or stripped.startswith("#")):
            continue
        if buffer and stripped.startswith("#"):
            continue  # comment lines inside a continued instruction are skipped by Docker
        if not buffer:
            start = number
        if stripped.endswith("\\"):
            buffer.append(stripped[:-1].strip())
            continue
        buffer.append(stripped)
        logical = " ".join(part for part in buffer if part)
        buffer = []
        keyword, _, args = logical.partition(" ")
        result.append(Instruction(keyword.upper(), args.strip(), start))
    assert not buffer, "the Dockerfile ends inside a line continuation"
    return result


def stages(text: str) -> list[Stage]:
    found: list[Stage] = []
    for inst in instructions(text):
        if inst.keyword == "FROM":
            parts = inst.args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            found.append(Stage(base=parts[0], name=name))
        elif found:
            found[-1].instructions.append(inst)
    return found


def exec_form(args: str) -> list[str]:
    """Parse an exec-form argument list (a JSON array of strings); fail on shell form."""
    value = json.loads(args)
    assert isinstance(value, list), f"not exec form: {args!r}"
    assert all(isinstance(item, str) for item in value), f"not a list of strings: {args!r}"
    return value


def cmd(stage: Stage) -> list[str]:
    inst = stage.last("CMD")
    assert inst is not None, "the final stage has no CMD"
    return exec_form(inst.args)


def healthcheck(stage: Stage) -> tuple[dict[str, str], list[str]]:
    """(options, command) of the stage's HEALTHCHECK ... CMD [...]."""
    inst = stage.last("HEALTHCHECK")
    assert inst is not None, "the final stage has no HEALTHCHECK"
    options: dict[str, str] = {}
    rest = inst.args
    while rest.startswith("--"):
        option, _, rest = rest.partition(" ")
        key, _, value = option[2:].partition("=")
        options[key] = value
        rest = rest.strip()
    keyword, _, command = rest.partition(" ")
    assert keyword.upper() == "CMD", f"HEALTHCHECK must use CMD, got {keyword!r}"
    return options, exec_form(command.strip())


def final_stage() -> Stage:
    return stages(DOCKERFILE.read_text(encoding="utf-8"))[-1]


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore `patterns` exclude `path` (relative, '/'-separated) from the context.

    Docker's rule: the last matching pattern wins; '!' re-includes. A pattern also matches every
    path below a matched directory.
    """
    excluded = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        body = pattern[1:] if negate else pattern
        body = body.strip("/")
        if body.startswith("**/"):
            # Any run of path segments, at any depth (and everything below it).
            n = len(parts)
            runs = ("/".join(parts[i : j + 1]) for i in range(n) for j in range(i, n))
            matched = any(fnmatch.fnmatchcase(run, body[3:]) for run in runs)
        else:
            matched = any(fnmatch.fnmatchcase(p, body) for p in prefixes)
        if matched:
            excluded = not negate
    return excluded


def dockerignore_patterns() -> list[str]:
    lines = DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


MAKEFILE = REPO_ROOT / "Makefile"
PYPROJECT = REPO_ROOT / "pyproject.toml"


def default_image() -> tuple[str, str]:
    """(repository, tag) of the image `make image` builds by default (the Makefile's IMAGE)."""
    match = re.search(r"^IMAGE \?= (\S+)$", MAKEFILE.read_text(encoding="utf-8"), re.MULTILINE)
    assert match is not None, "the Makefile has no `IMAGE ?= ...` default"
    repository, _, tag = match.group(1).rpartition(":")
    assert repository, match.group(1)
    assert tag, match.group(1)
    return repository, tag


def package_version() -> str:
    """The version in pyproject.toml: the one source of the image's release tag."""
    with PYPROJECT.open("rb") as handle:
        version = tomllib.load(handle)["project"]["version"]
    assert isinstance(version, str)
    return version


def exposed_ports(stage: Stage) -> tuple[int, int]:
    """The two ports the stage EXPOSEs: HTTP, then gRPC (the Open Inference Protocol)."""
    inst = stage.last("EXPOSE")
    assert inst is not None, "the final stage has no EXPOSE"
    ports = inst.args.split()
    assert len(ports) == 2, ports
    http, grpc = (int(port.split("/")[0]) for port in ports)
    return http, grpc
