"""Where the tap sees a model's attention: one callback per attention call, nothing else.

Two ways in, chosen by `attach_hooks`:
- A Hugging Face model (a transformers PreTrainedModel with an attention interface): a function
  registered in transformers' AttentionInterface under a name of its own wraps the model's
  current implementation ("sdpa", "eager", a flash variant...), and the same name is registered
  in AttentionMaskInterface with that implementation's mask function (without it the model
  would build no mask for an unknown name and padding would silently be attended). The model is
  switched to that name while attached and back afterwards. Its own kernel still runs, on the
  very arguments it always gets, so its outputs are bitwise unchanged; the wrapper only reads q,
  k, v, the mask and the scale on the way in.
- Any other module: torch.nn.functional.scaled_dot_product_attention is intercepted by a
  TorchFunctionMode, pushed only for the forwards that are sampled (a mode sees every torch call
  of the forward, which costs Python dispatch on each: unsampled forwards run without it).

Forwards are counted by a forward pre-hook on the top module, per thread (a model served from
several threads keeps each forward's calls apart). The callback gets an `AttentionCall`; it must
not raise, and `attach_hooks` shields the model from it anyway: an exception in the callback is
logged once and swallowed.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.overrides import TorchFunctionMode

logger = logging.getLogger("sdpa_client.tap")

# Reports which call of which forward this is, and whether it is sampled (see `ForwardGate`).
OnCall = Callable[["AttentionCall"], None]
Causal = bool | Literal["top_left", "bottom_right"]

_SDPA = torch.nn.functional.scaled_dot_product_attention
_SDPA_SIGNATURE = inspect.signature(
    lambda query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw: None
)
_names = itertools.count()


@dataclass(frozen=True, slots=True)
class AttentionCall:
    """One attention call of a sampled forward, as the model's kernel received it.

    Attributes:
        forward: the forward's number, from 0 per attach.
        layer: the HF module's layer index, else the call's order within the forward.
        q, k, v: the kernel's inputs, [B, H, N_q, D] / [B, H_kv, N_kv, D] / [B, H_kv, N_kv, D_v]
            (the model's tensors: copy before keeping them).
        attn_mask: boolean (True = attend) or additive float, broadcastable to the scores; None.
        key_padding_mask: boolean [B, N_kv], True = padding (flash kernels' 2-D masks); None.
        scale: the scale the kernel used; None = 1/sqrt(D).
        causal: whether the kernel applied a causal mask of its own (top-left, as torch's).
    """

    forward: int
    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None
    key_padding_mask: torch.Tensor | None
    scale: float | None
    causal: Causal


class ForwardGate:
    """Counts forwards and decides which are sampled: forward n is sampled when n % every == 0."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._count = itertools.count()
        self._local = threading.local()
        self.forwards = 0

    def begin(self) -> bool:
        """A forward starts on this thread; returns whether it is sampled."""
        n = next(self._count)  # itertools.count is atomic under the GIL
        self.forwards = n + 1
        self._local.forward = n
        self._local.calls = 0
        self._local.sampled = n % self.every == 0
        return bool(self._local.sampled)

    def end(self) -> None:
        self._local.sampled = False

    def next_call(self) -> tuple[int, int] | None:
        """(forward, order of this call in it) when this thread's forward is sampled, else None."""
        if not getattr(self._local, "sampled", False):
            return None
        order = self._local.calls
        self._local.calls = order + 1
        return int(self._local.forward), int(order)


def is_hf_model(model: torch.nn.Module) -> bool:
    """A transformers model that dispatches its attention through AttentionInterface."""
    if not callable(getattr(model, "set_attn_implementation", None)):
        return False
    config = getattr(model, "config", None)
    return isinstance(getattr(config, "_attn_implementation", None), str)


class _Shield:
    """Runs the callback so that nothing it raises reaches the model; logs the first failure."""

    def __init__(self, on_call: OnCall, on_error: Callable[[BaseException], None]) -> None:
        self._on_call = on_call
        self._on_error = on_error
        self._logged = False

    def __call__(self, call: AttentionCall) -> None:
        try:
            self._on_call(call)
        except Exception as exc:  # never into the model's forward
            self._on_error(exc)
            if not self._logged:
                self._logged = True
                logger.warning("tap: an attention call could not be sampled: %r", exc)


def _hf_mask(mask: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(attn_mask, key_padding_mask) of the mask an HF attention implementation receives."""
    if mask is None or not isinstance(mask, torch.Tensor):
        return None, None
    if mask.dim() == 2:
        # Flash implementations get the tokenizer's [B, N_kv] mask, 1 = a real token.
        return None, mask == 0
    return mask, None


def _hf_causal(module: torch.nn.Module, q: torch.Tensor, mask: object, kw: dict[str, Any]) -> bool:
    # As transformers' sdpa_attention_forward decides it: the kernel's own causal mask applies
    # only when no mask tensor was built and more than one query is asked.
    is_causal = kw.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", False)
    return bool(is_causal) and mask is None and q.shape[2] > 1


def _eager_function(model: torch.nn.Module) -> Callable[..., Any] | None:
    """The model's own eager_attention_forward: "eager" is not in the registry, each modeling
    file defines it beside its attention modules (get_interface's default)."""
    for module in model.modules():
        found = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
        if callable(found):
            return found  # type: ignore[no-any-return]
    return None


@contextlib.contextmanager
def _hf_interface(model: torch.nn.Module, gate: ForwardGate, on_call: _Shield) -> Iterator[None]:
    transformers = importlib.import_module("transformers")
    attention_interface = transformers.AttentionInterface
    mask_interface = transformers.AttentionMaskInterface
    config: Any = model.config
    current = str(config._attn_implementation)
    wrapped = attention_interface._global_mapping.get(current) or _eager_function(model)
    if wrapped is None:
        raise ValueError(f"attach: no attention function registered as {current!r}")

    def tapped(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        where = gate.next_call()
        if where is not None:
            forward, order = where
            layer = getattr(module, "layer_idx", None)
            attn_mask, key_padding_mask = _hf_mask(attention_mask)
            scaling = kwargs.get("scaling")
            on_call(
                AttentionCall(
                    forward=forward,
                    layer=order if not isinstance(layer, int) else layer,
                    q=query,
                    k=key,
                    v=value,
                    attn_mask=attn_mask,
                    key_padding_mask=key_padding_mask,
                    scale=None if scaling is None else float(scaling),
                    causal=_hf_causal(module, query, attention_mask, kwargs),
                )
            )
        return wrapped(module, query, key, value, attention_mask, *args, **kwargs)

    name = f"sdpa_tap_{next(_names)}_{current}"
    attention_interface.register(name, tapped)
    mask_function = mask_interface._global_mapping.get(current)
    if mask_function is not None:
        mask_interface.register(name, mask_function)
    try:
        model.set_attn_implementation(name)  # type: ignore[operator]
        if str(config._attn_implementation) != name:
            raise ValueError(
                f"attach: {type(model).__name__} did not accept an attention implementation "
                f"registered in transformers' AttentionInterface (it kept {current!r})"
            )
        try:
            yield
        finally:
            model.set_attn_implementation(current)  # type: ignore[operator]
    finally:
        attention_interface._global_mapping.pop(name, None)
        mask_interface._global_mapping.pop(name, None)


class _SdpaInterceptor(TorchFunctionMode):
    """Sees every F.scaled_dot_product_attention call of a sampled forward, then runs it."""

    def __init__(self, gate: ForwardGate, on_call: _Shield) -> None:
        super().__init__()
        self._gate = gate
        self._on_call = on_call

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA:
            self._observe(args, kwargs)
        return func(*args, **kwargs)

    def _observe(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        where = self._gate.next_call()
        if where is None:
            return
        try:
            bound = _SDPA_SIGNATURE.bind(*args, **kwargs).arguments
        except TypeError:
            return  # torch itself raises on this call
        forward, order = where
        scale = bound.get("scale")
        self._on_call(
            AttentionCall(
                forward=forward,
                layer=order,
                q=bound["query"],
                k=bound["key"],
                v=bound["value"],
                attn_mask=bound.get("attn_mask"),
                key_padding_mask=None,
                scale=None if scale is None else float(scale),
                causal=bool(bound.get("is_causal", False)),
            )
        )


@contextlib.contextmanager
def attach_hooks(
    model: torch.nn.Module,
    every: int,
    on_call: OnCall,
    on_error: Callable[[BaseException], None],
) -> Iterator[ForwardGate]:
    """Call `on_call` for each attention call of every `every`-th forward of `model`.

    Yields:
        The ForwardGate that counts the forwards.

    Raises:
        ValueError: a transformers model that cannot take a wrapped attention implementation.
    """
    gate = ForwardGate(every)
    shield = _Shield(on_call, on_error)
    hf = is_hf_model(model)
    interceptor = None if hf else _SdpaInterceptor(gate, shield)
    modes = threading.local()

    def before(module: torch.nn.Module, args: Any) -> None:
        sampled = gate.begin()
        if interceptor is not None and sampled:
            interceptor.__enter__()  # type: ignore[no-untyped-call]
            modes.pushed = True

    def after(module: torch.nn.Module, args: Any, output: Any) -> None:
        # always_call=True: also when the forward raised, so the mode never outlives it.
        gate.end()
        if interceptor is not None and getattr(modes, "pushed", False):
            modes.pushed = False
            interceptor.__exit__(None, None, None)  # type: ignore[no-untyped-call]

    pre = model.register_forward_pre_hook(before)
    post = model.register_forward_hook(after, always_call=True)
    try:
        if hf:
            with _hf_interface(model, gate, shield):
                yield gate
        else:
            yield gate
    finally:
        pre.remove()
        post.remove()
