"""compute="local": a sampled attention call's statistics computed in the model's own process.

sdpa_core's attention(..., diagnostics=...) runs on exactly what the model's kernel received (q,
k, v, the mask, scale, causal flag, grouped kv heads), on the model's own device, with the path
sdpa_core chooses for diagnostics without weights (its flash kernel where it has one, else the
chunked online softmax). Its output is thrown away; the model's own kernel runs unchanged.
The CPU flash kernel is a C++ extension that a process must load (the service does at warm-up):
LocalStatistics loads it (load_cpu_kernel). Without it the chunked path serves (MiniLM, batch
8 x 128, every=1: +34% on one torch thread against the flash kernel's +19%, and +148% against
+47% on two threads of a loaded machine; BENCHMARKS.md).

Where it runs:
- CPU tensors: on the forward's thread, at once (the forward's threads are the CPU's cores
  anyway; a second thread beside it only competes for them, and would need copies of q, k, v).
- CUDA tensors: the forward's thread only queues device copies of the inputs on a side stream
  that waits for the model's stream (a few launches, no wait); the statistics are computed on
  the tap's own thread, on that side stream, so the forward never waits for them.

Only the per-head statistics leave the process (POST /v1/health/observe, service.wire.observe):
each [B, H] field packed as float32 little-endian base64, a few KB per layer.

sdpa_core ships with the server's distribution (sdpa-service), not with sdpa-client: it is
imported when a local tap is made, through importlib (the client's own imports stay numpy and
httpx; tests/client/test_import_boundary.py).
"""

from __future__ import annotations

import base64
import functools
import importlib
import math
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import torch

from sdpa_client.tap.hooks import AttentionCall, Causal

# The per-head statistics sent to the service: what its health metrics record.
SENT_FIELDS: Final = (
    "entropy",
    "normalized_entropy",
    "max_weight",
    "sink_share",
    "score_abs_max_scaled",
    "saturated_fraction",
    "masked_rows",
)


def load_core() -> ModuleType:
    """sdpa_core, or an ImportError saying where it comes from."""
    try:
        return importlib.import_module("sdpa_core")
    except ImportError as exc:
        raise ImportError(
            "AttentionTap(compute='local') computes the statistics with sdpa_core, which ships "
            "with the server's distribution: pip install sdpa-service (or run from its "
            "repository); compute='service' needs only sdpa-client[tap]"
        ) from exc


