"""One connection to Redis (standalone or Cluster) behind a short timeout and a breaker.

Contract: every Redis call the router makes goes through `RedisLink.call` (or
`RedisLink.script`), which
- bounds it by `timeout_ms` (asyncio deadline, the only one: redis-py gets no socket
  timeout; it drops a connection whose reply never came, so a late reply cannot
  desynchronise the protocol),
- counts failures, and after `breaker_failures` consecutive ones opens the breaker: calls
  then fail fast with `RedisUnavailable` for `breaker_open_ms`, doubling per failed probe
  up to `breaker_max_open_ms`; after that one call is let through as a probe (half-open)
  and its success closes the breaker,
- never raises anything but `RedisUnavailable` for transport trouble, so callers have one
  thing to catch: they fail open to their local state. An error reply (OOM when Redis
  hits maxmemory, a script error) is `RedisCommandError`, a `RedisUnavailable`: it
  counts as a failure (breaker, `ramjet_redis_command_errors_total`), never a success.

Server-side scripts run by EVALSHA; a NOSCRIPT reply (script cache flushed, failover to a
replica that never saw SCRIPT LOAD, a restarted server) loads the script again and retries
once. On Cluster, SCRIPT LOAD goes to every primary.

The request path never awaits Redis: the residency store and the report cursors call the
link from background tasks and serve lookups from their local copies. Degradation is the
gauge `ramjet_redis_degraded` (1 while the breaker is not closed), for an alert.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, OutOfMemoryError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ramjet.errors import RamjetError
from ramjet.metric_catalogue import counter, gauge, histogram
from ramjet.residency.config import RedisSettings as RedisSettings
from ramjet.residency.config import StoreConfig as StoreConfig

T = TypeVar("T")
Client = aioredis.Redis | RedisCluster


class RedisUnavailable(RamjetError):
    """Redis did not answer in time, refused, or the breaker is open. Fail open."""


class RedisCommandError(RedisUnavailable):
    """Redis answered with an error reply (OOM, a script error, WRONGTYPE...): the call
    did nothing. A counted failure (`ramjet_redis_command_errors_total`), never a
    success; callers fail open as for any `RedisUnavailable`."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class LuaScript:
    name: str
    source: str

    @functools.cached_property
    def sha(self) -> str:
        """Hashed once (it was hashed again on every call: a script is 10 KB)."""
        return hashlib.sha1(self.source.encode()).hexdigest()


class LinkMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.degraded = gauge(registry, "ramjet_redis_degraded")
        self.errors = counter(registry, "ramjet_redis_errors_total")
        self.breaker_opens = counter(registry, "ramjet_redis_breaker_opens_total")
        self.script_reloads = counter(registry, "ramjet_redis_script_reloads_total")
        self.call_seconds = histogram(registry, "ramjet_redis_call_seconds")
        self.command_errors = counter(registry, "ramjet_redis_command_errors_total")


