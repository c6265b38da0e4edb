"""When to send a request again: the policy, and the bookkeeping of one call's attempts.

/v1/attention, /v1/analyze and v2's infer are pure functions of their input, so repeating them
is safe, even when a replica died with the request half done. 429 (this tenant's share of the
queue is full: the one 4xx that means "later", with its Retry-After), 502 (a proxy lost the
replica: nginx's or Ray's answer when the one it tried died), 503 (queue full, draining), 504
(deadline passed before compute, or a proxy's gateway timeout), an infrastructure 500 (one
without this service's error envelope: Ray Serve's proxy answers a request whose replica died
with it so, ray-project/ray#47219; the service's own 500 is problem+json or v2's {"error"} and
means a bug, never retried) and connection failures are retried with exponential backoff and
jitter, honouring Retry-After, within
`RetryPolicy.max_attempts` and `RetryPolicy.max_total_s`, and never once the request's own
deadline (its timeout_ms) has passed: its answer could no longer be on time. No other 4xx is
retried: the same request would be refused again. A client-side read timeout is not retried
either: the server may still be computing, and a retry would double its load.

Nothing here sends or sleeps: `Attempts` is told what each attempt gave and answers "done",
"wait this long, then send again", or raises the error to give up with. The sync and async
clients drive it the same way and differ only in how they send and sleep.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from sdpa_client.errors import (
    SDPAConnectionError,
    SDPAReadTimeout,
    SDPARequestError,
    error_from_response,
)

# Failures that happen before the server could have started the work, or that lose the answer
# of a pure computation; ReadTimeout is deliberately absent (see the module docstring).
_RETRYABLE_TRANSPORT = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
    httpx.PoolTimeout,
)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded retries with exponential backoff and jitter.

    Retry n (n = 1 after the first failure) waits `backoff_initial_s * backoff_multiplier**(n-1)`
    capped at `backoff_max_s`, scaled by a random factor in [1 - jitter, 1]; a Retry-After
    header is a floor on the wait, spread upward by at most `retry_after_spread` so clients
    told the same value do not return together. No wait may end later than `max_total_s` after
    the first attempt started: the last error is raised instead.

    Raises:
        ValueError: max_attempts < 1, jitter outside [0, 1], or a negative time.
    """

    max_attempts: int = 4
    backoff_initial_s: float = 0.1
    backoff_multiplier: float = 2.0
    backoff_max_s: float = 5.0
    jitter: float = 1.0
    retry_after_spread: float = 0.1
    max_total_s: float = 60.0
    retry_statuses: frozenset[int] = frozenset({429, 502, 503, 504})
    retry_connection_errors: bool = True
    # A 500 without this service's error envelope: a proxy's or a platform's, not our bug.
    retry_infrastructure_500: bool = True

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError("jitter must be in [0, 1]")
        if self.backoff_initial_s < 0 or self.backoff_max_s < 0 or self.max_total_s < 0:
            raise ValueError("backoff and total times must be >= 0")

    def delay_s(self, retry_number: int, retry_after_s: float | None, rng: random.Random) -> float:
        """Seconds to wait before retry number `retry_number` (1-based).

        Args:
            retry_number: 1 for the first retry.
            retry_after_s: the server's Retry-After, if it sent one: a floor on the wait.
            rng: the source of jitter.

        Returns:
            The wait in seconds.
        """
        base = min(
            self.backoff_max_s,
            self.backoff_initial_s * self.backoff_multiplier ** (retry_number - 1),
        )
        delay = base * (1.0 - self.jitter * rng.random())
        if retry_after_s is not None:
            floor = retry_after_s * (1.0 + self.retry_after_spread * rng.random())
            delay = max(delay, floor)
        return delay

    def should_retry_status(self, status: int) -> bool:
        """Whether an answer with this HTTP status may be retried."""
        return status in self.retry_statuses

    def should_retry_response(self, response: httpx.Response) -> bool:
        """Whether this answer (not a 2xx) may be retried: its status, or a 500 that is not the
        service's (`is_infrastructure_error`)."""
        if self.should_retry_status(response.status_code):
            return True
        return self.retry_infrastructure_500 and is_infrastructure_error(response)

    def should_retry_transport(self, exc: httpx.TransportError) -> bool:
        """Whether a request that got no answer, failing with `exc`, may be retried."""
        return self.retry_connection_errors and isinstance(exc, _RETRYABLE_TRANSPORT)


