"""Every mask option -> one boolean visibility (True = the query may attend to the key).

This module is the one owner of key padding and of mask tiles: every path (fused, dense,
chunked) and the non-finite policy read their visibility from a MaskPlan, and a caller that
pads batches (the service's batching engine) builds its key padding with key_padding() and
key_padding_from_lengths().

Masks combine by logical AND, as booleans, never by adding large negative numbers: in float16
finfo.min + finfo.min overflows to -inf, and -inf + -inf rows turn into NaN. A float attn_mask
is kept as an additive bias for the visible entries; its -inf entries become "not visible".

The plan keeps each part in its smallest broadcastable 4-D shape (key padding is
[B|1, H|1, 1, N_kv], causal is generated from indices) so that a path can build one
[.., tile_q, tile_k] block at a time and never holds an N_q x N_kv matrix.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, Literal, TypeAlias

import torch

if TYPE_CHECKING:  # shapes.py validates a Masks value: it imports this module
    from sdpa_core.shapes import CausalArg, CausalMode, InputSpec

KeyLengths: TypeAlias = torch.Tensor | list[int] | tuple[int, ...] | int
CausalState: TypeAlias = Literal["all", "none", "some"]


@dataclass(frozen=True, slots=True)
class Masks:
    """Every mask option of one request, as given: one value from the wire to the kernels
    (the service's jobs, collation, the engine, AttentionRun, validate_inputs and
    build_mask_plan pass it whole), where four loose arguments used to travel.

    causal: False (or None, "none"), True / "top_left" or "bottom_right". key_lengths:
    integers, keys j >= length are padding (per sequence, per head, or one int).
    key_padding_mask: bool, True = padding. attn_mask: bool (True = may attend) or float (an
    additive bias). Shapes and meanings are attention()'s. Making one checks nothing:
    validate_inputs does, in its order, naming attention()'s argument.
    """

    causal: CausalArg = False
    key_lengths: KeyLengths | None = None
    key_padding_mask: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The options given as tensors (what holding these masks keeps alive)."""
        options = (self.key_lengths, self.key_padding_mask, self.attn_mask)
        return tuple(x for x in options if isinstance(x, torch.Tensor))

    def to(
        self,
        device: torch.device,
        *,
        move: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None,
    ) -> Masks:
        """These masks with every tensor on `device` (key lengths given as ints stay ints).
        move(tensor, device) moves one (default: Tensor.to; the service stages host tensors
        in pinned memory)."""

        def put(x: torch.Tensor) -> torch.Tensor:
            return x.to(device) if move is None else move(x, device)

        lengths = self.key_lengths
        return Masks(
            causal=self.causal,
            key_lengths=put(lengths) if isinstance(lengths, torch.Tensor) else lengths,
            key_padding_mask=None if self.key_padding_mask is None else put(self.key_padding_mask),
            attn_mask=None if self.attn_mask is None else put(self.attn_mask),
        )


# No mask at all: every key visible to every query.
NO_MASKS: Final = Masks()


