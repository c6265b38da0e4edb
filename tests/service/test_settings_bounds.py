"""Settings whose bound keeps a per-call cost small, checked at start-up."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.settings import Settings


def test_the_sink_is_at_most_64_tokens() -> None:
    """SDPA_HEALTH_SINK_TOKENS past 64 fails start-up: with key padding the flash path scores
    the sink keys apart, [B, H, N_q, sink_tokens] per call, which a large sink makes N_q x N_kv."""
    assert Settings(health_sink_tokens=64).health_sink_tokens == 64
    with pytest.raises(ValidationError, match="health_sink_tokens"):
        Settings(health_sink_tokens=65)
