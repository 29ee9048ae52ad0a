"""Routers for the integration tests, in front of fake upstreams on loopback: a policy
with timeouts in tens of milliseconds (`router_config`), a `DecisionSink` that keeps
every record, and the factory type the `make_router` fixture yields. Imported by
module name (tests/helpers is on sys.path), never from a conftest: several test
folders have one, and `from conftest import` reads whichever was imported last."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from ramjet.app.server import RouterServer
from ramjet.config import PolicyConfig, parse_policy
from ramjet.decisions.record import DecisionRecord

FAST: dict[str, Any] = {
    "timeouts": {
        "connect_s": 0.5,
        "first_byte_s": 0.4,
        "idle_s": 0.3,
        "send_s": 0.3,
        "header_deadline_s": 0.3,
        "body_s": 1.0,
        "drain_s": 1.0,
        "linger_s": 0.1,
        "probe_s": 0.3,
    },
    "health": {
        "probe_interval_s": 0.05,
        "consecutive_failures": 2,
        "ejection_base_s": 0.3,
        "ejection_max_s": 2.0,
    },
    "limits": {"max_body_bytes": 64 * 1024, "max_headers": 30, "max_header_line_bytes": 1024},
}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def router_config(urls: list[str], **overrides: Any) -> PolicyConfig:
    data: dict[str, Any] = {
        "engines": [{"id": f"e{i}", "url": u} for i, u in enumerate(urls)],
        "incumbent": {"name": "round_robin"},
        **FAST,
    }
    return parse_policy(_merge(data, overrides))


class Records:
    """A DecisionSink that keeps every record."""

    def __init__(self) -> None:
        self.records: list[DecisionRecord] = []

    def on_decision(self, record: DecisionRecord) -> None:
        self.records.append(record)


RouterFactory = Callable[..., Awaitable[RouterServer]]