@dataclass(frozen=True, slots=True)
class MaskPlan:
    """The visibility of a normalized [B, H, N_q, N_kv] score matrix, kept in parts."""

    n_q: int
    n_kv: int
    causal: CausalMode
    parts: tuple[torch.Tensor, ...]  # bool, each broadcastable to [B, H, N_q, N_kv]
    bias: torch.Tensor | None  # float attn_mask as 4-D, broadcastable; -inf where masked
    device: torch.device
    # A plan of some query rows (query_rows): its row 0 is row `row_offset` of a matrix of
    # `full_n_q` rows (None: this plan's own n_q), which is what causal alignment counts from.
    row_offset: int = 0
    full_n_q: int | None = None
    # A plan of the first keys (key_prefix): the matrix's own N_kv, for the causal alignment.
    full_n_kv: int | None = None

    @property
    def is_empty(self) -> bool:
        """True when every key is visible to every query and there is no bias."""
        return self.causal == "none" and not self.parts and self.bias is None

    @property
    def has_visibility(self) -> bool:
        """True when some (query, key) pair may be invisible."""
        return self.causal != "none" or bool(self.parts)

    @property
    def causal_offset(self) -> int:
        """Query i sees keys j <= i + offset (top_left: 0; bottom_right: N_kv - N_q), i
        counted from this plan's first row (a plan of query rows shifts it by row_offset)."""
        full_n_q = self.n_q if self.full_n_q is None else self.full_n_q
        full_n_kv = self.n_kv if self.full_n_kv is None else self.full_n_kv
        aligned = full_n_kv - full_n_q if self.causal == "bottom_right" else 0
        return aligned + self.row_offset

    def causal_state(self, q0: int, q1: int, k0: int, k1: int) -> CausalState:
        """Causal visibility of rows [q0, q1) x keys [k0, k1), decided from indices alone:
        "all" (every pair visible, or no causal mask), "none" (no pair) or "some"."""
        if self.causal == "none":
            return "all"
        off = self.causal_offset
        if k1 - 1 <= q0 + off:
            return "all"
        if k0 > q1 - 1 + off:
            return "none"
        return "some"

    def causal_block(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor | None:
        """Causal visibility of rows [q0, q1) x keys [k0, k1): [1, 1, q1-q0, k1-k0] or None."""
        if self.causal == "none":
            return None
        rows = torch.arange(q0, q1, device=self.device).unsqueeze(-1)  # [tq, 1]
        cols = torch.arange(k0, k1, device=self.device)  # [tk]
        return (cols <= rows + self.causal_offset)[None, None]  # [1, 1, tq, tk]

    def block(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor | None:
        """Combined visibility of one tile, broadcastable to [B, H, q1-q0, k1-k0]; None = all."""
        return self._and_parts(self.causal_block(q0, q1, k0, k1), q0, q1, k0, k1)

    def sparse_block(self, q0: int, q1: int, k0: int, k1: int) -> tuple[bool, torch.Tensor | None]:
        """(skip, vis) of one tile for a loop over key blocks: skip when no pair of the tile is
        visible, vis None when every pair is (then no mask needs applying).

        Causality is decided from the indices alone (a tile it hides entirely is skipped, one
        it leaves whole needs no causal block); other masks are read (one host sync).
        """
        state = self.causal_state(q0, q1, k0, k1)
        if state == "none":
            return True, None
        causal = self.causal_block(q0, q1, k0, k1) if state == "some" else None
        vis = self._and_parts(causal, q0, q1, k0, k1)
        if vis is None:
            return False, None
        if not bool(vis.any()):
            return True, None
        if bool(vis.all()):
            return False, None
        return False, vis

    def parts_block(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor | None:
        """Visibility of one tile by every part but causality (key padding, a bool attn_mask,
        a float one's -inf entries): broadcastable to [B, H, q1-q0, k1-k0] in the parts'
        smallest shape, or None when no part hides a key. The flash kernels take causality
        as an index rule and this as a tensor."""
        return self._and_parts(None, q0, q1, k0, k1)

    def _and_parts(
        self, mask: torch.Tensor | None, q0: int, q1: int, k0: int, k1: int
    ) -> torch.Tensor | None:
        """mask AND every part's tile (None = all visible)."""
        for part in self.parts:
            piece = _tile(part, q0, q1, k0, k1)
            mask = piece if mask is None else mask & piece
        return mask

    def bias_block(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor | None:
        """The float bias of one tile (broadcastable), or None."""
        return None if self.bias is None else _tile(self.bias, q0, q1, k0, k1)

    def full(self) -> torch.Tensor | None:
        """Combined visibility of the whole score matrix (smallest broadcast shape) or None."""
        return self.block(0, self.n_q, 0, self.n_kv)

    def batch_slice(self, b0: int, b1: int) -> MaskPlan:
        """The plan of sequences [b0, b1) of the normalized batch."""

        def cut(x: torch.Tensor) -> torch.Tensor:
            return x if x.shape[0] == 1 else x[b0:b1]

        return dataclasses.replace(
            self,
            parts=tuple(cut(p) for p in self.parts),
            bias=None if self.bias is None else cut(self.bias),
        )

    def query_rows(self, q0: int, q1: int) -> MaskPlan:
        """The plan of query rows [q0, q1): the same visibility, row for row, as those rows
        have in this plan (a resumable run computes a request in such tiles)."""
        if (q0, q1) == (0, self.n_q):
            return self
        return dataclasses.replace(
            self,
            n_q=q1 - q0,
            parts=tuple(_tile(p, q0, q1, 0, self.n_kv) for p in self.parts),
            bias=None if self.bias is None else _tile(self.bias, q0, q1, 0, self.n_kv),
            row_offset=self.row_offset + q0,
            full_n_q=self.n_q if self.full_n_q is None else self.full_n_q,
        )

    def key_prefix(self, k1: int) -> MaskPlan:
        """The plan of keys [0, k1) alone (for rows that can see no key past k1 - 1: causal
        tiles of query rows), the causal alignment kept."""
        if k1 == self.n_kv:
            return self
        return dataclasses.replace(
            self,
            n_kv=k1,
            parts=tuple(_tile(p, 0, self.n_q, 0, k1) for p in self.parts),
            bias=None if self.bias is None else _tile(self.bias, 0, self.n_q, 0, k1),
            full_n_kv=self.n_kv if self.full_n_kv is None else self.full_n_kv,
        )

    def causal_only_top_left(self) -> bool:
        """True when the only mask is causal with offset 0 (top_left, or bottom_right with
        N_q = N_kv, of a whole matrix): torch's is_causal expresses it without materializing
        a mask."""
        aligned = self.causal != "none" and self.causal_offset == 0
        return aligned and not self.parts and self.bias is None


def _tile(x: torch.Tensor, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """Slice dims 2 (N_q) and 3 (N_kv) of a broadcastable 4-D tensor, keeping size-1 dims."""
    if x.shape[2] != 1 and (q0, q1) != (0, x.shape[2]):
        x = x[:, :, q0:q1]
    if x.shape[3] != 1 and (k0, k1) != (0, x.shape[3]):
        x = x[:, :, :, k0:k1]
    return x


def _within_lengths(lengths: torch.Tensor, n_kv: int) -> torch.Tensor:
    """lengths [..., 1] -> bool [..., N_kv]: True where key j < the length (the one rule of
    key_lengths: keys at or past a sequence's length are padding)."""
    keys = torch.arange(n_kv, device=lengths.device)  # [N_kv]
    return keys < lengths  # [..., N_kv]


def key_padding_from_lengths(lengths: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Key padding of sequences of the given lengths: bool [..., N_kv], True = padding.

    lengths: integers of any shape [...]; key j of a sequence is padding when j >= its length.
    """
    return ~_within_lengths(lengths.unsqueeze(-1), n_kv)


def _per_head(option: torch.Tensor, spec: InputSpec, *, trailing: int) -> bool:
    """Whether key_lengths (trailing=0) or key_padding_mask (trailing=1, for N_kv) is given per
    head ([..., H]) rather than per sequence: by its rank, as validate_inputs accepted it."""
    return option.dim() - trailing > len(spec.batch_shape) and not spec.two_d


def _lengths_4d(
    spec: InputSpec, key_lengths: KeyLengths, device: torch.device | None
) -> torch.Tensor:
    """Validated key_lengths as int64 [B|1, H|1, 1, 1], ready to compare with key indices."""
    if isinstance(key_lengths, torch.Tensor):
        kl = key_lengths.to(device=device or key_lengths.device, dtype=torch.int64)
    else:
        kl = torch.as_tensor(key_lengths, dtype=torch.int64, device=device)
    if kl.dim() == 0:  # one length for every sequence
        return kl.reshape(1, 1, 1, 1)
    return kl.reshape(spec.batch, spec.heads if _per_head(kl, spec, trailing=0) else 1, 1, 1)


def key_lengths_by_head(
    spec: InputSpec, key_lengths: KeyLengths, *, device: torch.device | None = None
) -> torch.Tensor:
    """Validated key_lengths as int64 [B, H|1] (H when given per head; [1, 1] for a single
    length shared by every sequence), on device (default: key_lengths' own, or the CPU)."""
    return _lengths_4d(spec, key_lengths, device)[:, :, 0, 0]


def _key_visibility(
    spec: InputSpec,
    *,
    key_lengths: KeyLengths | None,
    key_padding_mask: torch.Tensor | None,
    device: torch.device | None,
) -> torch.Tensor | None:
    """bool [B|1, H|1, 1, N_kv], True = visible (the complement of key_padding), or None."""
    vis: torch.Tensor | None = None
    if key_lengths is not None:
        kl = _lengths_4d(spec, key_lengths, device)  # [B|1, H|1, 1, 1]
        # A length equal to N_kv pads nothing; leave it out then (cheaper fused calls).
        if int(kl.min()) < spec.n_kv:
            vis = _within_lengths(kl, spec.n_kv)  # [B|1, H|1, 1, N_kv]
    if key_padding_mask is not None:
        width = spec.heads if _per_head(key_padding_mask, spec, trailing=1) else 1
        kpm = key_padding_mask.reshape(spec.batch, width, 1, spec.n_kv)  # [B, H|1, 1, N_kv]
        if device is not None and kpm.device != device:
            kpm = kpm.to(device)
        vis = ~kpm if vis is None else vis & ~kpm
    return vis


def key_padding(
    spec: InputSpec,
    *,
    key_lengths: KeyLengths | None = None,
    key_padding_mask: torch.Tensor | None = None,
    device: torch.device | None = None,
) -> torch.Tensor | None:
    """The key padding of validated inputs: bool [B|1, H|1, N_kv], True = padding, or None
    when no option can hide a key (no key_padding_mask, and no key length below N_kv); a
    key_padding_mask counts even when it is all False.

    A key is padding when it lies at or past its sequence's key length or key_padding_mask
    marks it (True = padding, nn.MultiheadAttention's convention); the head dim is H when
    either option is given per head. device defaults to that of the options given.
    """
    vis = _key_visibility(
        spec, key_lengths=key_lengths, key_padding_mask=key_padding_mask, device=device
    )
    return None if vis is None else ~vis.squeeze(2)


def attn_mask_4d(mask: torch.Tensor, spec: InputSpec) -> torch.Tensor:
    """A validated attn_mask (broadcastable to q.shape[:-1] + (N_kv,)) as a 4-D view
    [B|1, H|1, N_q|1, N_kv|1] of the normalized [B, H, N_q, N_kv] scores."""
    full_rank = len(spec.row_shape) + 1
    m = mask.reshape((1,) * (full_rank - mask.dim()) + tuple(mask.shape))
    if spec.two_d:
        return m.reshape(1, 1, *m.shape[-2:])
    lead = m.shape[:-3]
    if all(s == 1 for s in lead):
        return m.reshape(1, *m.shape[-3:])
    m = m.expand(*spec.batch_shape, *m.shape[-3:])
    return m.reshape(spec.batch, *m.shape[-3:])


def build_mask_plan(spec: InputSpec, masks: Masks, *, device: torch.device) -> MaskPlan:
    """Turn every (validated) mask option into a MaskPlan (causal as spec normalized it)."""
    parts: list[torch.Tensor] = []
    bias: torch.Tensor | None = None

    keys = _key_visibility(
        spec, key_lengths=masks.key_lengths, key_padding_mask=masks.key_padding_mask, device=device
    )
    if keys is not None:
        parts.append(keys)  # [B|1, H|1, 1, N_kv]

    attn_mask = masks.attn_mask
    if attn_mask is not None:
        m4 = attn_mask_4d(attn_mask, spec)  # [B|1, H|1, N_q|1, N_kv|1]
        if m4.dtype == torch.bool:
            parts.append(m4)
        else:
            # A float32 bias beside float64 inputs is legal, but torch 2.13's CPU SDPA kernel
            # adds it wrongly (the fused output differed by ~1.5 from the float64 reference
            # at N_kv >= 16); in the inputs' own dtype every path gets it right.
            bias = m4.to(torch.float64) if spec.dtype == torch.float64 else m4
            invisible = m4 == -math.inf
            if bool(invisible.any()):
                parts.append(~invisible)

    return MaskPlan(
        n_q=spec.n_q,
        n_kv=spec.n_kv,
        causal=spec.causal,
        parts=tuple(parts),
        bias=bias,
        device=device,
    )
