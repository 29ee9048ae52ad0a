"""Shared by the decoder tests that read recorded engine events (`tests/vectors/`): the
frames of a recorded message, and a decoded event as plain fields to compare with the
engine's own."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from ramjet.sidecar.wire import AllBlocksCleared, BlockRemoved, BlockStored

VECTORS = Path(__file__).resolve().parents[1] / "vectors"


def load(name: str) -> Any:
    return json.loads((VECTORS / name).read_text())


def frames(entry: dict[str, Any]) -> list[bytes]:
    """The ZMQ frames of one recorded message (`frames_b64`)."""
    return [base64.b64decode(f) for f in entry["frames_b64"]]


def as_plain(ev: BlockStored | BlockRemoved | AllBlocksCleared) -> dict[str, Any]:
    """A decoded event's fields by name (tuples as lists), with its type."""
    out: dict[str, Any] = {"type": type(ev).__name__}
    for name in ev.__slots__:  # type: ignore[union-attr]
        v = getattr(ev, name)
        out[name] = list(v) if isinstance(v, tuple) else v
    return out
