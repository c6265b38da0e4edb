"""The result types: statistics read by name or attribute, immutable, picklable."""

from __future__ import annotations

import math
import pickle
from collections.abc import Mapping

import pytest

from sdpa_client import (
    Stats,
    StrategyScores,
    SummaryStats,
    parse_analyze_response,
    parse_attention_response,
)
from sdpa_client.fields import SUMMARY_STAT_NAMES

SUMMARY = dict.fromkeys(SUMMARY_STAT_NAMES, 0.5) | {"masked_rows": 2}


def attention_payload(summary: Mapping[str, object]) -> dict[str, object]:
    return {
        "output": [[1.0]],
        "diagnostics": {"summary": summary, "per_head": {"masked_rows": [1.0, 1.0]}},
    }


def test_summary_reads_by_name_and_attribute() -> None:
    result = parse_attention_response(attention_payload(SUMMARY | {"future_stat": 0.25}))
    assert result.diagnostics is not None
    summary = result.diagnostics.summary
    assert isinstance(summary, SummaryStats)
    assert summary.entropy == summary["entropy"] == 0.5
    assert summary.masked_rows == 2
    assert isinstance(summary.masked_rows, int)
    assert summary.extra == {"future_stat": 0.25}  # a newer server's statistic, kept
    assert set(SUMMARY_STAT_NAMES) <= set(dir(summary))
    assert dict(summary) == SUMMARY | {"future_stat": 0.25}
    assert result.diagnostics.per_head["masked_rows"].dtype.kind == "i"
    with pytest.raises(AttributeError, match="no statistic 'entropyy'"):
        _ = summary.entropyy
    with pytest.raises(AttributeError, match="read-only"):
        summary.entropy = 1.0


def test_a_summary_missing_statistics_comes_back_as_a_plain_dict() -> None:
    older = {k: v for k, v in SUMMARY.items() if k != "jacobian_fro"}
    result = parse_attention_response(attention_payload(older))
    assert result.diagnostics is not None
    assert type(result.diagnostics.summary) is dict
    assert result.diagnostics.summary == older


def test_stats_pickle_and_compare() -> None:
    summary = SummaryStats({"entropy": 1.0, "masked_rows": 0})
    back = pickle.loads(pickle.dumps(summary))
    assert type(back) is SummaryStats
    assert back == summary == {"entropy": 1.0, "masked_rows": 0}
    assert repr(back) == "SummaryStats(entropy=1.0, masked_rows=0)"


def test_strategy_scores_read_their_statistics_as_attributes() -> None:
    report = parse_analyze_response(
        {"d_k": 8, "raw_score_variance": 8.0, "recommended_divisor": 2.83,
         "strategies": [{"name": "sqrt_dk", "divisor": 2.83, "score_variance": 1.0,
                         "entropy": 2.0, "normalized_entropy": 0.9, "max_weight": 0.3,
                         "saturated_fraction": None, "grad_health": 0.1}]}
    )  # fmt: skip
    (scores,) = report.strategies
    assert (scores.name, scores.divisor, scores.entropy) == ("sqrt_dk", 2.83, 2.0)
    assert scores.stats["score_variance"] == scores.score_variance == 1.0
    assert math.isnan(scores.saturated_fraction)
    assert "grad_health" in dir(scores)
    back = pickle.loads(pickle.dumps(scores))
    assert back.name == "sqrt_dk"
    assert back.entropy == 2.0
    plain = StrategyScores("t2", 2.0, Stats({"entropy": 1.0}))
    assert pickle.loads(pickle.dumps(plain)) == plain != StrategyScores("t3", 2.0, plain.stats)
    # Frozen results are hashable, as the old client's were: usable as keys and in sets.
    assert len({plain, StrategyScores("t2", 2.0, Stats({"entropy": 1.0}))}) == 1
    with pytest.raises(AttributeError):
        _ = scores.no_such_statistic
