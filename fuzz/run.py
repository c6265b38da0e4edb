"""Run the fuzzing harnesses for a bounded time each: `make fuzz` (CI: .ci/run).

    .venv/bin/python -m fuzz.run [--seconds 30] [harness ...]
    .venv/bin/python -m fuzz.run --merge --seconds 600 v2_framing   # grow the committed corpus

Each harness runs in its own process under libFuzzer: from its committed corpus
(fuzz/corpus/<harness>, read only) and a fresh working corpus (the new inputs it finds), with
-max_total_time, -timeout per input (a hang is a finding), -rss_limit_mb (so is a blow-up of
memory) and -max_len. Printed: each harness's executions (libFuzzer's "#N DONE" and
stat::number_of_executed_units), executions per second, coverage and new inputs. Exit status 1
when any harness found something: its input is kept (libFuzzer's crash-/timeout-/oom- file) and
printed in base64, with the command that replays it.

--merge: after the run, the committed corpus is minimized with libFuzzer's -set_cover_merge=1
(edges only: -use_counters=0) over itself and what the run found: the seeds (seed-*) and the
inputs of fixed findings (finding-*) stay, and the other inputs are those that add coverage to
them. A harness whose target does not exist yet is reported as skipped.
"""

from __future__ import annotations

import argparse
import base64
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from fuzz.support import CORPUS

HARNESSES: Final = ("v1_body", "v2_framing", "grpc_infer", "health_observe")
# The module each harness's target lives in: a harness whose module is missing is skipped.
TARGETS: Final = {
    "v1_body": "service.serving.prepare",
    "v2_framing": "service.serving.prepare_v2",
    "grpc_infer": "service.serving.prepare_grpc",
    "health_observe": "service.wire.observe",
}
REPO: Final = CORPUS.parent.parent
_STAT: Final = re.compile(r"^stat::(\w+):\s+(\d+)", re.MULTILINE)
_DONE: Final = re.compile(r"^#(\d+)\s+DONE\s+(.*)$", re.MULTILINE)
_ARTIFACT: Final = re.compile(r"Test unit written to (\S+)")
_PROGRESS: Final = re.compile(r"^#\d+\s+(NEW|REDUCE|pulse|INITED)\b")


@dataclass
class Outcome:
    harness: str
    status: str  # "ok", "FINDING", "skipped"
    executions: int = 0
    per_second: int = 0
    new_units: int = 0
    peak_rss_mb: int = 0
    done: str = ""
    seconds: float = 0.0


def _dictionary(words: tuple[str, ...], folder: Path) -> Path:
    """The harness's words as a libFuzzer dictionary (-dict)."""
    path = folder / "words.dict"
    lines = []
    for word in filter(None, words):  # libFuzzer takes no empty entry
        escaped = "".join(
            f"\\x{b:02x}" if b < 0x20 or b >= 0x7F or b in b'"\\' else chr(b) for b in word.encode()
        )
        lines.append(f'"{escaped}"')
    path.write_text("\n".join(lines) + "\n")
    return path


def run_harness(
    harness: str, *, seconds: int, timeout: int, rss_limit_mb: int, work: Path, merge: bool
) -> Outcome:
    if importlib.util.find_spec(TARGETS[harness]) is None:
        print(f"== {harness}: skipped: {TARGETS[harness]} does not exist yet", flush=True)
        return Outcome(harness, "skipped")
    module = importlib.import_module(f"fuzz.{harness}")
    corpus = CORPUS / harness
    found = work / harness / "found"
    artifacts = work / harness / "artifacts"
    for folder in (found, artifacts):
        folder.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", f"fuzz.{harness}",
        f"-max_total_time={seconds}", f"-timeout={timeout}", f"-rss_limit_mb={rss_limit_mb}",
        f"-max_len={module.MAX_LEN}", f"-dict={_dictionary(module.WORDS, work / harness)}",
        f"-artifact_prefix={artifacts}/", "-print_final_stats=1", "-print_pcs=0",
        str(found), str(corpus),
    ]  # fmt: skip
    print(f"== {harness}: {seconds} s from {len(list(corpus.iterdir()))} inputs", flush=True)
    env = dict(os.environ, PYTHONWARNINGS="ignore::RuntimeWarning")
    started = time.monotonic()
    # A hang of the whole process (not one input: -timeout) is a finding too.
    try:
        proc = subprocess.run(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors="replace", timeout=seconds + 300,
        )  # fmt: skip
        log, code = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as exc:
        # What it wrote before it was killed (bytes here, whatever `text` says).
        out = exc.stdout
        written = out.decode(errors="replace") if isinstance(out, bytes) else out or ""
        log = written + f"\nthe fuzzer ran {seconds + 300} s: killed"
        code = -1
    elapsed = time.monotonic() - started
    (work / harness / "fuzz.log").write_text(log)
    stats = {name: int(value) for name, value in _STAT.findall(log)}
    done = _DONE.search(log)
    outcome = Outcome(
        harness,
        "ok" if code == 0 and done else "FINDING",
        executions=stats.get("number_of_executed_units", int(done.group(1)) if done else 0),
        per_second=stats.get("average_exec_per_sec", 0),
        new_units=stats.get("new_units_added", 0),
        peak_rss_mb=stats.get("peak_rss_mb", 0),
        done=done.group(0).strip() if done else "",
        seconds=elapsed,
    )
    if outcome.status == "ok":
        print(f"   {outcome.done}", flush=True)
        if merge:
            _merge(harness, corpus, found, work / harness)
        return outcome
    print(f"   FINDING (exit status {code}); what libFuzzer said of it:", flush=True)
    print(_finding_report(log), flush=True)
    for path in _ARTIFACT.findall(log):
        artifact = Path(path)
        if artifact.is_file():
            data = artifact.read_bytes()
            print(f"   input ({len(data)} bytes) kept in {artifact}; base64:", flush=True)
            print(f"   {base64.b64encode(data).decode()}", flush=True)
            print(f"   replay: .venv/bin/python -m fuzz.{harness} {artifact}", flush=True)
    return outcome


