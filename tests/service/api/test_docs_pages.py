"""GET /docs and GET /redoc are served whole by the service: no CDN (a cluster without internet
access still gets working API docs). The pages are rendered in a real browser by
test_explorer_browser.py; here, over HTTP (in process), every asset they name is checked to come
from the service itself.
"""

from __future__ import annotations

import re

import httpx
import pytest

from service.app import DOCS_ASSETS

# src, href and ReDoc's spec-url attributes, and the OpenAPI url handed to Swagger UI's script.
_REFERENCES = re.compile(r"""(?:src|href|spec-url)="([^"]+)"|url: '([^']+)'""")


def referenced_urls(html: str) -> list[str]:
    return [a or b for a, b in _REFERENCES.findall(html)]


@pytest.mark.parametrize(
    ("page", "wanted"),
    [
        ("/docs", {"swagger-ui-bundle.js", "swagger-ui.css", "openapi.json"}),
        ("/redoc", {"redoc.standalone.js", "openapi.json"}),
    ],
)
def test_docs_pages_load_every_asset_from_the_service(
    client: httpx.Client, page: str, wanted: set[str]
) -> None:
    response = client.get(page)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    urls = referenced_urls(response.text)
    assert {url.rsplit("/", 1)[-1] for url in urls} >= wanted
    for url in urls:
        # Same origin: a path on this server, never another host (FastAPI's default pages
        # load their scripts from cdn.jsdelivr.net).
        assert url.startswith("/"), url
        assert not url.startswith("//"), url
        asset = client.get(url)
        assert asset.status_code == 200, url
        if url.endswith(".js"):
            assert "javascript" in asset.headers["content-type"]
            assert len(asset.content) > 100_000  # the real bundle, not a stub
        elif url.endswith(".css"):
            assert asset.headers["content-type"].startswith("text/css")
        elif url.endswith("openapi.json"):
            assert "/v1/attention" in asset.json()["paths"]
    # Google fonts would be another outside request.
    assert "fonts.googleapis" not in response.text


def test_unknown_docs_asset_is_a_404_problem_labelled_by_its_mount(client: httpx.Client) -> None:
    response = client.get(f"{DOCS_ASSETS}/nope.js")
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["status"] == 404
    metrics = client.get("/metrics").text
    # The assets are a mounted app, which sets no route: the label is the mount path, so
    # that dashboards see the docs assets (not "unmatched").
    labels = f'route="{DOCS_ASSETS}",status="404",tenant="anonymous"'
    assert f"sdpa_requests_total{{{labels}}}" in metrics
