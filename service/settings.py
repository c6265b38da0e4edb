"""Service settings, read from the environment (prefix SDPA_) only when create_app() runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

MiB = 1024 * 1024


class Settings(BaseSettings):
    """Every knob of the service. Bounds are validated: a bad value fails start-up."""

    model_config = SettingsConfigDict(env_prefix="SDPA_", extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # auto = cuda when available, else cpu.
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")

    max_batch_size: int = Field(default=32, ge=1, le=4096)
    max_batch_delay_ms: float = Field(default=0.0, ge=0.0, le=10_000.0)
    max_queue: int = Field(default=1024, ge=1, le=1_000_000)
    request_timeout_ms: float = Field(default=30_000.0, gt=0.0, le=3_600_000.0)

    max_body_bytes: int = Field(default=128 * MiB, ge=1024, le=16 * 1024 * MiB)
    max_elements: int = Field(default=2**26, ge=1, le=2**34)
    max_weights_elements: int = Field(default=2**26, ge=1, le=2**36)

    # Comma-separated keys, or a JSON list. Empty = authentication off.
    api_keys: Annotated[tuple[SecretStr, ...], NoDecode] = ()
    # A file with one key per line ('#' comments allowed); merged with api_keys.
    api_keys_file: Path | None = None

    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    drain_timeout_s: float = Field(default=30.0, ge=0.0, le=3600.0)

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower_log_level(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_api_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(key.strip() for key in value.split(",") if key.strip())
        return value

    def resolved_api_keys(self) -> frozenset[str]:
        """All configured keys: SDPA_API_KEYS plus the lines of SDPA_API_KEYS_FILE."""
        keys = {key.get_secret_value() for key in self.api_keys}
        if self.api_keys_file is not None:
            for line in self.api_keys_file.read_text(encoding="utf-8").splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.add(line)
        return frozenset(keys)
