"""The attention explorer: GET / serves a static page, GET /static/<file> its assets.

Everything under service/static is shipped as package data and served as-is (nothing is built
at run time, no CDN), so the page works on an offline machine. Both routes are left out of the
OpenAPI schema: they are not part of the v1 API, and schema-driven fuzzing should ignore them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from fastapi import APIRouter
from starlette.responses import FileResponse, Response

from service.http_errors import problem_response

router = APIRouter()

STATIC_DIR: Final[Path] = Path(__file__).resolve().parent.parent / "static"

# Only these suffixes are served; anything else under static/ is a 404, not a guess.
_CONTENT_TYPES: Final[dict[str, str]] = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".json": "application/json",
    # Captures from `sdpa-tap capture` (np.savez_compressed): a zip of .npy files, read by
    # the page's own JS (static/capture.js).
    ".npz": "application/zip",
}

# The page loads only its own scripts and styles, and talks only to this origin. `blob:` lets
# the screenshot/export buttons hand a canvas to the browser.
_CSP: Final[str] = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)

_HEADERS: Final[dict[str, str]] = {
    # Assets change with the package, not with a content hash in the name: revalidate each time.
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": _CSP,
}


def resolve_static(name: str, *, root: Path = STATIC_DIR) -> Path | None:
    """The file under `root` that `name` names, or None if it is absent or outside `root`."""
    if not name or "\\" in name or "\x00" in name:
        return None
    root = root.resolve()
    candidate = (root / name).resolve()
    # resolve() follows `..` and symlinks, so the prefix check catches every escape.
    if not candidate.is_relative_to(root) or not candidate.is_file():
        return None
    if candidate.suffix.lower() not in _CONTENT_TYPES:
        return None
    return candidate


def _file_response(path: Path) -> Response:
    return FileResponse(
        path,
        media_type=_CONTENT_TYPES[path.suffix.lower()],
        headers=_HEADERS,
    )


def _not_found(name: str) -> Response:
    return problem_response(status=404, detail=f"no static asset named {name!r}")


@router.get("/", include_in_schema=False)
async def explorer_page() -> Response:
    """The explorer's HTML page."""
    index = resolve_static("index.html")
    if index is None:
        # Only an installation that lost its package data can get here.
        return _not_found("index.html")
    return _file_response(index)


@router.get("/static/{name:path}", include_in_schema=False)
async def explorer_asset(name: str) -> Response:
    """One asset of the page (script, stylesheet, icon)."""
    path = resolve_static(name)
    if path is None:
        return _not_found(name)
    return _file_response(path)
