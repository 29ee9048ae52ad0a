"""Small client helpers shared by the proxy integration tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes
    error: str | None = None
    """Set when the connection broke before the body ended."""

    @property
    def engine(self) -> str | None:
        return self.headers.get("X-Ramjet-Engine")

    def events(self) -> list[bytes]:
        return [e for e in self.body.split(b"\n\n") if e]


async def post(url: str, stream: bool = False, body: dict[str, Any] | None = None) -> Reply:
    payload = json.dumps({**(body or CHAT), "stream": stream}).encode()
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            url + "/v1/chat/completions", data=payload, headers={"Content-Type": "application/json"}
        ) as r,
    ):
        headers = dict(r.headers)
        chunks: list[bytes] = []
        try:
            async for chunk in r.content.iter_any():
                chunks.append(chunk)
        except aiohttp.ClientPayloadError as exc:
            return Reply(r.status, headers, b"".join(chunks), type(exc).__name__)
        return Reply(r.status, headers, b"".join(chunks))
