"""The policy plugin interface.

A policy picks one engine for one request from a read-only view of the fleet. The
contract, which the router, the simulator and the tests all rely on:

- `pick` is synchronous and does no I/O. Everything it reads is in its arguments.
  The router gathers the views before calling it; the simulator builds the same views
  from simulated state. So the same object runs in both.
- `pick` must return one of the engines in `engines` whose `healthy` is true when any
  is; the runner (not the policy) handles an empty or all-unhealthy list.
- It may keep small internal state (a round-robin cursor), updated only inside `pick`.
  It is called from one thread (the router's event loop); it is not thread-safe.
- It never raises for a well-formed view. The observe-mode runner still contains and
  counts anything it raises.
- `Decision.components` holds, per engine, named figures in seconds or tokens (for
  example `wait_s`, `work_s`, `cost_s`, `match_tokens`); they are logged with the
  decision so an operator can see why.

The views and `Decision` are defined in `ramjet.policy.views` (compiled with mypyc; this
module, with its `@runtime_checkable` Protocol, stays interpreted) and exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ramjet.policy.views import Decision as Decision
from ramjet.policy.views import EngineLoad as EngineLoad
from ramjet.policy.views import EngineView as EngineView
from ramjet.policy.views import FleetStats as FleetStats
from ramjet.policy.views import GlobalMatch as GlobalMatch
from ramjet.policy.views import KeyedQueue as KeyedQueue
from ramjet.policy.views import PoolView as PoolView
from ramjet.policy.views import RequestView as RequestView
from ramjet.policy.views import ResidencyView as ResidencyView


@runtime_checkable
class RoutingPolicy(Protocol):
    name: str

    def pick(
        self, request: RequestView, engines: Sequence[EngineView], fleet: FleetStats
    ) -> Decision:
        """Pick one engine; see the module docstring for the contract."""
        ...
