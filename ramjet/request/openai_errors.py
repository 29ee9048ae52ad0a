"""Error responses in OpenAI's shape, for every refusal the router answers itself.

`{"error": {"message", "type", "param": null, "code"}}`; `code` is stable (clients and
metrics key on it), `message` is for people. A Retry-After is whole seconds, rounded up
and at least 1.
"""

from __future__ import annotations

from aiohttp import web


def error_body(message: str, type_: str, code: str) -> dict[str, object]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def json_error(
    status: int,
    message: str,
    type_: str,
    code: str,
    *,
    retry_after_s: float | None = None,
    close: bool = False,
) -> web.Response:
    resp = web.json_response(error_body(message, type_, code), status=status)
    if retry_after_s is not None:
        resp.headers["Retry-After"] = str(max(1, int(retry_after_s + 0.999)))
    if close:
        resp.force_close()
    return resp
