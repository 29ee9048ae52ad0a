"""Which profile prices each engine, on /metrics: `ramjet_engine_profile_source`.

The cost model (`ramjet.policy.cost`) prices an engine with the profile it signed in its
reports; an engine that has reported none, or whose view is DEGRADED, is priced with the
policy's default profile, which is, unless the policy file sets
`candidate.params.default_profile`, the built-in DeepSeek-V4.1-Flash TP4 *estimate*
(`V41_FLASH_TP4_ESTIMATE`): figures from the design brief, not a measurement of this
engine. A real engine priced that way gets predictions that can be off by any factor,
and nothing else would say so. Per engine, at scrape time, exactly one of

    ramjet_engine_profile_source{engine="e0", source="reported"}          1
    ramjet_engine_profile_source{engine="e0", source="policy_default"}    0
    ramjet_engine_profile_source{engine="e0", source="builtin_estimate"}  0

is 1. The default profile is the live candidate's (after a reload, the new one), else
the incumbent's, for a policy that has `params.default_profile`; a policy pair without
one prices nothing with profiles and the engine's unreported source reads
`builtin_estimate` (what `tier_aware` would use). The decision log says the same per
decision (note `estimate_profile:<engine>`, spelled out by `ramjet explain`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ramjet.fleet.signals import EngineSignals
from ramjet.metric_catalogue import family
from ramjet.policy.cost import V41_FLASH_TP4_ESTIMATE
from ramjet.policy.profile import EngineProfile
from ramjet.types import EngineId, TrustGrade

SOURCES = ("reported", "policy_default", "builtin_estimate")


def default_profile_of(policies: Iterable[Any]) -> EngineProfile:
    """The default profile of the first policy that has one (`params.default_profile`),
    else the built-in estimate."""
    for p in policies:
        profile = getattr(getattr(p, "params", None), "default_profile", None)
        if isinstance(profile, EngineProfile):
            return profile
    return V41_FLASH_TP4_ESTIMATE


def profile_source(
    reported: EngineProfile | None, trust: TrustGrade, default: EngineProfile
) -> str:
    if reported is not None and trust != TrustGrade.DEGRADED:
        return "reported"
    return "builtin_estimate" if default == V41_FLASH_TP4_ESTIMATE else "policy_default"


class ProfileSources(Collector):
    """The collector (see the module docstring); reads live state at each scrape."""

    def __init__(
        self,
        engines: Iterable[EngineId],
        signals: Callable[[], EngineSignals],
        policies: Callable[[], Iterable[Any]],
    ) -> None:
        self._engines = tuple(engines)
        self._signals = signals
        self._policies = policies

    def sources(self) -> dict[EngineId, str]:
        signals = self._signals()
        default = default_profile_of(self._policies())
        return {
            e: profile_source(signals.profile(e), signals.trust(e), default) for e in self._engines
        }

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = family("ramjet_engine_profile_source")
        for engine, source in self.sources().items():
            for s in SOURCES:
                fam.add_metric([engine, s], 1.0 if s == source else 0.0)
        yield fam
