"""POST /v1/health/observe's two body forms: the tap's batch ({"observations": [...]}) and one
observation as the whole body (the design's {"tag", "per_head", "visible_keys_max"}). Both parse
to the same observations, and a one-observation body's errors name its fields where they stand."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

from service.errors import InvalidRequest
from service.wire.observe import OBSERVE_EXAMPLE, parse_observe


def _one() -> dict[str, Any]:
    return copy.deepcopy(OBSERVE_EXAMPLE["observations"][0])


def test_one_observation_as_the_body_parses_as_a_batch_of_one() -> None:
    batch = parse_observe(copy.deepcopy(OBSERVE_EXAMPLE))
    single = parse_observe(_one())
    assert len(single.observations) == 1
    got, want = single.observations[0], batch.observations[0]
    assert (got.tag, got.visible_keys_max, got.n_q) == ("minilm/layer0", 3, 3)
    assert (got.tag, got.visible_keys_max, got.n_q) == (want.tag, want.visible_keys_max, want.n_q)
    np.testing.assert_array_equal(got.per_head.entropy, np.array([[0.95, 1.02]]))
    np.testing.assert_array_equal(got.per_head.max_weight, want.per_head.max_weight)


def test_a_one_observation_bodys_range_error_names_its_own_field() -> None:
    body = _one()
    body["per_head"]["max_weight"] = [[0.5, 1.5]]  # a weight above 1
    with pytest.raises(InvalidRequest) as caught:
        parse_observe(body)
    locs = [e.loc for e in caught.value.errors]
    assert ("body", "per_head", "max_weight") in locs
    assert not caught.value.detail.startswith("observations")
    assert "max_weight" in caught.value.detail


def test_a_one_observation_bodys_typo_is_refused_by_name() -> None:
    body = _one()
    body["visible_key_max"] = body.pop("visible_keys_max")  # a typo, and the field missing
    with pytest.raises(InvalidRequest) as caught:
        parse_observe(body)
    locs = [e.loc for e in caught.value.errors]
    assert ("body", "visible_key_max") in locs
    assert ("body", "visible_keys_max") in locs


def test_the_batchs_errors_keep_their_index() -> None:
    body = copy.deepcopy(OBSERVE_EXAMPLE)
    body["observations"][0]["per_head"]["sink_share"] = [[0.5, -0.5]]
    with pytest.raises(InvalidRequest) as caught:
        parse_observe(body)
    assert ("body", "observations", 0, "per_head", "sink_share") in [
        e.loc for e in caught.value.errors
    ]
