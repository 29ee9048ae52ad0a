"""Which engines a policy may pick, and the load figures every policy reads the same way.

Eligibility: an engine is a candidate when it is healthy and serves the request's model
(an engine that lists no models serves any). When no engine qualifies, the filter widens
step by step (healthy engines of any model, then every engine) so a policy always has
something to return; the runner, not the policy, refuses an all-unhealthy fleet.

Outstanding prompt tokens: the engine reports what it has queued or is prefilling, but
that report is older than the router's own bookkeeping, which knows what it has sent
since. Neither underestimates the other's blind spot by much, so the larger of the two
is the outstanding prompt work (an engine shared with other router replicas reports
more than this router has in flight; a fresh send is in flight before any report says so).

The router's in-flight figure counts each request's predicted uncached prompt tokens
(`uncached_prompt_tokens`, fixed when it routed the request), not its whole prompt, as the
engine's report counts the tokens it still has to prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

from ramjet.policy.base import EngineLoad, EngineView, RequestView


def eligible(request: RequestView, engines: Sequence[EngineView]) -> Sequence[EngineView]:
    """Healthy engines serving the request's model; widened when none qualifies."""
    healthy = [e for e in engines if e.healthy]
    serving = [e for e in healthy if not e.models or request.model in e.models]
    if serving:
        return serving
    return healthy or engines


def outstanding_prompt_tokens(load: EngineLoad) -> int:
    """Prompt tokens waiting for or in prefill on the engine (see module docstring)."""
    reported = load.queued_prompt_tokens
    if reported is None:
        return load.inflight_prompt_tokens
    return max(reported, load.inflight_prompt_tokens)


def uncached_prompt_tokens(request: RequestView, engine: EngineView) -> int:
    """The request's prompt tokens the engine would prefill: its prompt minus the longest
    resident global-KV prefix the engine's view shows (any tier, pending included: a
    restored or pending block is not prefilled again). A live SWA boundary may lie up to
    one block past that prefix (`cost.swa_reach`); those few tokens are not subtracted.
    The view keeps its lookup, so after the policies' picks this costs no second one."""
    n = max(request.prompt_tokens, 0)
    if not request.block_keys:
        return n
    cached = engine.residency.global_match(request.block_keys, request.block_tokens).total
    return n - min(cached, n)