def _finding_report(log: str) -> str:
    """The part of a log that tells a finding: from the uncaught exception (or libFuzzer's
    ERROR line) to the end, without the progress lines; else its last lines."""
    lines = [
        line
        for line in log.splitlines()
        if not line.startswith("INFO: Instrumenting") and not _PROGRESS.match(line)
    ]
    for marker in ("=== Uncaught Python exception", "==ERROR", "ALARM:", "ERROR: libFuzzer"):
        starts = [i for i, line in enumerate(lines) if marker in line]
        if starts:
            return "\n".join(lines[starts[0] :][:120])
    return "\n".join(lines[-60:])


def _merge(harness: str, corpus: Path, found: Path, work: Path) -> None:
    """Minimize the committed corpus over what the run found: the seeds and findings stay, the
    other inputs are those that add coverage (edges) to them."""
    merged = work / "merged"
    shutil.rmtree(merged, ignore_errors=True)
    merged.mkdir()
    kept = [*corpus.glob("seed-*"), *corpus.glob("finding-*")]  # always kept, by name
    for path in kept:
        shutil.copy(path, merged / path.name)
    # Edges only (no hit counts): the fewest inputs that reach every line reached, a corpus of
    # tens of KB rather than hundreds; set cover rather than libFuzzer's greedy -merge=1.
    command = [sys.executable, "-m", f"fuzz.{harness}", "-set_cover_merge=1", "-use_counters=0",
               str(merged), str(corpus), str(found)]  # fmt: skip
    env = dict(os.environ, PYTHONWARNINGS="ignore::RuntimeWarning")
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or "MERGE-OUTER: the control file" not in proc.stderr:
        print(proc.stdout + proc.stderr)
        raise SystemExit(f"{harness}: the merge failed")
    names = {path.name for path in kept}
    for old in corpus.iterdir():
        if old.name not in names:
            old.unlink()
    added = 0
    for unit in merged.iterdir():
        if unit.name not in names:
            shutil.copy(unit, corpus / unit.name)
            added += 1
    size = sum(p.stat().st_size for p in corpus.iterdir())
    print(f"   merged: {corpus} holds {added} inputs beside its seeds, {size:,} bytes", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("harness", nargs="*", choices=[*HARNESSES, []], help="default: all")
    parser.add_argument(
        "--seconds",
        type=int,
        default=int(os.environ.get("FUZZ_SECONDS", 30)),
        help="-max_total_time of each harness (default: $FUZZ_SECONDS or 30)",
    )
    parser.add_argument("--timeout", type=int, default=10, help="-timeout: seconds per input")
    parser.add_argument("--rss-limit-mb", type=int, default=3072, help="-rss_limit_mb")
    parser.add_argument("--merge", action="store_true", help="minimize the corpus after the run")
    parser.add_argument("--work", type=Path, default=None,
                        help="where the run's inputs, findings and logs go (default: a temporary "
                        "folder, kept when something was found)")  # fmt: skip
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="sdpa-fuzz-"))
    outcomes = [
        run_harness(
            harness,
            seconds=args.seconds,
            timeout=args.timeout,
            rss_limit_mb=args.rss_limit_mb,
            work=work,
            merge=args.merge,
        )
        for harness in args.harness or HARNESSES
    ]
    print("\nharness       status     executions   exec/s   new inputs   peak RSS   seconds")
    for o in outcomes:
        print(
            f"{o.harness:<13} {o.status:<9} {o.executions:>11,} {o.per_second:>8,} "
            f"{o.new_units:>12,} {o.peak_rss_mb:>7} MB {o.seconds:>9.0f}"
        )
    failed = [o.harness for o in outcomes if o.status == "FINDING"]
    if failed:
        print(f"\nfindings in {', '.join(failed)}: their inputs and logs are in {work}")
        return 1
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
