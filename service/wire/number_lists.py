"""A nested JSON list of numbers as the codec reads it: one set of rules, for a list parsed whole
and for one parsed in pieces (service.wire.json_arrays).

The codec reads a nested list with np.asarray and then asks three things of it: its dtype and
shape (ragged lists are refused), whether a boolean sits among its numbers (refused), and for a
float mask, its values with null as -inf. For a list parsed whole they come from the list
itself. A list parsed in pieces never exists as Python objects: each piece, a flat list of
scalars, is read by the same rules (np.asarray, leaf_types, nulls_to_minus_inf) into a
NumberArray that answers the same three questions with the same answers.

Why pieces combine exactly (numpy 2.4.6, checked by tests/service/wire/test_json_arrays.py):
np.asarray gives each JSON scalar a dtype (true/false bool, an integer int64 within its range,
uint64 up to 2**64, object past it, a float float64, null object) and the list the promotion of
them all: np.result_type is associative, so the promotion of the pieces' dtypes is the list's.
The values agree too: numpy's int64 -> float64 cast rounds to nearest as Python's int -> float
does, bool -> int64 gives 0 and 1, and an object list's numbers are converted to float64 one by
one in both cases. An object list (null or huge integers) is an error except in a float mask,
where only its -inf form is used: a NumberArray of kind "O" keeps that form, never the objects.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

# Leaves whose types are read in one C call (set(map(type, ...))): about 2 ms each, so that a
# worker thread reading millions of them gives the GIL back to the event loop between chunks.
TYPE_CHUNK: Final = 1 << 16
# The leaves a float mask may hold beside its nulls.
_NUMBER_TYPES: Final = frozenset({int, float})
_NONE: Final = np.array(None, dtype=object)

# Why a float mask's values cannot be read with null as -inf: a leaf that is neither a number
# nor null ("types"), or an integer beyond float64's range ("overflow").
MinusInfProblem = Literal["types", "overflow"]


def leaf_types(leaves: Iterable[Any]) -> set[type]:
    """The Python types among `leaves`, read a chunk at a time (no Python step per leaf)."""
    types: set[type] = set()
    if isinstance(leaves, list):  # a flat list: its slices, without an iterator's copies
        for at in range(0, len(leaves), TYPE_CHUNK):
            types.update(map(type, leaves[at : at + TYPE_CHUNK]))
        return types
    it = iter(leaves)
    while chunk := tuple(islice(it, TYPE_CHUNK)):
        types.update(map(type, chunk))
    return types


def nulls_to_minus_inf(arr: npt.NDArray[Any]) -> npt.NDArray[np.float64] | None:
    """An object array's values as float64 with None as -inf; None when an integer is beyond
    float64's range. (Its leaves' types are checked apart: minus_inf_of.)"""
    nulls = np.equal(arr, _NONE)
    try:
        return np.where(nulls, -np.inf, arr).astype(np.float64)
    except OverflowError:
        return None


def minus_inf_of(arr: npt.NDArray[Any]) -> npt.NDArray[np.float64] | MinusInfProblem:
    """A float mask read whole (an object array: it holds null) with null as -inf, or the rule
    it breaks. Only numbers may sit beside the nulls."""
    others = arr[~np.equal(arr, _NONE)]
    # Per element, but only on this path: a JSON-list mask that holds nulls at all.
    if not leaf_types(others.flat) <= _NUMBER_TYPES:
        return "types"
    values = nulls_to_minus_inf(arr)
    return "overflow" if values is None else values


class NumberArray:
    """A nested JSON list of scalars, parsed in pieces: what np.asarray would make of it, without
    a Python object per number. It stands in the parsed body where the list was; the wire models
    take it where they take a nested list, and the codec reads it as it reads one."""

    __slots__ = ("_minus_inf", "_values", "booleans", "kind", "ragged", "shape")

    def __init__(
        self,
        *,
        shape: tuple[int, ...],
        kind: str,
        booleans: bool,
        values: npt.NDArray[Any] | None = None,
        minus_inf: npt.NDArray[np.float64] | MinusInfProblem | None = None,
        ragged: bool = False,
    ) -> None:
        self.shape = shape
        self.kind = kind  # numpy's dtype kind: "b", "i", "u", "f", or "O" (null, huge integers)
        self.booleans = booleans  # whether a leaf is true or false
        self.ragged = ragged
        self._values = values
        self._minus_inf = minus_inf

    @classmethod
    def ragged_list(cls) -> NumberArray:
        """A list that np.asarray refuses (rows of different lengths, leaves at several depths)."""
        return cls(shape=(), kind="O", booleans=False, ragged=True)

    def as_array(self) -> npt.NDArray[Any]:
        """np.asarray of the list: its numbers (kind "O": an empty stand-in of the right shape).
        Raises ValueError for a ragged list, as np.asarray does."""
        if self.ragged:
            raise ValueError("ragged nested list")
        if self._values is not None:
            return self._values
        return np.broadcast_to(_NONE, self.shape)

    def minus_inf(self) -> npt.NDArray[np.float64] | MinusInfProblem:
        """minus_inf_of the list (kind "O" only)."""
        assert self._minus_inf is not None, "only an object list is read with null as -inf"
        return self._minus_inf

    def stand_in(self) -> Any:
        """What np.asarray reads as the same nested sequence, inside a list around it (a tensor's
        list that holds other things too, and so is never a tensor)."""
        if self.ragged:
            return [[], [0]]
        return self.as_array()


class NumberArrayBuilder:
    """A NumberArray from its pieces in order: flat lists of JSON scalars, read one by one with
    the rules np.asarray applies to the whole list (see the module's docstring). In a list of
    JSON scalars without strings, the leaves that are not numbers or null are the booleans:
    whether there are any is all the codec's rules ask of their types."""

    def __init__(self, count: int) -> None:
        self._count = count
        self._filled = 0
        self._out: npt.NDArray[Any] | None = None
        self._as_objects = False  # a piece held null or a huge integer: the list is of kind "O"
        self._overflow = False
        self._booleans = False

    def add(self, values: list[Any], *, booleans: bool | None = None) -> None:
        """Read the next piece. `booleans`: False when the caller knows it holds none (its text
        has no "t" or "f"); None to look at its leaves' types."""
        arr = np.asarray(values)
        if booleans is None:  # numpy reads true and false alone as bool, and only them
            booleans = arr.dtype.kind == "b" or bool in leaf_types(values)
        self._booleans |= booleans
        start, stop = self._filled, self._filled + len(values)
        self._filled = stop
        if arr.dtype.kind == "O" and not self._as_objects:
            # From here on the list is read as a float mask would read it: float64, null as -inf.
            self._as_objects = True
            self._out = (
                np.empty(self._count, np.float64)
                if self._out is None
                else self._out.astype(np.float64)
            )
        if self._as_objects:
            assert self._out is not None
            part = nulls_to_minus_inf(arr) if arr.dtype.kind == "O" else arr.astype(np.float64)
            if part is None:
                self._overflow = True
            else:
                self._out[start:stop] = part
            return
        if self._out is None:
            self._out = np.empty(self._count, arr.dtype)
        else:
            dtype = np.result_type(self._out.dtype, arr.dtype)
            if dtype != self._out.dtype:
                self._out = self._out.astype(dtype)
        self._out[start:stop] = arr

    def finish(self, shape: Sequence[int]) -> NumberArray:
        assert self._filled == self._count == int(np.prod(shape, dtype=np.int64))
        shape = tuple(shape)
        booleans = self._booleans
        if self._out is None:  # no leaf: np.asarray([]) and [[], []] are float64
            values = np.empty(shape, np.float64)
            return NumberArray(shape=shape, kind="f", booleans=booleans, values=values)
        if not self._as_objects:
            values = self._out.reshape(shape)
            return NumberArray(shape=shape, kind=values.dtype.kind, booleans=booleans,
                               values=values)  # fmt: skip
        # minus_inf_of's rules: only numbers beside the nulls, each within float64's range.
        problem: MinusInfProblem | None = None
        if booleans:
            problem = "types"
        elif self._overflow:
            problem = "overflow"
        minus_inf = problem if problem is not None else self._out.reshape(shape)
        return NumberArray(shape=shape, kind="O", booleans=booleans, minus_inf=minus_inf)
