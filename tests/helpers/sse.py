"""The data payloads of a server-sent event stream, as the benchmarks read an engine's or
the router's answer: one reader for all of them."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator


async def sse_data(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """Each `data: ` payload of the stream (`[DONE]` included), in order, whatever the
    chunking; lines of other fields are skipped."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if event.startswith(b"data: "):
                yield event[6:]
