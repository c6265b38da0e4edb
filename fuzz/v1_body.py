"""Fuzz the v1 body decoder: POST /v1/attention's and /v1/analyze's body bytes -> a prepared
job (service.serving.prepare), parsed whole as the event loop parses a small body, and in
pieces (service.wire.json_arrays, with pieces of a few bytes) as a worker thread parses a big
one: both must answer with a job or a client error (fuzz.support), and with the same one.

An input is a body. Half the mutations are libFuzzer's bytes, half change one value of the
JSON (fuzz.mutate) with the API's own words.

    .venv/bin/python -m fuzz.v1_body [libFuzzer flags] [corpus dirs]    # fuzz/run.py runs it
"""

from __future__ import annotations

import base64
import json
import random
from collections.abc import Iterator
from typing import Any, Final

from fuzz.mutate import attention_shapes, mutate_json
from fuzz.support import (
    Check,
    answer,
    cost_model,
    fuzz_main,
    fuzz_mutate,
    pieces_for,
    same_answers,
    settings,
)

NAME: Final = "v1_body"
MAX_LEN: Final = 4096
# The API's words: field names and the values its literals take.
WORDS: Final = (
    "q", "k", "v", "dtype", "shape", "data", "b64", "causal", "key_lengths", "key_padding_mask",
    "attn_mask", "timeout_ms", "priority", "scale", "temperature", "return_weights",
    "diagnostics", "return_output", "response_encoding", "tag", "synthetic", "n_q", "n_k",
    "d_k", "heads", "std", "seed", "strategies", "name", "divisor", "float16", "bfloat16",
    "float32", "float64", "bool", "top_left", "bottom_right", "none", "summary", "full", "json",
    "base64", "sqrt_dk", "dk", "dk_quarter", "two_sqrt_dk", "AAAA", "AACAPw==", "AQA=", "AAE=",
)  # fmt: skip


def load() -> Check:
    """The check of one input: both endpoints' decoders, whole and in pieces (/v1/analyze's in
    pieces only where its own fields appear: elsewhere its lists stand where /v1/attention's
    do, and parsing in pieces costs ten times what parsing whole does)."""
    from service.serving.prepare import prepare_analyze, prepare_attention

    config, cost = settings(), cost_model()

    def check(data: bytes) -> None:
        pieces = pieces_for(data)
        whole = answer(lambda: prepare_attention(data, config, cost))
        cut = answer(lambda: prepare_attention(data, config, cost, pieces=pieces))
        same_answers(whole, cut, what="/v1/attention")
        whole = answer(lambda: prepare_analyze(data, config, cost))
        if b"synthetic" in data or b"strategies" in data:
            cut = answer(lambda: prepare_analyze(data, config, cost, pieces=pieces))
            same_answers(whole, cut, what="/v1/analyze")

    return check


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


_ITEMSIZE: Final = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "bool": 1}


def _tensor(shape: list[int], dtype: str, rng: random.Random) -> Any:
    """A tensor of `shape` as a client writes it: a bare nested list, an object with data, or
    an object with b64 (random bytes: any bit pattern, NaN and Inf included)."""
    count = 1
    for dim in shape:
        count *= dim
    pick = rng.randrange(3)
    if pick == 2:
        size = count * _ITEMSIZE[dtype]
        raw = (
            bytes(rng.randrange(2) for _ in range(size)) if dtype == "bool" else rng.randbytes(size)
        )
        return {"dtype": dtype, "shape": shape, "b64": base64.b64encode(raw).decode()}

    def nested(dims: list[int]) -> Any:
        if not dims:
            return rng.random() < 0.5 if dtype == "bool" else round(rng.uniform(-3, 3), 2)
        return [nested(dims[1:]) for _ in range(dims[0])]

    data = nested(shape)
    if pick == 0 and dtype in ("bool", "float32"):
        return data
    return (
        {"dtype": dtype, "shape": shape, "data": data}
        if rng.random() < 0.7
        else {
            "dtype": dtype,
            "data": data,
        }
    )


