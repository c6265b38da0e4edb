"""Structure-aware mutations of JSON text, for the harnesses' custom mutators.

libFuzzer's byte mutations find the parser's corners (a quote too many, a truncated number) but
rarely turn one valid request into another: most of their children are not JSON, or JSON that
validation refuses at its first field. Here the text is parsed (the json module, NaN and
Infinity allowed), one value somewhere in it changed in a way a client might (a number made 0,
negative, huge or fractional; a string made one of the API's own words; a key dropped or added;
a list's item dropped or repeated; a value's type changed) and written back, so that the
fuzzer reaches the checks after validation: shapes against data, limits, masks, dtypes.
Stdlib only: the mutator runs between inputs, uninstrumented.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any, Final

# Numbers a client might write where a number stands: edges of every integer type, of floats,
# and of the service's limits (fuzz.support.MAX_ELEMENTS).
NUMBERS: Final[tuple[Any, ...]] = (
    0, 1, -1, 2, 3, 7, 8, 64, 255, 256, 4095, 4096, 4097, 65535, 2**31 - 1, 2**31, 2**32,
    2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 0.5, -0.0, 1e-300, 5e-324, 1e308,
    -1e308, 1.5, float("inf"), float("-inf"), float("nan"),
)  # fmt: skip
# Strings: odd ones (a lone surrogate, a NUL, a long one), beside each harness's own words.
STRINGS: Final[tuple[str, ...]] = (
    "", " ", "\ud800", "\x00", "x" * 300, "é", "0", "1", "-1", "true", "null", "NaN",
)  # fmt: skip


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a parsed JSON value (the root included), as key paths."""
    out = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            out.extend(_paths(item, (*path, key)))
    elif isinstance(value, list):
        for i, item in enumerate(value[:64]):  # the first items stand for the rest
            out.extend(_paths(item, (*path, i)))
    return out


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


def _new_value(rng: random.Random, words: Sequence[str], old: Any) -> Any:
    pick = rng.randrange(10)
    if pick < 3:
        return rng.choice(NUMBERS)
    if pick < 6:
        return rng.choice(words) if words and rng.random() < 0.8 else rng.choice(STRINGS)
    if pick == 6:
        return rng.choice((True, False, None))
    if pick == 7:
        return [old] if rng.random() < 0.5 else []
    if pick == 8:
        return {rng.choice(words): old} if words else {}
    return rng.choice(NUMBERS) * rng.choice((1, -1))


def _nudge(rng: random.Random, number: int | float) -> Any:
    if isinstance(number, bool):
        return not number
    pick = rng.randrange(6)
    if pick == 0:
        return number + rng.choice((1, -1))
    if pick == 1:
        return number * 2
    if pick == 2:
        return -number
    if pick == 3:
        return number // 2 if isinstance(number, int) else number / 2
    if pick == 4:
        try:
            return float(number) if isinstance(number, int) else int(number)
        except (OverflowError, ValueError):  # an int past float's range, a float not finite
            return rng.choice(NUMBERS)
    return rng.choice(NUMBERS)


def mutate_value(value: Any, rng: random.Random, words: Sequence[str]) -> Any:
    """`value` (a parsed JSON value) with one change somewhere in it: returns the new value
    (the root itself may be replaced)."""
    path = rng.choice(_paths(value))
    node = _get(value, path)
    pick = rng.randrange(8)
    new: Any
    if isinstance(node, dict) and node and pick < 3:
        key = rng.choice(list(node))
        if pick == 0:
            del node[key]
        elif pick == 1:
            node[rng.choice(words) if words else key] = _new_value(rng, words, node[key])
        else:  # the key renamed
            node[rng.choice(words) if words else key + "_"] = node.pop(key)
        return value
    if isinstance(node, list) and node and pick < 4:
        i = rng.randrange(len(node))
        if pick == 0:
            del node[i]
        elif pick == 1:
            node.insert(i, json.loads(json.dumps(node[i])))  # a copy of an item
        elif pick == 2:
            node.append(_new_value(rng, words, node[i]))
        else:
            node[i] = _new_value(rng, words, node[i])
        return value
    if isinstance(node, bool | int | float) and pick < 5:
        new = _nudge(rng, node)
    elif isinstance(node, str) and pick < 5 and words:
        new = rng.choice(words)
    else:
        new = _new_value(rng, words, node)
    if not path:
        return new
    _get(value, path[:-1])[path[-1]] = new
    return value


def mutate_json(text: bytes, rng: random.Random, words: Sequence[str]) -> bytes | None:
    """The JSON `text` with one change (mutate_value), written back compactly or not; None
    when `text` is not JSON the json module reads."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    for _ in range(1 + rng.randrange(3)):
        value = mutate_value(value, rng, words)
    indent = None if rng.random() < 0.8 else rng.choice((0, 1))
    try:
        return json.dumps(value, indent=indent).encode()
    except (ValueError, RecursionError):  # pragma: no cover - nothing here nests so deep
        return None


def attention_shapes(rng: random.Random) -> dict[str, list[int]]:
    """Shapes of an attention request's tensors that (mostly) fit together: q [..., H, N_q, D],
    k and v [..., H_kv, N_kv, D(_v)] (H a multiple of H_kv), now and then a key_padding_mask,
    an attn_mask of a shape that broadcasts, key_lengths (its shape: [] one for all, [B] one
    per sequence), and one dimension in five off by one (so 0 at times)."""
    batch = [rng.choice((1, 2, 3))] * rng.randrange(3)
    h_kv = rng.choice((1, 2))
    h = h_kv * rng.choice((1, 2))
    n_q, n_kv, d, d_v = (rng.choice((1, 2, 3, 5, 8)) for _ in range(4))
    shapes: dict[str, list[int]] = {
        "q": [*batch, h, n_q, d],
        "k": [*batch, h_kv, n_kv, d],
        "v": [*batch, h_kv, n_kv, d_v],
    }
    if rng.random() < 0.3:
        shapes["key_padding_mask"] = [*batch[:1], n_kv]
    if rng.random() < 0.3:
        shapes["attn_mask"] = rng.choice(([n_q, n_kv], [*batch, h, n_q, n_kv], [1, n_kv]))
    if rng.random() < 0.2:
        shapes["key_lengths"] = batch[:1] if rng.random() < 0.7 else []
    if rng.random() < 0.2:
        dims = rng.choice([dims for name, dims in shapes.items() if name != "key_lengths"])
        dims[rng.randrange(len(dims))] += rng.choice((1, -1))
    return shapes