def is_infrastructure_error(response: httpx.Response) -> bool:
    """A 500 that this service did not write: its errors are problem+json (`status` and
    `detail`) or the Open Inference Protocol's {"error": "..."}; a proxy's 500 (Ray Serve's
    "Internal Server Error", an HTML page) carries neither."""
    if response.status_code != 500:
        return False
    try:
        payload = response.json()
    except (ValueError, UnicodeDecodeError):
        return True
    if not isinstance(payload, dict):
        return True
    problem = payload.get("status") == 500 and isinstance(payload.get("detail"), str)
    return not (problem or isinstance(payload.get("error"), str))


NO_RETRY = RetryPolicy(max_attempts=1)
"""A policy that sends every request once."""


def error_from_transport(exc: httpx.TransportError, *, attempts: int = 1) -> SDPAConnectionError:
    """The typed exception for a request that got no answer (SDPAReadTimeout for a read timeout).

    Args:
        exc: httpx's exception.
        attempts: how many times the request had been sent.

    Returns:
        The `SDPAConnectionError` to raise.
    """
    cls = SDPAReadTimeout if isinstance(exc, httpx.ReadTimeout) else SDPAConnectionError
    name = type(exc).__name__
    return cls(None, name, str(exc) or name, attempts=attempts)


class Attempts:
    """The attempts of one call: what each gave, and whether to try again.

    Args:
        policy: the retry policy.
        retryable: whether this request may be repeated at all (False for probes and GETs).
        answers: statuses other than 2xx that are an answer, not an error (a probe's 503).
        rng: the source of jitter.
        clock: monotonic seconds, for the total time budget.
        deadline_s: the request's own deadline, seconds after the first attempt (its
            timeout_ms): no retry is sent once it would start at or after it.
    """

    def __init__(
        self,
        policy: RetryPolicy,
        *,
        retryable: bool,
        answers: frozenset[int],
        rng: random.Random,
        clock: Callable[[], float],
        deadline_s: float | None = None,
    ) -> None:
        self._policy = policy
        self._deadline_s = deadline_s
        self._retryable = retryable
        self._answers = answers
        self._rng = rng
        self._clock = clock
        self._started = clock()
        self.count = 0
        self._answer: httpx.Response | None = None

    @property
    def answer(self) -> httpx.Response:
        """The answer, once `judge` returned None."""
        if self._answer is None:
            raise RuntimeError("no answer yet: judge() has not returned None")
        return self._answer

    def judge(self, result: httpx.Response | httpx.TransportError) -> float | None:
        """Take one attempt's outcome.

        Args:
            result: the answer, or the transport error that stood for one.

        Returns:
            None when `answer` holds the answer to read; otherwise the seconds to wait before
            sending the same request again.

        Raises:
            SDPARequestError: the typed error, when the outcome is a failure not to retry (or
                the retries are spent); chained to httpx's exception for a transport failure.
        """
        self.count += 1
        error: SDPARequestError
        if isinstance(result, httpx.TransportError):
            error = error_from_transport(result, attempts=self.count)
            retry = self._policy.should_retry_transport(result)
        elif result.is_success or result.status_code in self._answers:
            self._answer = result
            return None
        else:
            error = error_from_response(result, attempts=self.count)
            retry = self._policy.should_retry_response(result)
        delay = self._next_delay(error.retry_after_s) if retry and self._retryable else None
        if delay is not None:
            return delay
        if isinstance(result, httpx.TransportError):
            raise error from result
        raise error

    def _next_delay(self, retry_after_s: float | None) -> float | None:
        if self.count >= self._policy.max_attempts:
            return None
        delay = self._policy.delay_s(self.count, retry_after_s, self._rng)
        resent_at = self._clock() - self._started + delay
        if resent_at > self._policy.max_total_s:
            return None
        if self._deadline_s is not None and resent_at >= self._deadline_s:
            return None
        return delay