def regenerate(data: bytes, rng: random.Random) -> bytes:
    """The body's tensors written anew, of shapes that (mostly) fit together: q [..., H, N_q,
    D], k and v [..., H_kv, N_kv, D(_v)], masks of shapes that broadcast, key_lengths per
    sequence or one for all, now and then a dimension off by one (fuzz.mutate.attention_shapes).
    The request's other fields stay: this reaches sdpa_core's shape and mask checks, and the
    limits, with valid data."""
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):
        body = {}
    if not isinstance(body, dict):
        body = {}
    shapes = attention_shapes(rng)
    if "key_lengths" in shapes:
        count = shapes.pop("key_lengths")
        n_kv = shapes["k"][-2]
        lengths = [rng.randrange(n_kv + 2) for _ in range(count[0] if count else 1)]
        body["key_lengths"] = lengths if count else lengths[0]
    dtype = rng.choice(("float16", "bfloat16", "float32", "float64"))
    for name, shape in shapes.items():
        mask_dtype = "bool" if name == "key_padding_mask" or rng.random() < 0.5 else dtype
        body[name] = _tensor(shape, dtype if name in ("q", "k", "v") else mask_dtype, rng)
    if rng.random() < 0.2:  # as /v1/analyze takes them
        body.pop("v", None)
    return json.dumps(body).encode()


# ---- seeds -------------------------------------------------------------------------------


def _b64(values: Any, dtype: str) -> dict[str, Any]:
    import numpy as np

    arr = np.asarray(values, dtype=np.float32)
    if dtype == "bfloat16":
        raw = (arr.view(np.uint32) >> 16).astype("<u2").tobytes()
    elif dtype == "bool":
        raw = np.asarray(values, dtype=np.bool_).astype("u1").tobytes()
    else:
        raw = arr.astype({"float16": "<f2", "float32": "<f4", "float64": "<f8"}[dtype]).tobytes()
    return {"dtype": dtype, "shape": list(arr.shape), "b64": base64.b64encode(raw).decode()}


