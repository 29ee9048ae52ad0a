"""`ResidencySource`: what the router needs of the residency tables, and `NoResidency`.

The router reads one `ResidencyView` per engine when it builds the policies' views, marks
a prompt's blocks pending on the engine it forwards to (until that engine's report
confirms them or the forward fails), and records the routed prefix as approximate
residency once the forward succeeded. `ResidencyTables` (`ramjet.residency.tables`) is
the real source; `NoResidency` knows nothing (every match is 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ramjet.keys.prefix import PrefixKeys
from ramjet.policy.base import GlobalMatch, ResidencyView
from ramjet.residency.pending import PendingTicket
from ramjet.types import EngineId, PrefixKey


class ResidencySource(Protocol):
    """What the router needs of the residency tables (`ramjet.residency`)."""

    def view(self, engine: EngineId, now: float | None = None) -> ResidencyView: ...

    def record_routed(self, engine: EngineId, keys: PrefixKeys, now: float) -> None: ...

    def add_pending(self, engine: EngineId, keys: PrefixKeys, now: float) -> PendingTicket | None:
        """Forwarding to `engine`: its blocks are pending there until reported."""
        ...

    def settle_pending(
        self, ticket: PendingTicket | None, engine: EngineId | None, now: float
    ) -> None:
        """The forward ended on `engine` (None: failed); keep, move or drop the ticket."""
        ...

    def capped_engines(self) -> frozenset[EngineId]:
        """Engines whose report-confirmed residency lost entries to the table's cap since
        their last snapshot: a match on them may be missing blocks they hold."""
        ...


class _EmptyView:
    def global_match(
        self, block_keys: Sequence[PrefixKey], block_tokens: Sequence[int]
    ) -> GlobalMatch:
        return GlobalMatch()

    def swa_match(self, boundary_keys: Sequence[tuple[int, PrefixKey]]) -> int:
        return 0


class NoResidency:
    """Residency that knows nothing (every match is 0); for tests and bare setups."""

    _VIEW = _EmptyView()

    def view(self, engine: EngineId, now: float | None = None) -> ResidencyView:
        return self._VIEW

    def record_routed(self, engine: EngineId, keys: PrefixKeys, now: float) -> None:
        return None

    def add_pending(self, engine: EngineId, keys: PrefixKeys, now: float) -> PendingTicket | None:
        return None

    def settle_pending(
        self, ticket: PendingTicket | None, engine: EngineId | None, now: float
    ) -> None:
        return None

    def capped_engines(self) -> frozenset[EngineId]:
        return frozenset()
