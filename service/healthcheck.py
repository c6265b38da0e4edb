"""`sdpa-service healthcheck`: exit 0 iff the server's /readyz answers 200.

Pure standard library (urllib), so the container's HEALTHCHECK needs no curl and imports
neither torch nor the app: one probe costs a Python start-up and one loopback request.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

DEFAULT_PORT = 8000


def default_url(port: int = DEFAULT_PORT) -> str:
    """The readiness URL of a server on this host. A server bound to 0.0.0.0 answers here too."""
    return f"http://127.0.0.1:{port}/readyz"


def healthcheck(url: str, timeout_s: float) -> int:
    """0 when GET `url` answers 200, else 1; the reason goes to stderr (Docker keeps it)."""
    if not url.startswith(("http://", "https://")):
        # urlopen would also read file:// and ftp:// URLs; a probe only ever speaks HTTP.
        print(f"unhealthy: {url}: not an http(s) URL", file=sys.stderr)
        return 1
    request = urllib.request.Request(url, method="GET", headers={"User-Agent": "sdpa-healthcheck"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status = int(response.status)
    except urllib.error.HTTPError as exc:
        status = int(exc.code)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    if status == 200:
        return 0
    print(f"unhealthy: {url} answered {status}", file=sys.stderr)
    return 1
