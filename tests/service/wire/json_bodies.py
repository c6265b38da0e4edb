"""Random JSON request bodies for the tests of parsing in pieces (service.wire.json_arrays): many
shapes of nested lists (depths 1-6, ragged, empty lists, leaves of every kind, numbers spelled
in every way JSON allows and some it does not), around them strings with brackets and escaped
quotes, objects, unknown fields, list fields, and whitespace everywhere; sometimes one byte
changed, so that the body is no longer JSON.

Built from a seeded random.Random that hypothesis draws, as text: what matters is how the
bytes fall, which a JSON serializer would not vary.
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np

WHITESPACE = ["", "", "", " ", "  ", "\n", "\t", " \r\n "]
NUMBER_SPELLINGS = [
    "0", "-0", "1", "-1", "7", "0.5", "-0.0", "0.0", "1e3", "1E-3", "-2.5e+2", "3.25", "1e400",
    "123456789", "-987654321", "9007199254740993", "9223372036854775807", "9223372036854775808",
    "-9223372036854775808", "-9223372036854775809", "18446744073709551615",
    "18446744073709551616", "1" + "0" * 30, "0.1", "2.2250738585072014e-308", "5e-324",
]  # fmt: skip
BAD_TOKENS = ["01", "1.", ".5", "+1", "-", "tru", "nul", "1e", "0x10", "1.2.3", "truefalse"]
STRINGS = [
    '"plain"', '"a[1, 2]b"', '"]]]["', '"quote \\" [3]"', '"back\\\\"', '"back\\\\\\"[4,5]"',
    '"\\\\\\\\"', '"unicode \\u00e9 [6]"', '"{\\"q\\": [1]}"', '""',
]  # fmt: skip


class Bodies:
    """Text of random bodies, drawn from `rng`."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def ws(self) -> str:
        return self.rng.choice(WHITESPACE)

    # ---- leaves ------------------------------------------------------------------------------

    def leaf(self, kind: str) -> str:
        r = self.rng
        if kind == "float":
            if r.random() < 0.3:
                return r.choice(NUMBER_SPELLINGS)
            return repr(r.choice([r.uniform(-3, 3), float(r.randint(-9, 9)), -0.0]))
        if kind == "int":
            if r.random() < 0.15:
                return r.choice(["9223372036854775807", "9223372036854775808", "-1",
                                 "18446744073709551616", "-9223372036854775809"])  # fmt: skip
            return str(r.randint(-5, 40))
        if kind == "bool":
            return r.choice(["true", "false"])
        if kind == "mask":  # a float mask: numbers, null for -inf
            return "null" if r.random() < 0.3 else self.leaf("float")
        if kind == "bad":
            return r.choice(BAD_TOKENS) if r.random() < 0.3 else self.leaf("float")
        if kind == "inf":  # v2 takes NaN and Infinity
            return r.choice(["NaN", "Infinity", "-Infinity", "1.5"])
        # mixed: every kind of JSON scalar
        return self.leaf(r.choice(["float", "int", "bool", "mask"]))

    def kind(self) -> str:
        weights = {"float": 5, "int": 3, "bool": 3, "mask": 2, "mixed": 2, "bad": 1, "inf": 1}
        return self.rng.choices(list(weights), weights=list(weights.values()))[0]

    # ---- nested lists ------------------------------------------------------------------------

    def shape(self) -> list[int]:
        r = self.rng
        depth = r.choice([1, 1, 2, 2, 3, 3, 4, 5, 6])
        dims = [r.choice([1, 1, 2, 3, 4]) for _ in range(depth)]
        if r.random() < 0.1:
            dims[r.randrange(depth)] = 0
        if r.random() < 0.5:  # a longer row, to be cut in pieces
            dims[-1] = r.randint(5, 40)
        while int(np.prod(dims)) > 80:  # small enough to be quick
            dims[dims.index(max(dims))] //= 2
        return dims

    def nested(self, shape: list[int], kind: str) -> Any:
        if not shape:
            return self.leaf(kind)
        return [self.nested(shape[1:], kind) for _ in range(shape[0])]

    def irregular(self, tree: Any) -> Any:
        """`tree` with one list changed: a row shortened or lengthened, an element that is a
        list where numbers are (or the reverse), an empty list, a string or an object."""
        r = self.rng
        lists = []
        stack = [tree]
        while stack:
            node = stack.pop()
            if isinstance(node, list):
                lists.append(node)
                stack.extend(node)
        target = r.choice(lists)
        change = r.choice(["shorter", "longer", "deeper", "empty", "string", "object"])
        if change == "shorter" and target:
            target.pop()
        elif change == "longer":
            target.append(target[0] if target else "1")
        elif change == "deeper" and target:
            target[r.randrange(len(target))] = ["2", "3"]
        elif change == "empty":
            target.append([])
        elif change == "string":
            target.insert(r.randrange(len(target) + 1), r.choice(STRINGS))
        else:
            target.insert(r.randrange(len(target) + 1), '{"a": [1, 2, 3]}')
        return tree

    def dump(self, tree: Any) -> str:
        if isinstance(tree, str):
            return tree
        inner = ("," + self.ws()).join(self.ws() + self.dump(x) + self.ws() for x in tree)
        return "[" + inner + "]"

    def data(self, kind: str | None = None, shape: list[int] | None = None) -> str:
        """A nested list as text: regular, or now and then not."""
        kind = kind or self.kind()
        tree = self.nested(shape or self.shape(), kind)
        if self.rng.random() < 0.25:
            tree = self.irregular(tree if isinstance(tree, list) else [tree])
        return self.dump(tree)

    # ---- v1 ----------------------------------------------------------------------------------

    def tensor(self, kind: str | None = None) -> str:
        r = self.rng
        shape = self.shape()
        data = self.data(kind, shape)
        form = r.random()
        if form < 0.5:
            return data
        if form < 0.65:  # a list around the tensor that holds other things too
            return "[" + data + ", " + r.choice([*STRINGS, '{"x": 1}', data]) + "]"
        dtype = r.choice(["float32", "float32", "float16", "bfloat16", "float64", "bool"])
        given = shape if r.random() < 0.7 else self.shape()
        shape_text = self.dump([str(d) for d in given]) if r.random() < 0.9 else self.data("int")
        fields = [f'"dtype": "{dtype}"', f'"shape":{self.ws()}{shape_text}', f'"data": {data}']
        if r.random() < 0.1:
            fields.append(f'"unknown": {self.data()}')
        r.shuffle(fields)
        return "{" + ", ".join(fields) + "}"

    def v1(self, *, analyze: bool = False) -> bytes:
        r = self.rng
        fields = [f'"q": {self.tensor()}', f'"k": {self.tensor()}']
        if not analyze or r.random() < 0.2:
            fields.append(f'"v": {self.tensor()}')
        if r.random() < 0.4:
            fields.append(f'"attn_mask": {self.tensor(r.choice(["bool", "mask", "mixed"]))}')
        if r.random() < 0.3:
            fields.append(f'"key_padding_mask": {self.tensor("bool")}')
        if r.random() < 0.3:
            fields.append(f'"key_lengths": {self.data("int", self.shape()[:2])}')
        if r.random() < 0.3:
            fields.append(f'"tag": {r.choice(STRINGS)}')
        if r.random() < 0.2:
            fields.append(f'"{r.choice(["extra", "q2", "x[1]"])}": {self.data()}')
        if r.random() < 0.2:
            fields.append(f'"strategies": {self.data(r.choice(["int", "float", "mixed"]))}')
        if r.random() < 0.2:
            fields.append(f'"scale": {self.data()}')
        if r.random() < 0.1:  # a key given twice: the last one counts
            fields.append(f'"q": {self.tensor()}')
        r.shuffle(fields)
        return self.finish("{" + ("," + self.ws()).join(fields) + "}")

    # ---- v2 ----------------------------------------------------------------------------------

    def v2_input(self, name: str) -> str:
        r = self.rng
        shape = self.shape()
        datatype = r.choice(["FP32", "FP32", "FP16", "FP64", "BOOL", "INT32", "INT64", "BF16"])
        kind = {"BOOL": "bool", "INT32": "int", "INT64": "int"}.get(datatype)
        if name == "attn_mask" and r.random() < 0.5:
            kind = "mask"
        data = self.data(kind, shape)
        if r.random() < 0.1:
            data = "[" + data + ", " + r.choice(STRINGS) + "]"
        given = shape if r.random() < 0.8 else self.shape()
        shape_text = self.dump([str(d) for d in given]) if r.random() < 0.9 else self.data("int")
        return (
            f'{{"name": "{name}", "datatype": "{datatype}", "shape": {shape_text},'
            f'{self.ws()}"data":{self.ws()}{data}}}'
        )

    def v2(self) -> bytes:
        r = self.rng
        names = ["q", "k", "v", *r.sample(["attn_mask", "key_padding_mask", "key_lengths"], 1)]
        inputs = [self.v2_input(name) for name in names[: r.randint(3, 4)]]
        if r.random() < 0.1:
            inputs.append(self.data())
        fields = [f'"inputs": [{", ".join(inputs)}]']
        if r.random() < 0.3:
            fields.append(f'"parameters": {{"tag": {r.choice(STRINGS)}, "causal": true}}')
        if r.random() < 0.15:
            fields.append(f'"outputs": {self.data()}')
        if r.random() < 0.1:
            fields.append(f'"extra": {self.data()}')
        r.shuffle(fields)
        return self.finish("{" + ", ".join(fields) + "}")

    # ---- invalid JSON ------------------------------------------------------------------------

    def finish(self, text: str) -> bytes:
        r = self.rng
        if r.random() < 0.2 and text:
            at = r.randrange(len(text))
            change = r.choice(["drop", "comma", "space", "bracket", "close", "letter", "cut"])
            if change == "drop":
                text = text[:at] + text[at + 1 :]
            elif change == "comma":
                text = text[:at] + "," + text[at:]
            elif change == "space":
                text = text[:at] + " " + text[at + 1 :]
            elif change == "bracket":
                text = text[:at] + "[" + text[at:]
            elif change == "close":
                text = text[:at] + "]" + text[at:]
            elif change == "letter":
                text = text[:at] + "x" + text[at:]
            else:
                text = text[:at]
        return text.encode()


def regular_rows(rng: random.Random, rows: int, width: int) -> list[list[float]]:
    return [[round(rng.uniform(-2, 2), 4) for _ in range(width)] for _ in range(rows)]


def as_json(value: Any) -> str:
    return json.dumps(value)
