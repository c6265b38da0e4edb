"""This package's version, read from the metadata of the distribution that installed it."""

from __future__ import annotations

from importlib import metadata
from typing import Final

DISTRIBUTIONS: Final = ("sdpa-client", "sdpa-service")
"""The client installs alone as sdpa-client, and ships inside the server's sdpa-service."""

UNKNOWN_VERSION: Final = "0+unknown"
"""The version of a checkout that was never installed: there is no metadata to read."""


def installed_version() -> str:
    """The version of the first of DISTRIBUTIONS that is installed, else UNKNOWN_VERSION."""
    for name in DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return UNKNOWN_VERSION


__version__: Final = installed_version()
