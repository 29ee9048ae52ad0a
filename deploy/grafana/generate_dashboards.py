"""Writes deploy/grafana/dashboards/*.json: Ramjet's Grafana dashboards, rendered from the
panel table in deploy/grafana/dashboards_router.py and dashboards_fleet.py (its
vocabulary: dashboard_panels.py).

Run `python deploy/grafana/generate_dashboards.py` after editing the table; a test checks
that the committed JSON is what this script writes, and runs every panel's query against
a live Prometheus (tests/integration/test_ops_prometheus.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the panel table sits next to this script, outside any package
from dashboard_panels import Dashboard, Panel  # noqa: E402
from dashboards_fleet import ENGINES, REDIS, REPORTS  # noqa: E402
from dashboards_router import CACHE, OBSERVE, PRIORITY, ROUTING  # noqa: E402

from ramjet.metric_catalogue import check_queries  # noqa: E402

DATASOURCE = {"type": "prometheus", "uid": "ramjet-prometheus"}
OUT = HERE / "dashboards"
DASHBOARDS = (ROUTING, CACHE, OBSERVE, PRIORITY, ENGINES, REPORTS, REDIS)


def _panel(p: Panel, pid: int, x: int, y: int) -> dict[str, object]:
    h = 8
    defaults: dict[str, object] = {"unit": p.unit}
    custom: dict[str, object] = {}
    if p.extra.get("stacking"):
        custom["stacking"] = {"mode": "normal", "group": "A"}
    if "mappings" in p.extra:
        defaults["mappings"] = p.extra["mappings"]
    if custom:
        defaults["custom"] = custom
    return {
        "id": pid,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": h, "w": p.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}}
        if p.kind == "timeseries"
        else {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": expr,
                "legendFormat": legend,
                "range": True,
            }
            for i, (expr, legend) in enumerate(p.targets)
        ],
    }


def render(d: Dashboard) -> dict[str, object]:
    panels, x, y = [], 0, 0
    for i, p in enumerate(d.panels, start=1):
        if x + p.width > 24:
            x, y = 0, y + 8
        panels.append(_panel(p, i, x, y))
        x += p.width
    return {
        "uid": d.uid,
        "title": d.title,
        "description": d.description,
        "tags": ["ramjet"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": []},
        "annotations": {"list": []},
        "links": [{"title": "Ramjet", "type": "dashboards", "tags": ["ramjet"]}],
        "panels": panels,
    }


def files() -> dict[str, str]:
    """File name -> JSON text, for every dashboard."""
    return {
        f"{d.uid}.json": json.dumps(render(d), indent=2, sort_keys=False) + "\n" for d in DASHBOARDS
    }


def queries() -> list[tuple[str, str]]:
    """(dashboard/panel, expr) of every panel target."""
    return [
        (f"{d.uid}/{p.title}", expr) for d in DASHBOARDS for p in d.panels for expr, _ in p.targets
    ]


def main() -> int:
    bad = check_queries(queries())  # every series a panel reads is in ramjet/metric_catalogue.py
    if bad:
        print("\n".join(bad), file=sys.stderr)
        return 1
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in files().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
