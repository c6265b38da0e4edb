"""GET / and /static/<file>: the explorer's static files, served offline and kept out of OpenAPI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.api import ui
from service.api.ui import STATIC_DIR, resolve_static


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    app.include_router(ui.router)
    return TestClient(app)


def test_root_serves_the_explorer_page(client: TestClient) -> None:
    response = client.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/html; charset=utf-8"
    assert response.text == (STATIC_DIR / "index.html").read_text(encoding="utf-8")
    assert response.headers["x-content-type-options"] == "nosniff"
    csp = response.headers["content-security-policy"]
    assert "script-src 'self'" in csp
    assert "connect-src 'self'" in csp


@pytest.mark.parametrize(
    ("name", "content_type"),
    [
        ("app.js", "text/javascript; charset=utf-8"),
        ("npy.js", "text/javascript; charset=utf-8"),
        ("capture.js", "text/javascript; charset=utf-8"),
        ("run.js", "text/javascript; charset=utf-8"),
        # The capture the page opens on: a zip of .npy files, read by capture.js.
        ("capture/minilm-sentence.npz", "application/zip"),
        ("style.css", "text/css; charset=utf-8"),
        ("favicon.svg", "image/svg+xml"),
    ],
)
def test_assets_have_their_content_type(client: TestClient, name: str, content_type: str) -> None:
    response = client.get(f"/static/{name}")
    assert response.status_code == 200
    assert response.headers["content-type"] == content_type
    assert response.content == (STATIC_DIR / name).read_bytes()


def _references(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".html":
        return re.findall(r'(?:src|href)="([^"]+)"', text)
    # ES module imports: `from "./x.js"`.
    return re.findall(r'from\s+"([^"]+)"', text)


def test_every_reference_is_local_and_served(client: TestClient) -> None:
    """Nothing points at a CDN, and every script/stylesheet/icon the page names resolves."""
    seen: set[str] = set()
    for source in [STATIC_DIR / "index.html", *sorted(STATIC_DIR.glob("*.js"))]:
        for ref in _references(source):
            assert "://" not in ref, f"{source.name} -> {ref}"
            assert not ref.startswith("//"), f"{source.name} -> {ref}"
            url = ref if ref.startswith("/") else f"/static/{ref.removeprefix('./')}"
            seen.add(url)
    assert {"/static/app.js", "/static/style.css", "/static/tensor.js"} <= seen
    # Every module of the page is imported by some other (none is left behind by the split).
    modules = {f"/static/{path.name}" for path in STATIC_DIR.glob("*.js")}
    assert modules <= seen, modules - seen
    # The default capture, named in capture.js as a URL rather than an import.
    capture_js = (STATIC_DIR / "capture.js").read_text(encoding="utf-8")
    default = re.search(r'DEFAULT_CAPTURE_URL = "([^"]+)"', capture_js)
    assert default is not None
    seen.add(default.group(1))
    for url in sorted(seen):
        assert client.get(url).status_code == 200, url


@pytest.mark.parametrize(
    "path",
    [
        "/static/nope.js",
        "/static/",
        "/static/..%2Froutes%2Fui.py",
        "/static/%2e%2e/routes/ui.py",
        "/static/../__init__.py",
    ],
)
def test_unknown_or_escaping_paths_are_problem_404(client: TestClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 404
    if response.headers["content-type"].startswith("application/problem+json"):
        assert response.json()["status"] == 404


def test_resolve_static_refuses_escapes_and_unknown_suffixes(tmp_path: Path) -> None:
    root = tmp_path / "static"
    root.mkdir()
    (root / "page.html").write_text("<p>hi</p>", encoding="utf-8")
    (root / "secret.py").write_text("x = 1", encoding="utf-8")
    (tmp_path / "outside.js").write_text("1", encoding="utf-8")
    (root / "link.js").symlink_to(tmp_path / "outside.js")

    assert resolve_static("page.html", root=root) == (root / "page.html").resolve()
    assert resolve_static("secret.py", root=root) is None  # suffix not served
    assert resolve_static("../outside.js", root=root) is None
    assert resolve_static("link.js", root=root) is None  # symlink out of the root
    assert resolve_static("", root=root) is None
    assert resolve_static("missing.html", root=root) is None
    # Nested folders are served (the capture lives in static/capture/); their README is not.
    (root / "capture").mkdir()
    (root / "capture" / "x.npz").write_bytes(b"PK")
    (root / "capture" / "README.md").write_text("notes", encoding="utf-8")
    assert resolve_static("capture/x.npz", root=root) == (root / "capture" / "x.npz").resolve()
    assert resolve_static("capture/README.md", root=root) is None


def test_create_app_serves_the_page_and_keeps_it_out_of_openapi() -> None:
    from service.app import create_app
    from service.settings import Settings

    app = create_app(Settings(device="cpu"))
    paths = app.openapi()["paths"]
    assert "/" not in paths
    assert not [p for p in paths if p.startswith("/static")]
    # Through the whole middleware stack (no lifespan: the page needs no engine).
    response = TestClient(app).get("/static/style.css")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/css; charset=utf-8"
    capture = TestClient(app).get("/static/capture/minilm-sentence.npz")
    assert capture.status_code == 200
    assert capture.headers["content-type"] == "application/zip"
    assert capture.content[:2] == b"PK"
    page = TestClient(app).get("/")
    assert page.status_code == 200
    assert '<canvas id="heatmap"' in page.text
