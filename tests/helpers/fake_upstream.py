"""An OpenAI-compatible upstream whose faults the test controls (the one legitimate fake
in the proxy tests: the router under test is real, on real loopback sockets).

    up = FakeUpstream("e0"); await up.start()        # port 0 → up.url
    up.behavior = Behavior(status=503, retry_after="2")
    up.behavior = Behavior(kill_after_chunks=2)       # abort the socket mid-stream
    await up.refuse()  /  await up.start()            # stop listening / listen again (same port)
    up.requests        # every request received: method, path, headers, body bytes
    up.cancelled       # times a handler was cancelled because the client (router) left
    await up.stop()

Imported by path (test dirs carry no `__init__.py`):
`sys.path.insert(0, str(Path(__file__).parents[1] / "helpers"))`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from aiohttp import web
from multidict import CIMultiDictProxy


@dataclass
class Behavior:
    status: int = 200
    retry_after: str | None = None
    error_body: bytes = b'{"error":{"message":"prompt too long","type":"invalid_request_error","param":null,"code":"context_length_exceeded"}}'
    headers_delay_s: float = 0.0
    """Sleep before sending status and headers (a hung engine)."""
    chunks: int = 4
    """SSE content chunks before the final one and [DONE]."""
    chunk_delay_s: float = 0.0
    chunk_bytes: int = 0
    """Pad each SSE chunk's content to about this many bytes (slow-reader tests)."""
    kill_after_chunks: int | None = None
    """Abort the TCP connection after this many chunks."""
    stall_after_chunks: int | None = None
    eof_delay_s: float = 0.0
    """Sleep between `data: [DONE]` and the chunked body's terminator (a client that
    stops at [DONE] may leave before the body ends)."""
    """Stop sending (but keep the connection) after this many chunks."""
    health_status: int = 200
    models_delay_s: float = 0.0
    """Sleep before answering `GET /v1/models` (a slow model list)."""


@dataclass
class Received:
    method: str
    path: str
    headers: CIMultiDictProxy[str]
    body: bytes
    t: float = field(default_factory=time.monotonic)


def completion_body(name: str, model: str) -> bytes:
    """The exact non-streaming body this upstream sends (tests compare byte for byte)."""
    return json.dumps(
        {
            "id": f"cmpl-{name}",
            "object": "chat.completion",
            "created": 1700000000,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": f"hello from {name} ✓"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9},
        },
        ensure_ascii=False,
        separators=(", ", ": "),
    ).encode()


def sse_chunk(name: str, model: str, i: int, pad: int = 0, finish: bool = False) -> bytes:
    content = "" if finish else f"tok{i} " + "x" * max(0, pad - 200)
    body = {
        "id": f"chunk-{name}",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": model,
        "choices": [
            {
                "index": 0,
                "delta": {} if finish else {"content": content},
                "finish_reason": "stop" if finish else None,
            }
        ],
    }
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class FakeUpstream:
    def __init__(self, name: str, model: str = "m") -> None:
        self.name = name
        self.model = model
        self.behavior = Behavior()
        self.requests: list[Received] = []
        self.models_requests = 0
        """`GET /v1/models` requests received."""
        self.cancelled = 0
        self.cancel_times: list[float] = []
        self.bytes_sent = 0
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def generation_requests(self) -> list[Received]:
        return [r for r in self.requests if r.path.startswith("/v1/") and r.method == "POST"]

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)  # bodies as large as engines take
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await self._site.start()
        if self.port == 0:
            server = self._site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def refuse(self) -> None:
        """Stop listening: new connections are refused (the port stays reserved by us)."""
        await self.stop()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.behavior.health_status, text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        self.models_requests += 1
        if self.behavior.models_delay_s:
            await asyncio.sleep(self.behavior.models_delay_s)
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        )

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(Received(request.method, request.path, request.headers, body))
        b = self.behavior
        try:
            if b.headers_delay_s:
                await asyncio.sleep(b.headers_delay_s)
            if b.status != 200:
                headers = {"Content-Type": "application/json"}
                if b.retry_after is not None:
                    headers["Retry-After"] = b.retry_after
                return web.Response(status=b.status, body=b.error_body, headers=headers)
            stream = json.loads(body).get("stream") is True
            if not stream:
                return web.Response(
                    body=completion_body(self.name, self.model),
                    headers={
                        "Content-Type": "application/json",
                        "Keep-Alive": "timeout=5",
                        "X-Upstream": self.name,
                        "X-Ramjet-Cached-Tokens": "3",
                    },
                )
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await resp.prepare(request)
            for i in range(b.chunks):
                if b.kill_after_chunks is not None and i >= b.kill_after_chunks:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                if b.stall_after_chunks is not None and i >= b.stall_after_chunks:
                    await asyncio.sleep(3600)
                data = sse_chunk(self.name, self.model, i, b.chunk_bytes)
                await resp.write(data)
                self.bytes_sent += len(data)
                if b.chunk_delay_s:
                    await asyncio.sleep(b.chunk_delay_s)
            await resp.write(sse_chunk(self.name, self.model, b.chunks, finish=True))
            await resp.write(b"data: [DONE]\n\n")
            if b.eof_delay_s:
                await asyncio.sleep(b.eof_delay_s)
            await resp.write_eof()
            return resp
        except asyncio.CancelledError:
            self.cancelled += 1
            self.cancel_times.append(time.monotonic())
            raise