def seeds() -> Iterator[tuple[str, bytes]]:
    """(name, body) of requests a client sends: every dtype and encoding, every mask option,
    the options of both endpoints."""
    rng = random.Random(1)

    def grid(*shape: int) -> Any:
        if len(shape) == 1:
            return [round(rng.uniform(-2, 2), 3) for _ in range(shape[0])]
        return [grid(*shape[1:]) for _ in range(shape[0])]

    q, k, v = grid(1, 2, 3, 4), grid(1, 2, 5, 4), grid(1, 2, 5, 4)

    def body(**fields: Any) -> bytes:
        return json.dumps(fields).encode()

    yield "attention-lists", body(q=q, k=k, v=v)
    yield "attention-2d", body(q=grid(3, 2), k=grid(4, 2), v=grid(4, 3), diagnostics="none")
    yield "attention-gqa", body(q=grid(1, 4, 2, 2), k=grid(1, 2, 3, 2), v=grid(1, 2, 3, 2))
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        yield (
            f"attention-b64-{dtype}",
            body(q=_b64(q, dtype), k=_b64(k, dtype), v=_b64(v, dtype), response_encoding="json"),
        )
        yield (
            f"attention-object-{dtype}",
            body(
                q={"dtype": dtype, "shape": [1, 2, 3, 4], "data": q},
                k={"dtype": dtype, "data": k},
                v={"dtype": dtype, "shape": [1, 2, 5, 4], "data": v},
            ),
        )
    for causal in (True, "top_left", "bottom_right"):
        yield f"attention-causal-{causal}", body(q=q, k=k, v=v, causal=causal)
    yield "attention-key-lengths", body(q=q, k=k, v=v, key_lengths=[3])
    yield "attention-key-lengths-int", body(q=q, k=k, v=v, key_lengths=4)
    yield "attention-key-lengths-heads", body(q=q, k=k, v=v, key_lengths=[[2, 5]])
    padding = [[False, False, True, False, True]]
    yield "attention-key-padding", body(q=q, k=k, v=v, key_padding_mask=padding)
    yield "attention-key-padding-b64", body(q=q, k=k, v=v, key_padding_mask=_b64(padding, "bool"))
    visible = [[rng.random() < 0.7 for _ in range(5)] for _ in range(3)]
    yield "attention-mask-bool", body(q=q, k=k, v=v, attn_mask=visible)
    bias = [[None if rng.random() < 0.3 else round(rng.uniform(-1, 1), 2) for _ in range(5)]
            for _ in range(3)]  # fmt: skip
    yield "attention-mask-float", body(q=q, k=k, v=v, attn_mask={"dtype": "float32", "data": bias})
    yield "attention-options", body(
        q=q, k=k, v=v, scale=0.25, return_weights=True, diagnostics="full", return_output=False,
        response_encoding="base64", tag="fuzz.seed", priority=1, timeout_ms=1000,
    )  # fmt: skip
    yield "attention-temperature", body(q=q, k=k, v=v, temperature=0.5, diagnostics="summary")
    yield "attention-empty", body(q=[], k=[], v=[])
    yield "attention-nested-deep", body(q=[[[[[[[[1.0]]]]]]]], k=[[[[[[[[1.0]]]]]]]], v=[[1.0]])
    yield "attention-numbers", b'{"q": [[1e308, -0.0, 5e-324]], "k": [[1, 2, 3]], "v": [[0]]}'
    yield "analyze-qk", body(q=q, k=k, strategies=["none", "sqrt_dk", "dk"])
    yield "analyze-synthetic", body(
        synthetic={"n_q": 4, "n_k": 6, "d_k": 8, "heads": 2, "std": 2.0, "seed": 3,
                   "dtype": "float16"},
        strategies=["dk_quarter", "two_sqrt_dk", {"name": "mine", "divisor": 3.5}],
        causal="bottom_right",
    )  # fmt: skip
    yield "analyze-masks", body(q=q, k=k, key_padding_mask=padding, attn_mask=visible)
    yield "not-json", b'{"q": [1, 2,'
    yield "surrogate", b'{"q": "\\ud800", "tag": "\\udfff"}'
    # The refusals a fuzzer rarely writes on its own: start the corpus from them.
    yield "unknown-fields", body(q=q, k=k, v=v, **{f"extra{i}": i for i in range(10)})
    yield "scale-and-temperature", body(q=q, k=k, v=v, scale=0.5, temperature=2.0)
    yield "temperature-tiny", body(q=q, k=k, v=v, temperature=1e-310)
    yield (
        "synthetic-overflow",
        body(synthetic={"n_q": 2, "n_k": 2, "d_k": 2, "std": 1e6, "dtype": "float16"}),
    )
    deep = b"[" * 130 + b"1.5, 2.5, 3.5, 4.5, 5.5, 6.5" + b"]" * 130
    yield "nested-130", b'{"q": ' + deep + b', "k": [[1.0]], "v": [[1.0]]}'
    huge = b"1" + b"0" * 400
    yield (
        "mask-huge-integer",
        (
            b'{"q": [[1.0, 2.0]], "k": [[1.0, 2.0], [3.0, 4.0]], "v": [[1.0], [2.0]], '
            b'"attn_mask": {"dtype": "float32", "data": [[null, ' + huge + b"]]}}"
        ),
    )
    yield (
        "key-lengths-huge-integer",
        (b'{"q": [[1.0, 2.0]], "k": [[1.0, 2.0]], "v": [[1.0]], "key_lengths": [' + huge + b"]}"),
    )
    yield (
        "quotes-beside-arrays",
        (
            b'{"tag": "a\\"[1, 2, 3, 4, 5]\\\\", "q": [[1.0, 2.0, 3.0, 4.0, 5.0]], '
            b'"k": [[1.0, 2.0, 3.0, 4.0, 5.0]], "v": [[1.0, 2.0, 3.0, 4.0, 5.0]]}'
        ),
    )
    for i, bad in enumerate((b"[1, 2 3]", b"[1, 2,, 3]", b"[1, tru, 3]", b"[1.5e, 2]", b"[1]]")):
        yield (
            f"not-json-in-a-list-{i}",
            (b'{"q": [[1, 2, 3, 4, 5, 6, 7, 8, 9],\n' + bad + b'], "k": [[1]], "v": [[1]]}'),
        )


def main() -> None:
    fuzz_main(load, mutator=mutate)


if __name__ == "__main__":
    main()
