"""Where the tap sees a model's attention: one callback per attention call, nothing else.

The model runs exactly the code it runs untapped, with the same names and the same kernels;
what is replaced, for as long as it is attached, is a function the model calls through a name
looked up at call time:
- A Hugging Face model (a transformers PreTrainedModel with an attention interface): the
  function registered in transformers' AttentionInterface under each implementation name its
  configs use ("sdpa", a flash one; "eager", whose function each modeling file passes as the
  default) is wrapped. The model's config is not touched: transformers branches on the name in
  places (GPT-2's "eager" path, Falcon's "sdpa" checks), and masks are built as before.
- Any other module: torch.nn.functional.scaled_dot_product_attention is wrapped (what code that
  calls it through the module attribute gets, nn.MultiheadAttention's slow path included). A
  TorchFunctionMode would see calls too, but its presence turns off nn.TransformerEncoder's
  native fast path and so changes the model's outputs. Native fast paths (the encoder layer's
  fused kernel) and functions imported by name before attach are not seen.

A wrapper calls the original untouched unless the call comes from an attached model's forward
that is sampled on this thread; then it hands an AttentionCall to the tap first. Forwards are
counted by a forward pre-hook on the top module, per thread. Under torch.compile nothing is
sampled (a graph cannot copy tensors out). The callback must not raise, and attach_hooks shields
the model from it anyway: an exception in the callback is logged once and swallowed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import itertools
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch

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
        unsupported: what the kernel also got that the service has no equivalent for (a
            position bias, a logit soft-cap, sink logits); empty when none.
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
    unsupported: str = ""


class _Sampling(threading.local):
    """How many sampled forwards this thread is inside, all attachments together: the wrappers'
    fast path (an unsampled forward pays one thread-local read per attention call)."""

    depth = 0


_SAMPLING: Final = _Sampling()


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
        sampled = n % self.every == 0
        if sampled and not getattr(self._local, "sampled", False):
            _SAMPLING.depth += 1
        elif not sampled and getattr(self._local, "sampled", False):
            _SAMPLING.depth -= 1  # a forward that ended without its hook (KeyboardInterrupt)
        self._local.sampled = sampled
        return sampled

    def end(self) -> bool:
        """This thread's forward ends; returns whether it was sampled."""
        sampled = bool(getattr(self._local, "sampled", False))
        if sampled:
            _SAMPLING.depth -= 1
        self._local.sampled = False
        return sampled

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
    # As transformers' sdpa_attention_forward decides it (an attention module without the
    # attribute is causal there): the kernel's own causal mask applies only when no mask tensor
    # was built and more than one query is asked.
    is_causal = kw.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    return bool(is_causal) and mask is None and q.shape[2] > 1


# Inputs the service has no equivalent for: the statistics would silently describe another
# attention than the model's, so such calls are counted as failed instead.
_UNSUPPORTED_KWARGS: Final = ("position_bias", "softcap", "sinks", "s_aux")


@dataclass(frozen=True, slots=True)
class _Attachment:
    """One attached model: which modules are its own, its forward gate, its callback."""

    modules: frozenset[int]
    gate: ForwardGate
    on_call: _Shield
    sdpa: bool  # a non-HF model: its calls come through torch's SDPA function


