"""Argument checks shared by the reference gathers (and the kernels that mirror them)."""

from __future__ import annotations

import torch


def check_index(idx: torch.Tensor, rows: int, what: str, lowest: int = 0) -> None:
    """IndexError unless every entry of ``idx`` is in ``[lowest, rows)`` (-1: empty slot)."""
    if bool(((idx < lowest) | (idx >= rows)).any()):
        raise IndexError(f"{what} out of range [{lowest}, {rows})")
