"""The sidecar's requests to its engine (the metrics scrape, a cache reset and its nudges,
the profile probe) go through the router's engine-facing client: an `EngineTransport`
(`ramjet.transport.base`), HTTP/1.1's `ramjet.transport.http1.EnginePool`, one small pool
per use, closed when that use ends (`engine_client`).

Each call is one whole exchange within `timeout_s` in all, connect included
(`ramjet.transport.base.fetch`): the status and the whole body, at most `MAX_BODY`
bytes. Failures are the transport's: `UpstreamConnectError` (nothing was sent; its
`refused` says the engine's port refused, i.e. the engine is gone), `UpstreamClosed`
(both `OSError`s), and `TimeoutError`.

The engine URL is `http(s)://host[:port]`, optionally with a base path that every
request's path is put under (`engine_base`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from ramjet.transport.base import EngineTransport, fetch, http_url
from ramjet.transport.http1 import EnginePool

MAX_BODY = 16 << 20
"""The longest answer read from the engine (vLLM's `/metrics` is some 100 KB)."""
KEEPALIVE_S = 4.0
"""An idle connection is reused within this long: under uvicorn's 5 s keep-alive (vLLM,
SGLang), so the engine does not close one as it is sent on."""
_JSON = (("Content-Type", "application/json"),)


def engine_base(url: str) -> str:
    """The base path of the engine at `url` ("" for none); ValueError when `url` is not
    http(s)://host[:port][/path] with no query or fragment (`transport.base.http_url`)."""
    u = http_url(url)
    if u.query_string:
        raise ValueError(f"not http(s)://host[:port][/path]: {url!r}")
    return u.path.rstrip("/")


@dataclass(frozen=True, slots=True)
class EngineClient:
    """Requests to one engine, each within `timeout_s` (module docstring)."""

    transport: EngineTransport
    base: str
    timeout_s: float

    async def request(
        self, method: str, path: str, json_body: object | None = None
    ) -> tuple[int, bytes]:
        """Send `method path` (under the engine's base path), with `json_body` as JSON if
        given; the status and the whole answer."""
        headers, body = ((), b"") if json_body is None else (_JSON, json.dumps(json_body).encode())
        return await fetch(
            self.transport,
            method,
            self.base + path,
            timeout_s=self.timeout_s,
            headers=headers,
            body=body,
            max_bytes=MAX_BODY,
        )


@asynccontextmanager
async def engine_client(url: str, timeout_s: float) -> AsyncIterator[EngineClient]:
    """A client of the engine at `url` for one use (one request at a time), its
    connection closed at the end; ValueError for a bad `url` (`engine_base`)."""
    base = engine_base(url)
    pool = EnginePool(url, limit=1, connect_s=timeout_s, keepalive_s=KEEPALIVE_S)
    try:
        yield EngineClient(pool, base, timeout_s)
    finally:
        await pool.close()
