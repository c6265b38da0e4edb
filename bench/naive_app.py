"""The tutorial baseline: attention behind FastAPI the way most examples write it.

    uvicorn bench.naive_app:app --host 127.0.0.1 --port 8002

- Tensors travel as nested JSON lists, validated by a pydantic model
  (list[list[list[list[float]]]]).
- The formula softmax(Q K^T / sqrt(d)) V in torch, in an `async def` route: the compute runs in
  the event loop, one request at a time, with no batching.
- The response is a pydantic model too (nested lists), serialized by FastAPI.

It is not a strawman: pydantic-core validates and serializes the lists in Rust, and the torch
math is the same matmul/softmax any implementation runs. What it lacks is what the service adds:
a binary encoding (base64), compute off the event loop, and batching. It takes the body that
`sdpa-loadtest --encoding json` sends ({"dtype", "shape", "data"} tensors) or bare nested lists.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, field_validator

Tensor4D = list[list[list[list[float]]]]


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    q: Tensor4D
    k: Tensor4D
    v: Tensor4D
    return_weights: bool = False

    @field_validator("q", "k", "v", mode="before")
    @classmethod
    def _unwrap(cls, value: Any) -> Any:
        # Accept sdpa-service's {"dtype", "shape", "data"} object as well as a bare list.
        return value["data"] if isinstance(value, dict) else value


class Response(BaseModel):
    output: Tensor4D
    weights: Tensor4D | None = None


app = FastAPI(title="naive attention", docs_url=None, redoc_url=None, openapi_url=None)


@app.post("/v1/attention", response_model=Response)
@app.post("/attention", response_model=Response)
async def attention(req: Request) -> Response:
    q = torch.tensor(req.q)  # [B, H, N_q, D]
    k = torch.tensor(req.k)  # [B, H, N_kv, D]
    v = torch.tensor(req.v)  # [B, H, N_kv, D_v]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, H, N_q, N_kv]
    weights = torch.softmax(scores, dim=-1)  # [B, H, N_q, N_kv]
    output = weights @ v  # [B, H, N_q, D_v]
    return Response(
        output=output.tolist(), weights=weights.tolist() if req.return_weights else None
    )


@app.get("/healthz")
@app.get("/readyz")
async def health() -> dict[str, str]:
    return {"status": "ok"}
