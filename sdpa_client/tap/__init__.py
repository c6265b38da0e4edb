"""sdpa_client.tap: watch a live model's attention with sdpa-service.

    from sdpa_client.tap import AttentionTap

    tap = AttentionTap("http://sdpa:8000", model="minilm", every=100)
    with tap.attach(model):
        model(**batch)
    tap.flush(timeout_s=30.0)
    tap.reports    # list[LayerReport]
    tap.stats      # TapStats(forwards, sampled, sent, answered, dropped, failed)
    tap.close()

With compute="local" the statistics are computed in this process by sdpa_core (the server's
distribution) on the model's own device, and only per-head statistics are sent (a few KB per
layer, to POST /v1/health/observe); AttentionTap(None, compute="local") sends nothing.

Importing this module imports torch (the caller's own: the tap runs inside the model's
process); `import sdpa_client` alone never does. Install with `pip install "sdpa-client[tap]"`.
`sdpa-tap` (sdpa_client.tap.cli) runs a Hugging Face model over text with the tap attached.
"""

from __future__ import annotations

from sdpa_client.tap.hooks import AttentionCall
from sdpa_client.tap.tap import AttentionTap, LayerReport, TapStats

__all__ = ["AttentionCall", "AttentionTap", "LayerReport", "TapStats"]
