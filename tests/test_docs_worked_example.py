"""docs/concepts.md's worked example says what the service answers: its sink share, 1.0 with the
default sink of 4 keys (all 3 keys of the example) and 0.403 with a sink of 1 key, recomputed
in float64 by hand (softmax of the scaled causal scores) and by sdpa_core as the service runs it
(SDPA_HEALTH_SINK_TOKENS is the engine's sink_tokens)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from sdpa_core import attention
from service.settings import Settings

PAGE = Path(__file__).resolve().parents[1] / "docs" / "concepts.md"


def weights_by_hand() -> np.ndarray:
    """q = k = [[1, 0], [2, 0], [3, 0]], causal, scale 1/sqrt(2): each row's softmax."""
    x = np.array([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]])
    scores = x @ x.T / np.sqrt(2.0)
    scores[np.triu_indices(3, k=1)] = -np.inf
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    return np.asarray(p / p.sum(axis=1, keepdims=True))


@pytest.mark.parametrize(
    ("sink_tokens", "the_page_says"), [(4, "`sink_share` is 1.0"), (1, "it is 0.403 here")]
)
def test_the_worked_example_s_sink_share(sink_tokens: int, the_page_says: str) -> None:
    by_hand = float(weights_by_hand()[:, :sink_tokens].sum(axis=1).mean())
    assert the_page_says in " ".join(PAGE.read_text(encoding="utf-8").split())
    assert the_page_says.endswith((f"{by_hand:.1f}", f"{by_hand:.3f} here"))
    x = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]])
    served = attention(x, x, x, causal=True, diagnostics="summary", sink_tokens=sink_tokens)
    assert served.diagnostics is not None
    assert served.diagnostics.summary.sink_share == pytest.approx(by_hand, abs=1e-6)


def test_the_default_sink_is_4_keys() -> None:
    assert Settings.model_fields["health_sink_tokens"].default == 4
