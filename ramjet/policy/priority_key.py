"""The priority hint's static key: one implementation for the router, the simulator and
the tests (docs/priority.md).

`key = min(work, aging * horizon) + aging * arrival` (seconds). Every waiting request ages
at the same rate, so a static key orders requests as "least predicted work first,
forgiving `aging` seconds of work per second waited": a request with work h that arrived
at t0 is overtaken only by requests that arrive before t0 + h / aging.

`horizon` caps that window. Without it, a long prompt under a small `aging` is overtaken
by every shorter arrival for h / aging seconds (a 3 s prompt at aging 0.1: 30 s), which is
where least-work-first starves. With it, no request is overtaken by an arrival more than
`horizon` seconds younger, whatever its work: requests whose work exceeds
`aging * horizon` keep their arrival order among themselves and against later arrivals
beyond the horizon. So `aging` sets how strongly short work goes first and `horizon`
bounds the delay a long prompt can suffer from it. At aging 0 nothing ages and no horizon
applies: pure least-work-first, which can starve a long prompt for a whole burst.
"""

from __future__ import annotations

import math


def hint_key_s(work_s: float, aging: float, arrival_s: float, horizon_s: float | None) -> float:
    """The key in seconds (lower runs first). `horizon_s` None: no cap; at aging 0 (pure
    least-work-first, nothing ages) there is no horizon either."""
    w = max(work_s, 0.0)
    if horizon_s is not None and aging > 0 and math.isfinite(horizon_s):
        w = min(w, aging * max(horizon_s, 0.0))
    return w + aging * arrival_s
