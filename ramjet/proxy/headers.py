"""Header hygiene between client and engine, both ways.

Hop-by-hop headers (RFC 9110 §7.6.1, plus any named in `Connection`) are stripped both
ways; client `X-Ramjet-*` headers never reach an engine (the router adds its own request
id), and engines' `X-Ramjet-*` response headers are kept for accounting instead of
reaching the client. Content-Length is the transport's business on each leg.
"""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
INTERNAL_PREFIX = "x-ramjet-"


def _connection_tokens(headers: CIMultiDictProxy[str]) -> set[str]:
    return {t.strip().lower() for v in headers.getall("Connection", []) for t in v.split(",")}


_DROP_TO_ENGINE = HOP_BY_HOP | {"host", "content-length", "expect"}
_DROP_TO_CLIENT = HOP_BY_HOP | {"content-length"}


def upstream_request_headers(
    client: CIMultiDictProxy[str], request_id: str
) -> list[tuple[str, str]]:
    """What the engine sees of the client's headers (in their order), plus the router's
    own; `ramjet.transport.http1` writes them as they are."""
    drop = _DROP_TO_ENGINE
    if "Connection" in client:
        drop = drop | _connection_tokens(client)
    out = [
        (k, v)
        for k, v in client.items()
        if (lk := k.lower()) not in drop and not lk.startswith(INTERNAL_PREFIX)
    ]
    out.append(("X-Ramjet-Request-Id", request_id))
    return out


def client_response_headers(
    upstream: CIMultiDictProxy[str],
) -> tuple[CIMultiDict[str], dict[str, str]]:
    """Headers for the client, and the engine's `X-Ramjet-*` headers (for accounting)."""
    drop = _DROP_TO_CLIENT
    if "Connection" in upstream:
        drop = drop | _connection_tokens(upstream)
    out: CIMultiDict[str] = CIMultiDict()
    internal: dict[str, str] = {}
    for k, v in upstream.items():
        lk = k.lower()
        if lk.startswith(INTERNAL_PREFIX):
            internal[lk] = v
        elif lk not in drop:
            out.add(k, v)
    return out, internal
