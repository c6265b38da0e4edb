"""Write the harnesses' seed corpora (fuzz/corpus/<harness>/seed-<name>), from the requests
each harness's seeds() builds: real clients' bytes where a client exists (tritonclient's
binary requests for v2, its protobuf messages for gRPC).

    .venv/bin/python -m fuzz.seeds [harness ...]

The seeds are committed; so are the inputs a fuzzing run found that reach new code, once
merged (fuzz/run.py --merge). Rerun this after changing a seeds() function.
"""

from __future__ import annotations

import argparse
import importlib
import re

from fuzz.support import CORPUS

HARNESSES = ("v1_body", "v2_framing", "grpc_infer", "health_observe")


def write_seeds(harness: str) -> int:
    module = importlib.import_module(f"fuzz.{harness}")
    folder = CORPUS / harness
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("seed-*"):
        old.unlink()
    count = 0
    for name, data in module.seeds():
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        (folder / f"seed-{safe}").write_bytes(data)
        count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("harness", nargs="*", default=list(HARNESSES), choices=HARNESSES)
    for harness in parser.parse_args().harness:
        print(f"{harness}: {write_seeds(harness)} seeds")


if __name__ == "__main__":
    main()
