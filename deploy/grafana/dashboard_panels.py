"""The vocabulary of Ramjet's dashboard table: `Panel`, `Dashboard`, and query helpers.

The table itself is `dashboards_router.py` (routing, cache, observation, priority) and
`dashboards_fleet.py` (engines, reports, Redis); after editing it run
`python deploy/grafana/generate_dashboards.py` (the renderer, which turns the table into
deploy/grafana/dashboards/*.json). Queries use `$__rate_interval`
(Grafana's rate window, at least four scrape intervals); `ramjet:*` series are the
recording rules of deploy/prometheus/rules/ramjet-recording.yml. Panels are laid out
left to right in the order given, on a 24-column grid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

RI = "$__rate_interval"


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[tuple[str, str], ...]  # (expr, legend)
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    width: int = 12
    extra: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]


def q(*pairs: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    return pairs