@dataclass(frozen=True, slots=True)
class Inputs:
    """What the model's kernel received (CUDA: device copies on the side stream)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None
    key_padding_mask: torch.Tensor | None
    scale: float | None
    causal: Causal
    stream: torch.cuda.Stream | None = None  # the side stream the copies were made on


@dataclass(frozen=True, slots=True)
class Statistics:
    """One call's statistics: the LayerReport's parts, and what the service is sent."""

    summary: dict[str, float | int]
    per_head: dict[str, npt.NDArray[Any]]  # each [B, H] (leading dims flattened)
    per_row: dict[str, npt.NDArray[Any]] | None
    n_q: int
    n_kv: int
    path: str
    backend: str | None


def _bias_with_infinities(mask: torch.Tensor | None) -> torch.Tensor | None:
    """An additive mask's lowest finite value (transformers' eager sentinel) read as -inf: the
    weights are the same, and the masked keys count as not visible, as the model means them."""
    if mask is None or not mask.is_floating_point():
        return mask
    return mask.masked_fill(mask <= torch.finfo(mask.dtype).min, -math.inf)


@functools.cache
def load_cpu_kernel() -> tuple[bool, str]:
    """Load sdpa_core's CPU flash kernel in this process, as a service's warm-up does: the
    prebuilt library, else torch's extension cache (about 2 s: cpp_extension checks the build),
    else a compilation (about a minute on 2 CPUs, once per machine and source). (True, "") when
    it runs, else (False, why): then the chunked path serves, in float64, the same statistics
    at about twice the cost or more. Tried once per process (cached: a failed build is not
    retried by every tap made later; build() itself is thread-safe, and sdpa_core logs why it
    failed)."""
    try:
        module = importlib.import_module("sdpa_core.kernels.cpu_flash")
        ok, why = module.build()
    except Exception as exc:  # an sdpa_core without it: the chunked path serves
        return False, f"{type(exc).__name__}: {exc}"
    return bool(ok), str(why)


class LocalStatistics:
    """Computes a call's statistics with sdpa_core where the model runs."""

    def __init__(self, *, diagnostics: str, sink_tokens: int) -> None:
        self._core = load_core()
        self._diagnostics = diagnostics
        self._sink_tokens = sink_tokens
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._lock = threading.Lock()
        # sdpa_core's flash path on the CPU needs its C++ kernel loaded in this process (the
        # service loads it at warm-up; nothing loads it in a model's process). Loaded here,
        # when the tap is made, never on a forward: the tap blocks a forward no longer than
        # its copies take (on a CUDA machine too, whose model may still hand it CPU tensors).
        load_cpu_kernel()

    def inputs(self, call: AttentionCall) -> Inputs:
        """On the forward's thread: the call's inputs as the statistics will read them (CPU: the
        model's own tensors, read at once; CUDA: copies queued on the side stream)."""
        if call.q.device.type != "cuda":
            return Inputs(
                call.q, call.k, call.v, call.attn_mask, call.key_padding_mask, call.scale,
                call.causal,
            )  # fmt: skip
        stream = self._stream(call.q.device)
        stream.wait_stream(torch.cuda.current_stream(call.q.device))
        with torch.cuda.stream(stream):

            def copy(t: torch.Tensor | None) -> torch.Tensor | None:
                if t is None:
                    return None
                out = t.detach().clone()
                if t.device.type == "cuda":
                    t.record_stream(stream)  # the model's memory stays its until the copy ran
                return out

            q, k, v = (copy(t) for t in (call.q, call.k, call.v))
            assert q is not None
            assert k is not None
            assert v is not None
            return Inputs(
                q, k, v, copy(call.attn_mask), copy(call.key_padding_mask), call.scale,
                call.causal, stream,
            )  # fmt: skip

    def compute(self, inputs: Inputs) -> Statistics:
        """The statistics of `inputs` (CPU: on the caller's thread; CUDA: on the side stream)."""
        if inputs.stream is None:
            return self._compute(inputs)
        with torch.cuda.stream(inputs.stream):
            return self._compute(inputs)

    def _compute(self, x: Inputs) -> Statistics:
        with torch.no_grad(), torch.autocast(x.q.device.type, enabled=False):
            result = self._core.attention(
                x.q.detach(), x.k.detach(), x.v.detach(),
                causal=x.causal,
                attn_mask=_bias_with_infinities(x.attn_mask),
                key_padding_mask=x.key_padding_mask,
                scale=x.scale,
                diagnostics=self._diagnostics,
                sink_tokens=self._sink_tokens,
                # The inputs' own pass for NaN/Inf costs a sixth of the statistics on the CPU:
                # the statistics of such inputs are not finite either, checked below instead.
                check_finite=False,
            )  # fmt: skip
        diagnostics = result.diagnostics
        if not all(bool(torch.isfinite(t).all()) for t in diagnostics.per_head.as_dict().values()):
            raise ValueError("the inputs hold NaN or Inf: their statistics are not finite")
        heads = x.q.shape[-3] if x.q.dim() >= 3 else 1
        per_head = {
            name: _numpy(value).reshape(-1, heads)
            for name, value in diagnostics.per_head.as_dict().items()
        }
        per_row = None
        if diagnostics.per_row is not None:
            per_row = {name: _numpy(t) for name, t in diagnostics.per_row.as_dict().items()}
        return Statistics(
            summary=diagnostics.summary.as_dict(),
            per_head=per_head,
            per_row=per_row,
            n_q=int(x.q.shape[-2]),
            n_kv=int(x.k.shape[-2]),
            path=str(result.path),
            backend=getattr(result, "backend", None),
        )

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            if index not in self._streams:
                self._streams[index] = torch.cuda.Stream(device=index)  # type: ignore[no-untyped-call]
            return self._streams[index]


def _numpy(t: torch.Tensor) -> npt.NDArray[Any]:
    return t.detach().cpu().numpy()


def packed(values: npt.NDArray[Any]) -> dict[str, Any]:
    """A [B, H] array as the observe route's packed form: float32, little-endian, base64."""
    data = np.ascontiguousarray(values, dtype="<f4")
    return {
        "dtype": "float32",
        "shape": list(data.shape),
        "b64": base64.b64encode(data.tobytes()).decode("ascii"),
    }


def observation(tag: str, stats: Statistics) -> dict[str, Any]:
    """One observation of POST /v1/health/observe's body."""
    return {
        "tag": tag,
        "visible_keys_max": stats.n_kv,
        "n_q": stats.n_q,
        "per_head": {name: packed(stats.per_head[name]) for name in SENT_FIELDS},
    }
