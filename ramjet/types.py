"""Identifiers that must not be mixed, and the cache tiers.

Engine ids, prefix keys and epochs are all plain values at run time; the NewTypes make
mypy refuse to pass one where another is expected.
"""

from __future__ import annotations

import enum
import re
from typing import NewType

EngineId = NewType("EngineId", str)
"""Operator-chosen name of an engine, unique within a policy file (e.g. "e0")."""

ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,64}")
"""Engine ids and key ids: 1-64 ASCII letters, digits and `._:-`."""

PrefixKey = NewType("PrefixKey", int)
"""A 64-bit chained xxh3 key of a prompt prefix (see `ramjet.keys.prefix`), 0 <= key < 2**64."""

Epoch = NewType("Epoch", int)
"""An engine's incarnation. Changes whenever the engine restarts and loses volatile state."""


class Tier(enum.IntEnum):
    """Where an engine holds a block of global KV. Lower is faster."""

    HBM = 0
    HOST = 1
    SSD = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Tier:
        try:
            return cls[text.upper()]
        except KeyError:
            raise ValueError(f"unknown tier {text!r}; expected one of hbm, host, ssd") from None


class TrustGrade(enum.IntEnum):
    """How far the router may trust an engine's residency view."""

    EXACT = 0
    """Verified reports, no gap, fresh."""
    DEGRADED = 1
    """Reports were lost (sequence gap) or went stale; a snapshot is pending."""
    APPROXIMATE = 2
    """No reports at all: residency inferred from the router's own routing."""

    @property
    def label(self) -> str:
        return self.name.lower()
