"""The service's version: read from the installed package's metadata, written nowhere else."""

from __future__ import annotations

from importlib import metadata
from typing import Final


def _installed_version() -> str:
    try:
        return metadata.version("sdpa-service")
    except metadata.PackageNotFoundError:  # a checkout that was never installed
        return "0.0.0+unknown"


VERSION: Final = _installed_version()
