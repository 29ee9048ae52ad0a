"""The engine's OpenAI-compatible HTTP API (aiohttp).

Routes:
- `POST /v1/chat/completions`, `POST /v1/completions`: streaming (SSE, `data: [DONE]`)
  and not. Extra request field `reasoning_effort` (integer 1-100) sets the generation
  budget: ceil(effort / 100 * max_gen_tokens), capped by `max_tokens`. Extra field
  `priority` (integer, vLLM's): the order under `--scheduling-policy priority`
  (`engine_stub.scheduler`; ignored under fcfs). Extra field `cache_salt` (a non-empty
  string, vLLM's): the request's blocks and SWA states are keyed from a seed of their own
  (`ramjet.keys.prefix.key_seed(model, salt=...)`, the router's keys for it), so they
  serve only requests with the same salt, as in vLLM and SGLang. Usage carries
  `prompt_tokens_details.cached_tokens` and `prompt_work` (where the prompt came from and
  what it cost); in a stream, the final chunk carries it.
- `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus), `GET /profile`
  (`ramjet.policy.profile.EngineProfile` as JSON), `GET /load`, `GET /cache` (resident keys).
Every response carries `X-Engine-Id` and `X-Engine-Epoch`. Errors are OpenAI-style
`{"error": {"message", "type", "param", "code"}}`; a full queue is 503 with Retry-After.

A client that goes away (disconnect while waiting or streaming) cancels its request,
which frees its scheduler slot at the next step.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine_stub.engine import Engine
from engine_stub.request import Request, SamplingParams
from engine_stub.scheduler import QueueFull
from ramjet.keys.prefix import PromptError, Rendered, compute_keys, render_chat, render_completion
from ramjet.runtime.tasks import cancel_and_wait

ENGINE_KEY: web.AppKey[Engine] = web.AppKey("engine", Engine)


class BadRequest(Exception):
    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_response(
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


# -- request parsing --------------------------------------------------------------------


def _int_field(body: dict[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        rng = f"{lo}-{hi}" if hi is not None else f">= {lo}"
        raise BadRequest(f"{name}: must be an integer {rng}", param=name)
    return v


def parse_params(body: dict[str, Any], max_gen: int) -> SamplingParams:
    effort = _int_field(body, "reasoning_effort", 1, 100)
    max_tokens = _int_field(body, "max_completion_tokens", 1) or _int_field(body, "max_tokens", 1)
    budget = max_gen if effort is None else max(1, math.ceil(effort / 100 * max_gen))
    if max_tokens is not None:
        budget = max_tokens if effort is None else min(budget, max_tokens)
    temp = body.get("temperature", 0.0)
    if temp is None:
        temp = 0.0
    if not isinstance(temp, int | float) or isinstance(temp, bool) or not 0 <= temp <= 2:
        raise BadRequest("temperature: must be a number between 0 and 2", param="temperature")
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise BadRequest("seed: must be an integer", param="seed")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop):
        stops = tuple(stop)
    else:
        raise BadRequest(
            "stop: must be a string or an array of at most 4 non-empty strings", param="stop"
        )
    n = body.get("n", 1)
    if n != 1:
        raise BadRequest("n: only 1 is supported", param="n")
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest("stream: must be a boolean", param="stream")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("ignore_eos: must be a boolean", param="ignore_eos")
    return SamplingParams(
        max_new_tokens=budget, temperature=float(temp), seed=seed, stop=stops, ignore_eos=ignore_eos
    )


def parse_cache_salt(body: dict[str, Any]) -> str | None:
    """The body's `cache_salt` (vLLM's field): a non-empty string, or None when absent or
    null. As in vLLM, requests share cached blocks only with requests of the same salt
    (`Engine.prompt_seed`)."""
    v = body.get("cache_salt")
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise BadRequest("cache_salt: must be a non-empty string", param="cache_salt")
    return v


def parse_priority(body: dict[str, Any]) -> int:
    """The body's `priority` (vLLM's field): any integer, default 0."""
    v = body.get("priority", 0)
    if v is None:
        return 0
    if not isinstance(v, int) or isinstance(v, bool) or abs(v) >= 2**63:
        raise BadRequest("priority: must be a 64-bit integer", param="priority")
    return v


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


# -- handlers ---------------------------------------------------------------------------


def _headers(engine: Engine) -> dict[str, str]:
    return {"X-Engine-Id": engine.settings.engine_id, "X-Engine-Epoch": str(engine.epoch)}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


async def _complete(request: web.Request, *, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    s = engine.settings
    try:
        body = await _json_body(request)
        model = body.get("model", s.model_name)
        if model != s.model_name:
            raise BadRequest(
                f"model: {model!r} is not served here (try {s.model_name!r})",
                param="model",
                status=404,
                code="model_not_found",
            )
        params = parse_params(body, s.max_gen_tokens)
        priority = parse_priority(body)
        salt = parse_cache_salt(body)
        try:
            messages: Any = body.get("messages")  # render_chat refuses a missing one
            rendered: Rendered = (
                render_chat(messages, body.get("tools"))
                if chat
                else render_completion(body.get("prompt"))
            )
        except PromptError as exc:
            raise BadRequest(str(exc), param="messages" if chat else "prompt") from None
        ids = engine.encode(rendered.text)
        if len(ids) > s.max_prompt_tokens:
            raise BadRequest(
                f"prompt is {len(ids)} tokens; this engine accepts at most {s.max_prompt_tokens}",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
    except BadRequest as exc:
        return error_response(
            exc.status, str(exc), param=exc.param, code=exc.code, headers=_headers(engine)
        )
    keys = compute_keys(rendered, engine.prompt_seed(salt))
    engine.events.describe(keys.blocks, ids, salt)
    req = Request(ids, keys, params, asyncio.get_running_loop(), priority=priority)
    try:
        engine.scheduler.submit(req)
    except QueueFull as exc:
        engine.metrics.rejected.labels("queue_full").inc()
        h = {**_headers(engine), "Retry-After": str(math.ceil(exc.retry_after_s))}
        return error_response(
            503,
            "engine queue is full; retry later",
            kind="server_error",
            code="queue_full",
            headers=h,
        )
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    try:
        if body.get("stream"):
            return await _stream(request, engine, req, rid, chat)
        return await _whole(engine, req, rid, chat)
    finally:
        if req.finish_reason is None:
            req.cancelled = True
            engine.scheduler.wake()


def _usage(req: Request) -> dict[str, Any]:
    w = req.work
    return {
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": len(req.tokens),
        "total_tokens": len(req.prompt_ids) + len(req.tokens),
        "prompt_tokens_details": {"cached_tokens": w.cached_tokens},
        "prompt_work": w.to_json(),
    }


async def _whole(engine: Engine, req: Request, rid: str, chat: bool) -> web.Response:
    while True:
        kind, value = await req.out.get()
        if kind == "error":
            return error_response(500, str(value), kind="server_error", headers=_headers(engine))
        if kind == "done":
            break
    created = int(time.time())
    choice: dict[str, Any] = {"index": 0, "finish_reason": req.finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": req.text}
    else:
        choice["text"] = req.text
        choice["logprobs"] = None
    body = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": engine.settings.model_name,
        "choices": [choice],
        "usage": _usage(req),
    }
    return web.json_response(body, headers=_headers(engine))


async def _stream(
    request: web.Request, engine: Engine, req: Request, rid: str, chat: bool
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={
            **_headers(engine),
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
        }
    )
    await resp.prepare(request)
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(
        delta: str | None,
        finish: str | None,
        usage: dict[str, Any] | None = None,
        role: bool = False,
    ) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            d: dict[str, Any] = {}
            if role:
                d["role"] = "assistant"
            if delta:
                d["content"] = delta
            choice["delta"] = d
        else:
            choice["text"] = delta or ""
            choice["logprobs"] = None
        out: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": engine.settings.model_name,
            "choices": [choice],
        }
        if usage is not None:
            out["usage"] = usage
        return b"data: " + json.dumps(out).encode() + b"\n\n"

    sent_role = False
    while True:
        kind, value = await req.out.get()
        if kind == "first":
            if chat and not sent_role:
                await resp.write(chunk(None, None, role=True))
                sent_role = True
        elif kind == "token":
            await resp.write(chunk(value[1], None))
        elif kind == "done":
            await resp.write(chunk(None, req.finish_reason, _usage(req)))
            break
        elif kind == "error":
            err = {
                "error": {
                    "message": str(value),
                    "type": "server_error",
                    "param": None,
                    "code": None,
                }
            }
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
            break
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    data = [
        {
            "id": engine.settings.model_name,
            "object": "model",
            "created": int(engine.started_at),
            "owned_by": "ramjet-engine-stub",
        }
    ]
    return web.json_response({"object": "list", "data": data}, headers=_headers(engine))


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    waiting, running = engine.scheduler.counts()
    body = {
        "status": "ok",
        "engine_id": engine.settings.engine_id,
        "epoch": engine.epoch,
        "model": engine.settings.model_name,
        "waiting": waiting,
        "running": running,
        "started_at": engine.started_at,
    }
    return web.json_response(body, headers=_headers(engine))


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    engine.refresh_gauges()
    return web.Response(
        body=generate_latest(engine.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def profile(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if engine.profile is None:
        return error_response(
            503,
            "this engine has not been profiled (started with --profile skip)",
            kind="server_error",
            headers=_headers(engine),
        )
    return web.json_response(engine.profile.model_dump(mode="json"), headers=_headers(engine))


async def load(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response(engine.load(), headers=_headers(engine))


async def cache(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response(engine.cache_snapshot(), headers=_headers(engine))


async def _sweeper(engine: Engine, period_s: float) -> None:
    while True:
        await asyncio.sleep(period_s)
        engine.sweep()


def build_app(
    engine: Engine, extra_setup: Callable[[web.Application], Awaitable[None] | None] | None = None
) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    app[ENGINE_KEY] = engine
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/profile", profile)
    app.router.add_get("/load", load)
    app.router.add_get("/cache", cache)
    period = max(0.05, min(1.0, engine.settings.swa_ttl_s / 4, engine.settings.global_ttl_s / 4))

    async def background(app: web.Application) -> Any:
        task = asyncio.create_task(_sweeper(engine, period))
        yield
        await cancel_and_wait((task,))

    app.cleanup_ctx.append(background)
    return app
