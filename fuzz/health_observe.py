"""Fuzz POST /v1/health/observe's body: bytes -> the checked observations
(service.wire.observe.parse_observe, after the JSON parser the route uses) -> recorded into a
health monitor's series (HealthMonitor.observe_reported). Every input must be recorded or
refused with a client error (fuzz.support): a value out of range, not finite, of the wrong
shape or size is a 422 naming its field, never a 500, and nothing refused reaches a series.

An input is a body. Half the mutations are libFuzzer's bytes, half change one value of the
JSON (fuzz.mutate) with the route's own words; now and then the per-head arrays are written
anew (nested lists or packed float32/float64 of random bytes: NaN, Inf and huge values).

    .venv/bin/python -m fuzz.health_observe [libFuzzer flags] [corpus dirs]   # fuzz/run.py runs it
"""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Iterator
from typing import Any, Final

from fuzz.mutate import mutate_json
from fuzz.support import Check, Finding, answer, fuzz_main, fuzz_mutate

NAME: Final = "health_observe"
MAX_LEN: Final = 4096
FIELDS: Final = ("entropy", "normalized_entropy", "max_weight", "sink_share",
                 "score_abs_max_scaled", "saturated_fraction", "masked_rows")  # fmt: skip
WORDS: Final = (
    "observations", "tag", "visible_keys_max", "n_q", "per_head", *FIELDS, "dtype", "shape",
    "b64", "float32", "float64", "float16", "AAAA", "AACAPw==", "m/layer0", "other",
)  # fmt: skip


def load() -> Check:
    """The check of one input: parsed as the route parses it, then recorded as it records."""
    from service.api.observe import _parse
    from service.metrics import Metrics
    from service.serving.health import HealthMonitor

    def diagnose(prepared: Any) -> Any:
        raise AssertionError("observations are never computed")

    monitor = HealthMonitor(
        metrics=Metrics(), diagnose=diagnose, sample_rate=0.0, max_tags=8, max_heads=64
    )

    def record(data: bytes) -> list[str]:
        parsed = _parse(data)
        return [monitor.observe_reported(obs, tenant="fuzz") for obs in parsed.observations]

    def check(data: bytes) -> None:
        got = answer(lambda: record(data))
        if got[0] == "ok" and not (isinstance(got[1], tuple) and got[1]):
            raise Finding(f"an accepted body recorded {got[1]!r}")

    return check


def _array(rows: int, heads: int, rng: random.Random) -> Any:
    pick = rng.randrange(3)
    if pick == 0:
        return [[round(rng.uniform(-0.2, 1.2), 3) for _ in range(heads)] for _ in range(rows)]
    dtype = rng.choice(("float32", "float64"))
    size = rows * heads * (4 if dtype == "float32" else 8)
    raw = rng.randbytes(size) if pick == 1 else bytes(size)
    return {"dtype": dtype, "shape": [rows, heads], "b64": base64.b64encode(raw).decode()}


def regenerate(data: bytes, rng: random.Random) -> bytes:
    """The first observation's per-head arrays written anew (shapes that mostly agree)."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        body = {}
    if not isinstance(body, dict):
        body = {}
    rows, heads = rng.randrange(1, 4), rng.randrange(1, 6)
    per_head = {}
    for name in FIELDS:
        if rng.random() < 0.9:
            off = rng.random() < 0.1
            per_head[name] = _array(rows + off, heads, rng)
    obs = {"tag": "m/layer0", "visible_keys_max": rng.randrange(0, 20), "per_head": per_head}
    if rng.random() < 0.5:
        obs["n_q"] = rng.randrange(0, 20)
    body["observations"] = [obs]
    return json.dumps(body).encode()


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    pick = rng.random()
    if pick < 0.15:
        body = regenerate(data, rng)
        if len(body) <= max_size:
            return body
    if pick < 0.55:
        out = mutate_json(data, rng, WORDS)
        if out is not None and len(out) <= max_size:
            return out
    return fuzz_mutate(data, max_size)


def seeds() -> Iterator[tuple[str, bytes]]:
    """(name, body) of reports a tap sends, and the edges of each rule."""

    def obs(**extra: Any) -> dict[str, Any]:
        per_head = {name: [[0.5, 0.25]] for name in FIELDS[:-1]}
        per_head["entropy"] = [[1.0, 0.5]]
        per_head["masked_rows"] = [[0, 1]]
        per_head.update(extra.pop("per_head", {}))
        return {"tag": "m/layer0", "visible_keys_max": 8, "n_q": 4, "per_head": per_head, **extra}

    def body(*observations: Any) -> bytes:
        return json.dumps({"observations": list(observations)}).encode()

    yield "lists", body(obs())
    yield "two-layers", body(obs(), obs(tag="m/layer1"))
    yield "required-only", body(obs(per_head={}) | {"n_q": None})

    def zeros(dtype: str) -> dict[str, Any]:
        size = 8 if dtype == "float32" else 16
        return {"dtype": dtype, "shape": [1, 2], "b64": base64.b64encode(bytes(size)).decode()}

    yield "packed-zeros", body(obs(per_head={name: zeros("float32") for name in FIELDS}))
    yield "packed-float64", body(obs(per_head={"max_weight": zeros("float64")}))
    yield "entropy-at-bound", body(obs(per_head={"entropy": [[2.0794415416798357, 0.0]]}))
    yield "normalized-above", body(obs(per_head={"normalized_entropy": [[1.5, 0.5]]}))
    yield "masked-rows-fraction", body(obs(per_head={"masked_rows": [[0.5, 0]]}))
    yield "masked-rows-no-n-q", body(obs(n_q=None))
    yield "shape-mismatch", body(obs(per_head={"sink_share": [[0.5]]}))
    yield "ragged", body(obs(per_head={"sink_share": [[0.5, 0.5], [0.5]]}))
    yield "huge-number", b'{"observations": [{"tag": "t", "visible_keys_max": 2, "per_head": ' \
        b'{"entropy": [[1e999]], "normalized_entropy": [[0.5]], "max_weight": [[0.5]], ' \
        b'"sink_share": [[0.5]], "score_abs_max_scaled": [[1]]}}]}'  # fmt: skip
    yield "huge-integer", body(obs(per_head={"score_abs_max_scaled": [[10**400, 1]]}))
    yield "unknown-field", body(obs(per_head={"entropyy": [[0.1, 0.1]]}))
    yield "bad-tag", body(obs(tag="a b"))
    yield "empty", body()


if __name__ == "__main__":
    fuzz_main(load, mutator=mutate)
