"""sdpa_client: the client of sdpa-service, scaled dot-product attention over HTTP.

    from sdpa_client import SDPAClient

    with SDPAClient("http://127.0.0.1:8000", api_key="...") as client:
        result = client.attention(q, k, v, causal=True, diagnostics="summary")
        result.output                       # np.ndarray [..., H, N_q, D_v]
        result.diagnostics.summary.entropy

`AsyncSDPAClient` has the same methods as coroutines. `SDPAClient(url, protocol="v2")` sends
attention through the Open Inference Protocol with binary tensor data (`sdpa_client.v2`).
Tensors are numpy arrays, or torch tensors when the caller has imported torch (this package
never imports it). It needs numpy and httpx
only. The load generator is `sdpa-loadtest` (`sdpa_client.loadtest`), its core
`sdpa_client.loadgen`.
"""

from __future__ import annotations

from sdpa_client.bodies import Causal, DiagnosticsLevel, StrategySpec
from sdpa_client.calls import Protocol, build_analyze_body, build_attention_body
from sdpa_client.client import DEFAULT_TIMEOUT, AsyncSDPAClient, SDPAClient
from sdpa_client.codec import Encoding, decode_tensor, encode_body, encode_tensor
from sdpa_client.errors import (
    FieldProblem,
    SDPAAuthError,
    SDPAClientError,
    SDPAConnectionError,
    SDPAPayloadTooLarge,
    SDPAProtocolError,
    SDPARateLimited,
    SDPAReadTimeout,
    SDPARequestError,
    SDPAServerError,
    SDPATimeout,
    SDPAUnavailable,
    SDPAUnsupportedMediaType,
    SDPAValidationError,
    error_from_response,
    parse_retry_after,
)
from sdpa_client.retry import NO_RETRY, RetryPolicy
from sdpa_client.types import (
    AnalyzeResponse,
    AttentionResponse,
    DiagnosticsReport,
    ResponseMeta,
    Stats,
    StrategyScores,
    SummaryStats,
    parse_analyze_response,
    parse_attention_response,
)
from sdpa_client.v2 import build_infer_request, parse_infer_response
from sdpa_client.version import __version__

__all__ = [
    "DEFAULT_TIMEOUT",
    "NO_RETRY",
    "AnalyzeResponse",
    "AsyncSDPAClient",
    "AttentionResponse",
    "Causal",
    "DiagnosticsLevel",
    "DiagnosticsReport",
    "Encoding",
    "FieldProblem",
    "Protocol",
    "ResponseMeta",
    "RetryPolicy",
    "SDPAAuthError",
    "SDPAClient",
    "SDPAClientError",
    "SDPAConnectionError",
    "SDPAPayloadTooLarge",
    "SDPAProtocolError",
    "SDPARateLimited",
    "SDPAReadTimeout",
    "SDPARequestError",
    "SDPAServerError",
    "SDPATimeout",
    "SDPAUnavailable",
    "SDPAUnsupportedMediaType",
    "SDPAValidationError",
    "Stats",
    "StrategyScores",
    "StrategySpec",
    "SummaryStats",
    "__version__",
    "build_analyze_body",
    "build_attention_body",
    "build_infer_request",
    "decode_tensor",
    "encode_body",
    "encode_tensor",
    "error_from_response",
    "parse_analyze_response",
    "parse_attention_response",
    "parse_infer_response",
    "parse_retry_after",
]
