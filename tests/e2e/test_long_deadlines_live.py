"""Long requests that share a deadline, against a real server: what is admitted finishes.

Eight synthetic /v1/analyze requests of about 0.4 s of device time each (3072 x 3072 scores,
d_k 64: eight slices of SDPA_SLICE_MS) are sent at once, with a timeout_ms in the issue's
ratio to one request's device time (1.5 s to 0.38 s): three could meet it one after the
other, four could not. Taking turns without regard to deadlines, all eight progressed
together and none finished (the issue measured 0 of 8); ordered and admitted by deadline
(service.runtime.turns: Deadlines of long items), at least one answers 200 (three on a steady
machine: the test says why), the others 503 with Retry-After at once or 504, never 500. The
bounds are loose (CI runs two test workers on two cores); the figures are in
bench/long_deadlines.py. Run with `-s` to see them.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.support.live_server import LiveServer, live_server

pytestmark = pytest.mark.slow

ANALYZE = {"synthetic": {"n_q": 3072, "n_k": 3072, "d_k": 64, "std": 1.0, "seed": 0}}
CLIENTS = 8
# The ratio of the deadline to one request's device time: 3 in order fit, 4 do not.
FACTOR = 1.5 / 0.38


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server({}, tmp_path=tmp_path_factory.mktemp("deadlines")) as live:
        yield live


def rejected(server: LiveServer, reason: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(rf'^sdpa_rejected_total\{{reason="{reason}"\}} (\S+)$', text, re.M)
    return 0.0 if match is None else float(match.group(1))


def compute_seconds(server: LiveServer) -> float:
    """One request's device time, as the server reports it (the median of three, which also
    teaches the server's pace this request's size)."""
    times = []
    with httpx.Client(timeout=60) as client:
        for _ in range(3):
            response = client.post(f"{server.url}/v1/analyze", json=ANALYZE)
            assert response.status_code == 200, response.text
            times.append(response.json()["meta"]["compute_ms"] / 1e3)
    return float(statistics.median(times))


@dataclass
class Answer:
    status: int
    seconds: float
    retry_after: str | None
    detail: str


def send_at_once(server: LiveServer, timeout_ms: float) -> list[Answer]:
    """CLIENTS requests on their own connections, released together."""
    answers: list[Answer | None] = [None] * CLIENTS
    clients = [httpx.Client(timeout=60) for _ in range(CLIENTS)]
    for client in clients:  # connected first, so that the requests leave together
        assert client.get(f"{server.url}/healthz").status_code == 200
    barrier = threading.Barrier(CLIENTS)
    body = {**ANALYZE, "timeout_ms": timeout_ms}

    def post(i: int) -> None:
        barrier.wait(timeout=30)
        started = time.perf_counter()
        response = clients[i].post(f"{server.url}/v1/analyze", json=body)
        detail = "" if response.status_code == 200 else response.json().get("detail", "")
        answers[i] = Answer(
            response.status_code,
            time.perf_counter() - started,
            response.headers.get("retry-after"),
            detail,
        )

    threads = [threading.Thread(target=post, args=(i,)) for i in range(CLIENTS)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        for client in clients:
            client.close()
    assert all(answer is not None for answer in answers), "a request never answered"
    return [answer for answer in answers if answer is not None]


def one_round(server: LiveServer) -> list[Answer]:
    """One request's device time measured, then CLIENTS at once with the issue's deadline;
    every answer checked (none but 200, a 503 refused at once with Retry-After, a 504)."""
    one_s = compute_seconds(server)
    timeout_s = FACTOR * one_s
    refused_before = rejected(server, "deadline_unreachable")
    answers = send_at_once(server, timeout_s * 1e3)
    refused = rejected(server, "deadline_unreachable") - refused_before
    in_order = sorted(answers, key=lambda answer: answer.seconds)
    print(
        f"\none request {one_s:.3f} s of device time, timeout {timeout_s:.3f} s: "
        + ", ".join(f"{a.status} in {a.seconds:.2f} s" for a in in_order)
        + f"; refused by deadline: {refused:.0f}"
        + "".join(f"\n  {a.detail}" for a in answers if a.status == 503)[:400]
    )
    statuses = [answer.status for answer in answers]
    assert set(statuses) <= {200, 503, 504}, answers
    for answer in answers:
        if answer.status == 200:
            assert answer.seconds < timeout_s + 1.0
        elif answer.status == 503:
            assert answer.retry_after is not None
            assert 1 <= int(answer.retry_after) <= 60
            assert "deadline" in answer.detail
            assert answer.seconds < 1.0  # refused at once, not after waiting
        else:
            assert "deadline" in answer.detail
    assert refused == statuses.count(503)
    return answers


def test_eight_long_requests_sharing_a_deadline_three_could_meet_in_order(
    server: LiveServer,
) -> None:
    """timeout_ms = 3.95 requests' device time: three in order fit at the mean pace, four do
    not. Every answer is a 200 within its deadline (plus a loose second), a 503 at once with
    Retry-After (counted as deadline_unreachable) or a 504, none a 500; and at least one is a 200
    (taking turns as before this admission, 0 of 8 finished in every round of
    bench/long_deadlines.py).

    How many more are admitted is the machine's, not the test's, to say: admission keeps a
    margin for the spread of the measured pace (service.runtime.pace: two standard deviations
    of the tiles' pace, at most 100%), so the second and third are admitted where that
    spread is under 97% and 32% (2 and 3 times one request's time, by 1 + spread, within 3.95
    times it) and refused where it is more. On a quiet machine three
    answer; under CI's two test workers on two cores the spread reached its cap and one did, in
    both rounds (the refusals say the spread they counted: run with -s). The first always fits:
    at twice the mean pace it takes half its deadline. A second round when the first finished
    fewer than three."""
    finished = [sum(answer.status == 200 for answer in one_round(server))]
    if finished[0] < 3:
        finished.append(sum(answer.status == 200 for answer in one_round(server)))
    assert max(finished) >= 1, finished
    assert "Traceback" not in server.log()
