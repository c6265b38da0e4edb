"""The HTTP floor: a FastAPI endpoint that reads the request body and does nothing with it.

    uvicorn bench.noop_app:app --host 127.0.0.1 --port 8001

POST /v1/attention (and /attention) accepts any body, reads it in full (so the same bytes cross
the loopback as for the real service) and answers a tiny JSON object; it neither parses the JSON
nor computes. Whatever throughput it reaches is the ceiling of one uvicorn worker plus the load
generator on this machine: bench/compare.py reports every system against it.
GET /healthz and /readyz answer 200 so the same readiness wait works for every system.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

app = FastAPI(title="no-op attention endpoint", docs_url=None, redoc_url=None, openapi_url=None)


@app.post("/v1/attention")
@app.post("/attention")
async def attention(request: Request) -> dict[str, object]:
    body = await request.body()
    return {"ok": True, "bytes": len(body)}


@app.get("/healthz")
@app.get("/readyz")
async def health() -> dict[str, str]:
    return {"status": "ok"}
