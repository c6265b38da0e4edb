"""service.runtime.pace on its own: how many slices a long item counts as, and how many tiles its
run is planned in, as the measured pace moves."""

from __future__ import annotations

import math

import pytest

from service.runtime.pace import MAX_TILING_CORRECTION, Pace

SLICE_S = 0.05


def pace_at(seconds_per_work: float) -> Pace:
    """A pace that measured `seconds_per_work` device seconds per estimated second, over so
    much work that the prior no longer counts."""
    pace = Pace(clock=lambda: 0.0)
    pace.note(1e5, 1e5 * seconds_per_work)
    assert pace.seconds_per_work() == pytest.approx(seconds_per_work, rel=1e-3)
    return pace


def test_an_item_within_a_slice_at_the_measured_pace_is_short() -> None:
    assert pace_at(2.0).tiles_for(0.02, SLICE_S) == 0  # 40 ms of device time
    assert pace_at(2.0).tiles_for(0.03, SLICE_S) == 2  # 60 ms: two slices
    assert Pace(clock=lambda: 0.0).tiles_for(10.0, None) == 0  # no slicing at all


def test_its_slices_follow_the_measured_pace_unbounded() -> None:
    """Joining and admission count slices at the measured pace, however far it is from the
    model (FEW_SLICES: a 50-slice item must not pass for one of few)."""
    pace, work = pace_at(50.0), 0.1  # 2 slices by the model, 100 at the pace
    assert pace.tiles_for(work, SLICE_S) == math.ceil(work * pace.seconds_per_work() / SLICE_S)


@pytest.mark.parametrize("per_work", [0.5, 1.0, 3.0])
def test_within_the_bound_the_plan_follows_the_measured_pace(per_work: float) -> None:
    pace, work = pace_at(per_work), 1.0  # 20 slices by the model
    assert pace.plan_tiles(work, SLICE_S) == pace.tiles_for(work, SLICE_S)


def test_a_pace_far_slower_than_the_model_plans_at_most_the_bound_more_tiles() -> None:
    """The soak's feedback: a pace read 50x slow planned 50x the tiles, which, mostly fixed
    cost, made the pace read slower still. The plan stops at MAX_TILING_CORRECTION x the
    model's tiles."""
    work = 0.1  # 2 slices by the model
    assert pace_at(50.0).plan_tiles(work, SLICE_S) == math.ceil(
        work * MAX_TILING_CORRECTION / SLICE_S
    )
    assert pace_at(500.0).plan_tiles(work, SLICE_S) == 8
    assert pace_at(50.0).plan_tiles(0.002, SLICE_S) == 1  # a tile by the model: one, not none


def test_a_pace_far_faster_than_the_model_plans_at_least_the_bound_of_the_tiles() -> None:
    work = 10.0  # 200 slices by the model; at 1/40 of it, 5
    assert pace_at(1 / 40).plan_tiles(work, SLICE_S) == math.ceil(
        work / MAX_TILING_CORRECTION / SLICE_S
    )


def test_tiles_at_two_paces_give_two_standard_deviations_over_the_mean() -> None:
    """Tiles of equal device time at paces 0.5 and 1.5 in turn: by hand, mean 1.0, standard
    deviation 0.5, spread 2 x 0.5 / 1 = 1.0 (the cap); at 0.8 and 1.2, 2 x 0.2 / 1 = 0.4 (the
    half-life's decay tilts the equal weights by under 1%)."""
    for low, high, expected in ((0.5, 1.5, 1.0), (0.8, 1.2, 0.4)):
        pace = Pace(clock=lambda: 0.0)
        for _ in range(20):
            for per_work in (low, high):
                pace.note_tile(0.05 / per_work, 0.05)
        assert pace.spread() == pytest.approx(expected, rel=0.02)


def test_no_spread_before_a_tile() -> None:
    assert Pace(clock=lambda: 0.0).spread() == 0.0
