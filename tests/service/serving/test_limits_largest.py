"""Every size refusal names the largest size that fits (issue 29), and that size is what the
same preparation accepts while one more is refused: the elements limit, the weights (scores)
limit and the work limit, through serving.prepare on bodies as a client sends them."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from service.errors import InvalidRequest
from service.serving.prepare import prepare_analyze, prepare_attention
from tests.service.serving.test_prepare import COST  # its device: 100 GFLOP/s fused
from tests.support.app import small_settings

SETTINGS = small_settings()  # SDPA_MAX_ELEMENTS = SDPA_MAX_WEIGHTS_ELEMENTS = 65536


def synthetic(n_q: int, n_k: int, d_k: int) -> bytes:
    return json.dumps({"synthetic": {"n_q": n_q, "n_k": n_k, "d_k": d_k}}).encode()


def refusal(call: object, *args: object, **kwargs: object) -> str:
    with pytest.raises(InvalidRequest) as raised:
        call(*args, **kwargs)  # type: ignore[operator]
    return str(raised.value.errors[0].msg)


def named(pattern: str, msg: str) -> int:
    found = re.search(pattern, msg)
    assert found, f"no {pattern!r} in: {msg}"
    return int(found.group(1))


def test_the_issue_s_65536_square_names_the_largest_square() -> None:
    # d_k = 1: the elements fit (65536 each), the 2^32 scores do not.
    msg = refusal(prepare_analyze, synthetic(65536, 65536, 1), SETTINGS, COST)
    n = named(r"n_q = n_k = (\d+)", msg)
    assert n == 256  # sqrt(65536): independent arithmetic
    assert named(r"n_k = (\d+) at n_q = 65536", msg) == 1
    prepare_analyze(synthetic(n, n, 1), SETTINGS, COST)  # accepted
    refusal(prepare_analyze, synthetic(n + 1, n + 1, 1), SETTINGS, COST)
    refusal(prepare_analyze, synthetic(n, n + 1, 1), SETTINGS, COST)


def test_the_elements_limit_names_the_largest_count() -> None:
    msg = refusal(prepare_analyze, synthetic(65536, 8, 64), SETTINGS, COST)
    n = named(r"the largest that fits: n_q = (\d+)", msg)
    assert n == 65536 // 64
    prepare_analyze(synthetic(n, 8, 64), SETTINGS, COST)
    refusal(prepare_analyze, synthetic(n + 1, 8, 64), SETTINGS, COST)


def _attention(n_q: int, n_kv: int, d: int, **options: object) -> bytes:
    q = np.zeros((n_q, d), dtype=np.float32).tolist()
    k = np.zeros((n_kv, d), dtype=np.float32).tolist()
    return json.dumps({"q": q, "k": k, "v": k, **options}).encode()


def test_the_weights_limit_names_the_largest_keys_at_these_queries() -> None:
    msg = refusal(prepare_attention, _attention(300, 300, 4, return_weights=True), SETTINGS, COST)
    n_kv = named(r"N_kv = (\d+) at N_q = 300", msg)
    assert n_kv == 65536 // 300
    prepare_attention(_attention(300, n_kv, 4, return_weights=True), SETTINGS, COST)
    refusal(prepare_attention, _attention(300, n_kv + 1, 4, return_weights=True), SETTINGS, COST)


def test_the_work_limit_names_the_largest_square() -> None:
    settings = small_settings(max_request_flops=2e7, max_weights_elements=1 << 20)
    # The analysis at d_k = 8: 2·max(8, 32) + 16 per strategy pass FLOPs per score, at 100x the
    # fused path's cost per FLOP; the message's numbers are checked by preparing them.
    msg = refusal(prepare_analyze, synthetic(512, 512, 8), settings, COST)
    assert "SDPA_MAX_REQUEST_FLOPS" in msg
    n = named(r"N_q = N_kv = (\d+)", msg)
    at_512 = named(r"N_kv = (\d+) at N_q = 512", msg)
    assert 0 < n < 512
    prepare_analyze(synthetic(n, n, 8), settings, COST)
    refusal(prepare_analyze, synthetic(n + 1, n + 1, 8), settings, COST)
    prepare_analyze(synthetic(512, at_512, 8), settings, COST)
    refusal(prepare_analyze, synthetic(512, at_512 + 1, 8), settings, COST)


def test_the_output_limit_names_the_largest_query_count() -> None:
    def request(n_q: int) -> bytes:
        q = np.zeros((n_q, 4), dtype=np.float32).tolist()
        k = np.zeros((8, 4), dtype=np.float32).tolist()
        v = np.zeros((8, 64), dtype=np.float32).tolist()  # D_v = 64: the output outgrows q
        return json.dumps({"q": q, "k": k, "v": v}).encode()

    msg = refusal(prepare_attention, request(2000), SETTINGS, COST)
    n_q = named(r"the largest that fits: N_q = (\d+)", msg)
    assert n_q == 65536 // 64
    prepare_attention(request(n_q), SETTINGS, COST)
    refusal(prepare_attention, request(n_q + 1), SETTINGS, COST)