class Breaker:
    """Consecutive-failure breaker with a growing open period and a single probe."""

    def __init__(
        self,
        failures: int,
        open_s: float,
        max_open_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failures_to_open = failures
        self.base_open_s = open_s
        self.max_open_s = max_open_s
        self.clock = clock
        self.state: Literal["closed", "open", "half_open"] = "closed"
        self.consecutive = 0
        self.open_s = open_s
        self.open_until = 0.0
        self.probe_started = 0.0

    def allow(self) -> bool:
        """May a call go out now? In half-open, only the one probe may (another one if
        the probe never reported back within `open_s`, e.g. it was cancelled)."""
        if self.state == "closed":
            return True
        now = self.clock()
        if self.state == "open" and now >= self.open_until:
            self.state = "half_open"
            self.probe_started = now
            return True
        if self.state == "half_open" and now - self.probe_started >= self.open_s:
            self.probe_started = now
            return True
        return False

    def success(self) -> bool:
        """Record a success; True when this closed an open breaker (a recovery)."""
        recovered = self.state != "closed"
        self.state = "closed"
        self.consecutive = 0
        self.open_s = self.base_open_s
        return recovered

    def failure(self) -> bool:
        """Record a failure; True when this opened the breaker."""
        self.consecutive += 1
        if self.state == "half_open":
            self.open_s = min(self.open_s * 2, self.max_open_s)
            self.state = "open"
            self.open_until = self.clock() + self.open_s
            return False
        if self.state == "closed" and self.consecutive >= self.failures_to_open:
            self.state = "open"
            self.open_until = self.clock() + self.open_s
            return True
        return False


class RedisLink:
    """A Redis client, its breaker and its metrics. Share one per router process."""

    def __init__(self, settings: RedisSettings, registry: CollectorRegistry) -> None:
        self.settings = settings
        self.metrics = LinkMetrics(registry)
        self.breaker = Breaker(
            settings.breaker_failures,
            settings.breaker_open_ms / 1000,
            settings.breaker_max_open_ms / 1000,
        )
        self._recover_hooks: list[Callable[[], None]] = []
        self.client: Client = self._connect()

    def _connect(self) -> Client:
        s = self.settings
        common: dict[str, Any] = {
            # No socket timeout: `call`'s asyncio deadline bounds every read and write.
            # With one, redis-py (8.2) wraps each send in `asyncio.wait_for`, and Python
            # 3.11's wait_for loses a cancel that lands as the send completes: a loop of
            # calls against a live Redis lost more than half its single cancels that way,
            # and a replica's stop waited on repeated cancels (`ramjet.runtime.tasks`).
            "socket_timeout": None,
            "socket_connect_timeout": s.connect_timeout_ms / 1000,
            "decode_responses": False,
        }
        if s.cluster:
            return RedisCluster.from_url(s.url, **common)
        return aioredis.Redis.from_url(s.url, retry_on_timeout=False, **common)

    @property
    def degraded(self) -> bool:
        return self.breaker.state != "closed"

    def on_recover(self, hook: Callable[[], None]) -> None:
        """Call `hook` (synchronously, from the event loop) each time the breaker closes."""
        self._recover_hooks.append(hook)

    async def call(self, fn: Callable[[Client], Awaitable[T]], timeout_s: float | None = None) -> T:
        if not self.breaker.allow():
            self.metrics.errors.labels("breaker_open").inc()
            raise RedisUnavailable("redis breaker open")
        self.metrics.degraded.set(1 if self.degraded else 0)
        t0 = time.perf_counter()
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for loses a cancel that lands as
            # the reply arrives (`ramjet.runtime.tasks`); the client has no socket timeout
            # of its own for the same reason (`_connect`)
            async with asyncio.timeout(timeout_s or self.settings.timeout_ms / 1000):
                result = await fn(self.client)
        except NoScriptError:
            self._succeeded()  # the server answered: healthy; the script helper reloads
            raise
        except (TimeoutError, RedisTimeoutError) as exc:
            self._failed("timeout")
            raise RedisUnavailable("redis call timed out") from exc
        except (RedisError, OSError) as exc:
            if isinstance(exc, ResponseError) and not _is_transient(exc):
                # an error reply did nothing: OOM (maxmemory reached), a script error,
                # a wrong type. A failure, counted and alerted on, never a success
                code = _code(exc)
                self.metrics.command_errors.inc()
                self._failed("oom" if code == "OOM" else "response")
                raise RedisCommandError(f"redis refused the call: {exc}", code) from exc
            self._failed("connection" if isinstance(exc, OSError | ConnectionError) else "other")
            raise RedisUnavailable(f"redis call failed: {exc!r}") from exc
        self.metrics.call_seconds.observe(time.perf_counter() - t0)
        self._succeeded()
        return result

    def _failed(self, kind: str) -> None:
        self.metrics.errors.labels(kind).inc()
        if self.breaker.failure():
            self.metrics.breaker_opens.inc()
        self.metrics.degraded.set(1 if self.degraded else 0)

    def _succeeded(self) -> None:
        if self.breaker.success():
            self.metrics.degraded.set(0)
            for hook in self._recover_hooks:
                hook()
        self.metrics.degraded.set(1 if self.degraded else 0)

    async def script(
        self, script: LuaScript, keys: Sequence[str], args: Sequence[str | int | float | bytes]
    ) -> Any:
        """EVALSHA `script`; on NOSCRIPT load it (every primary on Cluster) and retry once."""

        async def run(c: Client) -> Any:
            return await c.evalsha(script.sha, len(keys), *keys, *args)

        try:
            return await self.call(run)
        except NoScriptError:
            self.metrics.script_reloads.inc()
            await self.call(lambda c: c.script_load(script.source))
            try:
                return await self.call(run)
            except NoScriptError as exc:  # flushed again between load and run
                raise RedisUnavailable("script cache keeps being flushed") from exc

    async def close(self) -> None:
        await self.client.aclose()


def _code(exc: ResponseError) -> str:
    """The error reply's code, e.g. OOM, ERR, WRONGTYPE (script errors arrive as ERR)."""
    if isinstance(exc, OutOfMemoryError) or "maxmemory" in str(exc):
        return "OOM"  # redis-py strips the code from the text of its OutOfMemoryError
    return str(exc).split(" ", 1)[0].upper()


def _is_transient(exc: ResponseError) -> bool:
    """Replies that mean 'not now' (loading, failover in progress, cluster moving)."""
    text = str(exc).split(" ", 1)[0].upper()
    return text in {"LOADING", "BUSY", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN", "READONLY"}
