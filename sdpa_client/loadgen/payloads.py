"""The payloads of a load test: standard attention requests (presets) or a body from a file.

A payload is encoded once, before the run, so that the generator's cost per request is the HTTP
exchange only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from sdpa_client.calls import Protocol, build_attention_body
from sdpa_client.codec import Encoding, encode_body
from sdpa_client.v2 import INFER_PATH, build_infer_request


@dataclass(frozen=True, slots=True)
class Preset:
    """A standard attention request: q, k, v of shape [batch, heads, n, d] (float32)."""

    name: str
    batch: int
    heads: int
    n: int
    d: int
    return_weights: bool
    diagnostics: Literal["none", "summary", "full"]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.n, self.d)

    def arrays(
        self, *, seed: int = 0
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """q, k, v drawn from N(0, 1), seeded: the same bytes for every system and run."""
        rng = np.random.default_rng(seed)
        q, k, v = (rng.standard_normal(self.shape, dtype=np.float32) for _ in range(3))
        return q, k, v  # [B, H, N, D] each

    def request(
        self, *, encoding: Encoding, seed: int = 0, priority: int | None = None
    ) -> dict[str, Any]:
        """The JSON body of this preset's /v1/attention request (with "priority" when given)."""
        q, k, v = self.arrays(seed=seed)
        return build_attention_body(
            q, k, v, return_weights=self.return_weights, diagnostics=self.diagnostics,
            encoding=encoding, priority=priority,
        )  # fmt: skip

    def infer_request(
        self, *, binary: bool, seed: int = 0, priority: int | None = None
    ) -> tuple[bytes, dict[str, str]]:
        """The body and headers of this preset's v2 infer request (binary tensor data, or
        JSON lists; the request parameter "priority" when given)."""
        q, k, v = self.arrays(seed=seed)
        return build_infer_request(
            q, k, v, return_weights=self.return_weights, diagnostics=self.diagnostics,
            binary=binary, priority=priority,
        )  # fmt: skip

    def describe(self) -> str:
        """One line: shape, weights, diagnostics."""
        parts = [f"B={self.batch} H={self.heads} N={self.n} D={self.d}"]
        parts.append("weights" if self.return_weights else "no weights")
        parts.append(f"diagnostics={self.diagnostics}")
        return ", ".join(parts)


# The three payloads the service is benchmarked on (small, medium, large): only medium asks for
# weights and diagnostics; small and large take the fused kernel's path, output only.
PRESETS: dict[str, Preset] = {
    "small": Preset("small", 1, 4, 64, 64, return_weights=False, diagnostics="none"),
    "medium": Preset("medium", 1, 8, 256, 64, return_weights=True, diagnostics="summary"),
    "large": Preset("large", 1, 8, 1024, 64, return_weights=False, diagnostics="none"),
}


@dataclass(frozen=True, slots=True)
class Payload:
    """One pre-encoded request: sent as-is, as many times as the run needs."""

    name: str
    path: str
    body: bytes
    description: str = ""
    # Headers of this request besides the sender's own (v2's Inference-Header-Content-Length).
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_preset(
        cls, preset: Preset, *, encoding: Encoding = "base64", seed: int = 0,
        path: str | None = None, protocol: Protocol = "v1", priority: int | None = None,
    ) -> Payload:  # fmt: skip
        """A preset's request: v1 JSON (encoding: base64 or lists), or v2 (encoding base64:
        binary tensor data; json: JSON lists). `path` None: the protocol's endpoint.
        `priority`: the request's priority level (v1 field, v2 parameter), None for none."""
        level = "" if priority is None else f", priority {priority}"
        if protocol == "v2":
            body, headers = preset.infer_request(
                binary=encoding == "base64", seed=seed, priority=priority
            )
            form = "binary" if encoding == "base64" else "json"
            return cls(
                preset.name, path or INFER_PATH, body, f"{preset.describe()}, v2 {form}{level}",
                tuple(headers.items()),
            )  # fmt: skip
        body = encode_body(preset.request(encoding=encoding, seed=seed, priority=priority))
        description = f"{preset.describe()}, {encoding}{level}"
        return cls(preset.name, path or "/v1/attention", body, description)

    @classmethod
    def from_file(cls, file: Path, *, path: str = "/v1/attention") -> Payload:
        body = file.read_bytes()
        try:
            json.loads(body)
        except ValueError as exc:
            raise ValueError(f"{file}: not JSON ({exc})") from exc
        return cls(file.name, path, body, f"request file {file}")
