"""The tap's background sender: a bounded queue of samples and the thread that posts them.

The queue is bounded in bytes of host copies not yet answered (`max_queue_bytes`): room is
reserved before a sample is copied, so a full queue costs the forward nothing but the check,
and the sample is dropped and counted instead. The thread posts one sample at a time through
the client's own request builder (the same bodies and answer parsing as SDPAClient), with no
retries: a sample the service cannot answer now is counted as failed, not resent later into a
backlog.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import httpx
import torch

from sdpa_client.calls import Call, RequestBuilder
from sdpa_client.codec import encode_body
from sdpa_client.errors import SDPARequestError, error_from_response
from sdpa_client.tap.host import HostTensors
from sdpa_client.types import AttentionResponse
from sdpa_client.version import __version__

logger = logging.getLogger("sdpa_client.tap")

# The longest a sampled forward holds the sender back (see Sender.hold).
MAX_HOLD_S: Final = 10.0


@dataclass(frozen=True, slots=True)
class Sample:
    """One sampled attention call, copied to host memory, waiting to be sent."""

    forward: int
    layer: int
    tag: str
    host: HostTensors
    scale: float | None
    causal: bool | str
    nbytes: int
    headers: Mapping[str, str] = field(default_factory=dict)


class _V2Builder(RequestBuilder):
    __slots__ = ()
    protocol = "v2"


class Poster:
    """Turns a Sample into one request and its answer (on the sender's thread)."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None,
        protocol: str,
        diagnostics: str,
        timeout_s: float,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"user-agent": f"sdpa-tap/{__version__}"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self._http = httpx.Client(
            base_url=url.rstrip("/"), timeout=timeout_s, headers=headers, transport=transport
        )
        self._builder = _V2Builder() if protocol == "v2" else RequestBuilder()
        self._diagnostics = diagnostics
        self._timeout_ms = timeout_s * 1000.0
        self.last_body_bytes = 0  # the size of the latest observe body (bench/tap.py reads it)

    def post(self, sample: Sample) -> AttentionResponse:
        """Send one sample and read its answer.

        Raises:
            SDPARequestError: an error status, or an answer that cannot be read.
            httpx.HTTPError: no answer.
        """
        host = sample.host
        host.wait()
        call: Call[AttentionResponse] = self._builder.attention(
            host.q, host.k, host.v,
            causal=sample.causal,  # type: ignore[arg-type]
            key_padding_mask=host.key_padding_mask,
            attn_mask=_bias_with_infinities(host.attn_mask),
            scale=sample.scale,
            tag=sample.tag,
            diagnostics=self._diagnostics,  # type: ignore[arg-type]
            return_output=False,
            timeout_ms=self._timeout_ms,
            encoding="base64",
        )  # fmt: skip
        headers: dict[str, str] = dict(call.headers or {})
        content = call.content
        if call.body is not None:
            headers["content-type"] = "application/json"
            content = encode_body(call.body)
        headers.update(sample.headers)
        response = self._http.post(call.path, content=content, headers=headers)
        if not response.is_success:
            raise error_from_response(response)
        return call.read(response)

    def observe(self, body: Mapping[str, Any], headers: Mapping[str, str]) -> Any:
        """POST /v1/health/observe (the tap's local mode): statistics only, never tensors.

        Raises:
            SDPARequestError: an error status.
            httpx.HTTPError: no answer.
        """
        content = encode_body(dict(body))
        self.last_body_bytes = len(content)
        response = self._http.post(
            "/v1/health/observe",
            content=content,
            headers={"content-type": "application/json", **headers},
        )
        if not response.is_success:
            raise error_from_response(response)
        return response.json()

    def close(self) -> None:
        self._http.close()


def _bias_with_infinities(mask: torch.Tensor | None) -> torch.Tensor | None:
    """An additive mask with the dtype's lowest finite value (transformers' eager sentinel) read
    as -inf: the weights are the same (exp underflows to 0 either way), and the service then
    counts those keys as not visible, as the model means them."""
    if mask is None or not mask.is_floating_point():
        return mask
    lowest = torch.finfo(mask.dtype).min
    return mask.masked_fill(mask <= lowest, -math.inf)


class Sender:
    """A bounded queue of samples and the daemon thread that posts them in order.

    With `batch` > 1, the thread takes up to that many queued samples at once and `post` gets
    them as a list and returns one outcome each (an answer, or the exception that sample met):
    the local mode's statistics of a forward's layers go out in one request.
    """

    def __init__(
        self,
        post: Callable[[Any], Any],
        *,
        max_queue_bytes: int,
        on_answer: Callable[[Any, Any], None],
        on_failure: Callable[[Any, BaseException], None],
        batch: int = 1,
    ) -> None:
        self._post = post
        self._batch = batch
        self._max_bytes = max_queue_bytes
        self._on_answer = on_answer
        self._on_failure = on_failure
        self._queue: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._reserved = 0  # bytes of samples queued, being copied or in flight
        self._busy = 0  # reservations not yet resolved (queued, being copied, or in flight)
        self._forwards = 0  # sampled forwards running: the sender waits for them (see hold)
        self._held_since = 0.0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="sdpa-tap-sender", daemon=True)
        self._thread.start()

    def reserve(self, nbytes: int) -> bool:
        """Room for a sample of `nbytes`, before it is copied; False when the queue is full."""
        with self._cond:
            if self._closed or self._reserved + nbytes > self._max_bytes:
                return False
            self._reserved += nbytes
            self._busy += 1
            return True

    def hold(self, running: bool) -> None:
        """A sampled forward begins (True) or ends (False). While one runs, the sender starts
        no new post, unless the queue is over half full: its Python work (encoding, httpx,
        reading answers) would share the GIL and the core with the forward, and on a forward
        that is mostly Python (a GPU model's kernel launches) or on one core it cost several
        times the copy itself. So a sampled forward pays the copy; the sending runs after it,
        in whatever time the process leaves (beside the next forward when they run back to
        back)."""
        with self._cond:
            self._forwards = max(0, self._forwards + (1 if running else -1))
            self._held_since = time.monotonic()
            if not self._forwards:
                self._cond.notify_all()

    def cancel(self, nbytes: int) -> None:
        """Give back a reservation whose sample was never queued (its copy failed)."""
        with self._cond:
            self._release(nbytes)

    def put(self, sample: Any) -> bool:
        """Queue a reserved sample; False (its reservation given back) once the sender closed."""
        with self._cond:
            if self._closed:
                self._release(sample.nbytes)
                return False
            self._queue.append(sample)
            self._cond.notify_all()
            return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until every reserved sample is answered or failed; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float) -> list[Any]:
        """Stop: wait up to `timeout_s` for the queue to drain, then return what was never sent."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            unsent = list(self._queue)
            self._queue.clear()
            for sample in unsent:
                self._release(sample.nbytes)
            self._cond.notify_all()
        self._thread.join(timeout=max(0.0, timeout_s))
        return unsent

    def _deferred(self) -> bool:
        # A forward that never ended (interrupted past its hooks) holds the sender MAX_HOLD_S.
        held = time.monotonic() - self._held_since < MAX_HOLD_S
        return self._forwards > 0 and held and self._reserved * 2 <= self._max_bytes

    def _release(self, nbytes: int) -> None:
        self._reserved -= nbytes
        self._busy -= 1
        self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._queue or self._deferred()):
                    self._cond.wait(None if not self._queue else MAX_HOLD_S)
                if not self._queue:
                    return
                sample = self._queue.popleft()
                group = [sample]
                while self._batch > 1 and self._queue and len(group) < self._batch:
                    group.append(self._queue.popleft())
            if self._batch > 1:
                self._run_group(group)
                continue
            try:
                answer = self._post(sample)
            except (SDPARequestError, httpx.HTTPError) as exc:
                self._resolve(sample, self._on_failure, exc)
            except Exception as exc:  # a bug of ours: counted and logged, the thread goes on
                if not self._closed:  # (closing the client under a post ends it so: expected)
                    logger.exception("tap: a sample could not be sent")
                self._resolve(sample, self._on_failure, exc)
            else:
                self._resolve(sample, self._on_answer, answer)

    def _run_group(self, group: list[Any]) -> None:
        try:
            outcomes = list(self._post(group))
        except Exception as exc:  # a bug of ours: counted and logged, the thread goes on
            if not self._closed:
                logger.exception("tap: a batch could not be sent")
            outcomes = [exc] * len(group)
        for sample, outcome in zip(group, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                self._resolve(sample, self._on_failure, outcome)
            else:
                self._resolve(sample, self._on_answer, outcome)

    def _resolve(self, sample: Any, report: Callable[[Any, Any], None], what: Any) -> None:
        try:
            report(sample, what)
        except Exception:  # a user's on_report must not stop the sender
            logger.exception("tap: on_report raised")
        finally:
            with self._cond:
                self._release(sample.nbytes)