class _Registry:
    """The attachments of this process, and what each interception replaced.

    Interception is keyed by what the model already uses, so that the model runs exactly the
    code it runs untapped: the function registered in transformers' AttentionInterface under
    each implementation name the model uses ("sdpa", "eager", a flash one) is replaced by a
    wrapper for as long as an attached model uses that name (the model's config and its name are
    never touched: transformers branches on the name in places, e.g. GPT-2's reorder-and-upcast
    path on "eager"); torch.nn.functional.scaled_dot_product_attention is replaced while a
    non-HF model is attached. A wrapper passes every call straight through unless it comes from
    a module of an attached model, on a thread whose forward is sampled.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._attachments: list[_Attachment] = []
        self._replaced: dict[str, tuple[Any, int]] = {}  # name -> (original, users)

    def attachment_of(self, module: torch.nn.Module) -> _Attachment | None:
        key = id(module)
        for attachment in self._attachments:  # a short list: one entry per attached model
            if key in attachment.modules:
                return attachment
        return None

    def sdpa_attachments(self) -> list[_Attachment]:
        return [a for a in self._attachments if a.sdpa]

    def add(self, attachment: _Attachment, names: list[str]) -> None:
        with self._lock:
            for name in names:
                original, users = self._replaced.get(name, (None, 0))
                if users == 0:
                    original = _install(name, self)
                self._replaced[name] = (original, users + 1)
            self._attachments.append(attachment)

    def remove(self, attachment: _Attachment, names: list[str]) -> None:
        with self._lock:
            self._attachments.remove(attachment)
            for name in names:
                original, users = self._replaced[name]
                if users == 1:
                    _uninstall(name, original)
                    del self._replaced[name]
                else:
                    self._replaced[name] = (original, users - 1)


_SDPA_NAME: Final = "torch.nn.functional.scaled_dot_product_attention"
_MISSING: Final = object()


def _install(name: str, registry: _Registry) -> Any:
    """Replace what `name` designates by a tapping wrapper; return what it was."""
    if name == _SDPA_NAME:
        original = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = _sdpa_wrapper(original, registry)
        return original
    mapping = importlib.import_module("transformers").AttentionInterface._global_mapping
    original = mapping.get(name, _MISSING)
    # "eager" is not in the registry: each modeling file passes its own eager_attention_forward
    # as get_interface's default, which a registered "eager" overrides. The wrapper then calls
    # the module's own file's function, so composite models keep each part's eager code.
    mapping[name] = _hf_wrapper(None if original is _MISSING else original, registry)
    return original


def _uninstall(name: str, original: Any) -> None:
    if name == _SDPA_NAME:
        torch.nn.functional.scaled_dot_product_attention = original
        return
    mapping = importlib.import_module("transformers").AttentionInterface._global_mapping
    if original is _MISSING:
        mapping.pop(name, None)
    else:
        mapping[name] = original


@functools.cache
def _eager_function(module_file: str) -> Callable[..., Any]:
    """The eager_attention_forward of the modeling file `module_file` (a module's __module__)."""
    found = getattr(sys.modules.get(module_file), "eager_attention_forward", None)
    if not callable(found):
        raise ValueError(f"{module_file}: no eager_attention_forward in it")
    return found  # type: ignore[no-any-return]


# Under torch.compile the wrapper is traced, not run: a tap cannot copy tensors from inside a
# graph, and its locks would break fullgraph tracing. Compiled calls are not sampled.
_compiling: Final = torch.compiler.is_compiling


def _hf_wrapper(original: Callable[..., Any] | None, registry: _Registry) -> Callable[..., Any]:
    def tapped(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        function = original if original is not None else _eager_function(type(module).__module__)
        if _compiling() or not _SAMPLING.depth:
            return function(module, query, key, value, attention_mask, *args, **kwargs)
        attachment = registry.attachment_of(module)
        where = None if attachment is None else attachment.gate.next_call()
        if attachment is not None and where is not None:
            forward, order = where
            layer = getattr(module, "layer_idx", None)
            attn_mask, key_padding_mask = _hf_mask(attention_mask)
            scaling = kwargs.get("scaling")
            unsupported = [k for k in _UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
            attachment.on_call(
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
                    unsupported=", ".join(unsupported),
                )
            )
        return function(module, query, key, value, attention_mask, *args, **kwargs)

    return tapped


def _sdpa_wrapper(original: Callable[..., Any], registry: _Registry) -> Callable[..., Any]:
    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
        if not _compiling() and _SAMPLING.depth:
            _observe_sdpa(registry, args, kwargs)
        return original(*args, **kwargs)

    scaled_dot_product_attention.__doc__ = original.__doc__
    scaled_dot_product_attention.__wrapped__ = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def _observe_sdpa(registry: _Registry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    # The caller is not known here: the call belongs to the attached non-HF model whose forward
    # is running and sampled on this thread.
    for attachment in registry.sdpa_attachments():
        where = attachment.gate.next_call()
        if where is None:
            continue
        try:
            bound = _SDPA_SIGNATURE.bind(*args, **kwargs).arguments
        except TypeError:
            return  # torch itself raises on this call
        forward, order = where
        scale = bound.get("scale")
        attachment.on_call(
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
        return


_REGISTRY: Final = _Registry()


def _hf_names(model: torch.nn.Module) -> list[str]:
    """Every attention implementation name the model's configs use (composite models have one
    per part)."""
    names = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        name = getattr(config, "_attn_implementation", None)
        if isinstance(name, str):
            names.add(name.removeprefix("paged|") if name != "paged|eager" else name)
    return sorted(names)


@contextlib.contextmanager
def attach_hooks(
    model: torch.nn.Module,
    every: int,
    on_call: OnCall,
    on_error: Callable[[BaseException], None],
    on_sampled: Callable[[bool], None] | None = None,
) -> Iterator[ForwardGate]:
    """Call `on_call` for each attention call of every `every`-th forward of `model`, and
    `on_sampled(True)` / `on_sampled(False)` when such a forward begins and ends.

    Yields:
        The ForwardGate that counts the forwards.

    Raises:
        RuntimeError: the model is already attached.
    """
    gate = ForwardGate(every)
    hf = is_hf_model(model)
    attachment = _Attachment(
        modules=frozenset(id(m) for m in model.modules()), gate=gate,
        on_call=_Shield(on_call, on_error), sdpa=not hf,
    )  # fmt: skip
    if any(_REGISTRY.attachment_of(m) is not None for m in model.modules()):
        raise RuntimeError("attach: this model (or a part of it) is already attached")
    names = _hf_names(model) if hf else [_SDPA_NAME]

    # torch.compile traces a compiled module's hooks too: they do nothing there (no forward of
    # a compiled model is sampled, and the sender's lock would break a fullgraph trace).
    def before(module: torch.nn.Module, args: Any) -> None:
        if not _compiling() and gate.begin() and on_sampled is not None:
            on_sampled(True)

    def after(module: torch.nn.Module, args: Any, output: Any) -> None:
        # always_call=True: also when the forward raised
        if not _compiling() and gate.end() and on_sampled is not None:
            on_sampled(False)

    pre = model.register_forward_pre_hook(before)
    post = model.register_forward_hook(after, always_call=True)
    _REGISTRY.add(attachment, names)
    try:
        yield gate
    finally:
        _REGISTRY.remove(attachment, names)
        pre.remove()
        post.remove()
