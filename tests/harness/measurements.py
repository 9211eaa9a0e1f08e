"""Figures the tests measure (largest differences seen), printed at the end of the run."""

from __future__ import annotations

import torch

LARGEST: dict[str, float] = {}


def record_max(name: str, value: torch.Tensor | float) -> None:
    LARGEST[name] = max(LARGEST.get(name, 0.0), float(value))
