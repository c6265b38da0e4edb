"""The HTTP floor: a FastAPI endpoint that reads the request body and does nothing with it.

    uvicorn bench.noop_app:app --host 127.0.0.1 --port 8001

POST /v1/attention (and /attention) accepts any body, reads it in full (so the same bytes cross
the loopback as for the real service) and answers a small JSON object, or, with `?reply=N`, a
JSON object of N bytes (so the answer can weigh what the service's answer weighs). It neither
parses the request nor computes. Whatever throughput it reaches is the ceiling of one uvicorn
worker plus the load generator on this machine: bench/compare.py reports every system against
it. GET /healthz and /readyz answer 200 so the same readiness wait works for every system.
"""

from __future__ import annotations

import functools

from fastapi import FastAPI, Query, Request, Response

MAX_REPLY_BYTES = 256 * 1024 * 1024

app = FastAPI(title="no-op attention endpoint", docs_url=None, redoc_url=None, openapi_url=None)


@functools.lru_cache(maxsize=32)
def reply_body(size: int) -> bytes:
    """A JSON object of exactly `size` bytes (or the smallest one, when size is below it)."""
    head, tail = b'{"ok":true,"pad":"', b'"}'
    return head + b"x" * max(0, size - len(head) - len(tail)) + tail


@app.post("/v1/attention")
@app.post("/attention")
async def attention(request: Request, reply: int = Query(0, ge=0, le=MAX_REPLY_BYTES)) -> Response:
    await request.body()
    return Response(reply_body(reply), media_type="application/json")


@app.get("/healthz")
@app.get("/readyz")
async def health() -> dict[str, str]:
    return {"status": "ok"}
