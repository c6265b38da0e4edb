"""Which torch device the service computes on."""

from __future__ import annotations

import torch


def resolve_device(spec: str) -> torch.device:
    """'auto' -> cuda when available else cpu; 'cpu'; 'cuda' / 'cuda:N' (must exist).

    Raises:
        RuntimeError: the device asked for does not exist here (start-up fails with it).
    """
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {spec!r} requested but CUDA is not available")
        index = device.index if device.index is not None else 0
        if index >= torch.cuda.device_count():
            raise RuntimeError(
                f"device {spec!r} requested but only {torch.cuda.device_count()} CUDA devices"
            )
    elif device.type != "cpu":
        raise RuntimeError(f"unsupported device {spec!r} (auto, cpu, cuda or cuda:N)")
    return device
