"""Live reload of the mode and the policies (names and parameters: the weights) from the
policy file, without a restart: on SIGHUP, and on `POST /admin/reload` with
`Authorization: Bearer <admin.token>`.

The whole file is loaded and validated first (`load_policy`, then every policy's
parameters through the registry); any error changes nothing and is returned (HTTP 400,
or a log line for SIGHUP). On success the router's `ModeRunner` gets the new mode and
policy objects in one step between two requests (the event loop runs one handler at a
time, so no request sees half a reload): the wiring builds a new `ModeRunner`
(`ramjet.app.wiring.build_modes`) and the router swaps it in with the config in force
(`Router.reconfigure`), in one assignment. A policy whose `{name, params}` did not
change keeps its object, so its state (a round-robin cursor) carries on. Sections other than
`mode`, `incumbent` and `candidate` (engines, timeouts, limits, ...) need a restart;
a reload that changes them applies the rest and lists them under `needs_restart`. The
exception is `keys:` when reports are on: the key ring is rebuilt (key files re-read)
and swapped in, and what a revoked key signed is purged
(`ReportProcessor.replace_keyring`; the answer lists `keys.revoked` and `keys.purged`).

The admin endpoint is off (403) while `admin.token` is unset; a wrong or missing token
is 401. Tokens compare in constant time.
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path
from typing import Any

from aiohttp import web

from ramjet.app.router import Router
from ramjet.app.wiring import build_modes
from ramjet.config import PolicyConfig, PolicyFileError, load_policy
from ramjet.errors import ConfigError
from ramjet.policy.registry import PolicyConfigError
from ramjet.reports.keys import KeyError_, KeyRing
from ramjet.request.openai_errors import json_error

log = logging.getLogger(__name__)

_LIVE = ("mode", "incumbent", "candidate")


class ReloadError(ConfigError, ValueError):
    """The policy file did not load; nothing changed."""


def apply_config(router: Router, new: PolicyConfig, base_dir: Path | None = None) -> dict[str, Any]:
    """Swap in `new`'s mode and policies (see module docstring); raises ReloadError."""
    old = router.config
    ring: KeyRing | None = None
    if old.keys.engines or old.reports.engines:  # reports on (ramjet.app.wiring)
        try:  # the report keys, key files re-read: a revoked key stops counting now
            ring = KeyRing.from_config(new.keys, base_dir)
        except KeyError_ as exc:
            raise ReloadError(str(exc)) from None
    live: dict[str, Any] = {k: getattr(new, k) for k in _LIVE}
    try:
        modes = build_modes(new, router.metrics, keep=(old, router.modes))
    except PolicyConfigError as exc:
        raise ReloadError(str(exc)) from None
    changed = [k for k in _LIVE if getattr(new, k) != getattr(old, k)]
    rest_old = old.model_dump(exclude=set(_LIVE))
    rest_new = new.model_dump(exclude=set(_LIVE))
    needs_restart = sorted(
        k for k in rest_new if rest_new[k] != rest_old.get(k) and (k != "keys" or ring is None)
    )
    keys = None if ring is None else router.signals.replace_keys(ring)
    if keys is not None:
        live["keys"] = new.keys
    router.reconfigure(old.model_copy(update=live), modes)
    router.accounting.metrics.reloads.labels(result="ok").inc()
    return {
        "mode": new.mode.kind,
        "incumbent": new.incumbent.name,
        "candidate": None if new.candidate is None else new.candidate.name,
        "changed": changed,
        "needs_restart": needs_restart,
        **({} if keys is None else {"keys": keys}),
    }


def reload_file(router: Router, path: str | Path) -> dict[str, Any]:
    """Load `path` and apply it; raises ReloadError (nothing changed)."""
    try:
        new = load_policy(path)
    except PolicyFileError as exc:
        router.accounting.metrics.reloads.labels(result="refused").inc()
        raise ReloadError(str(exc)) from None
    try:
        return apply_config(router, new, Path(path).resolve().parent)
    except ReloadError:
        router.accounting.metrics.reloads.labels(result="refused").inc()
        raise


def on_sighup(router: Router, path: str | Path) -> None:
    """The SIGHUP handler's body: reload and log the outcome; never raises."""
    try:
        out = reload_file(router, path)
    except ReloadError as exc:
        log.error("reload refused, nothing changed: %s", exc)
        return
    log.info("reloaded %s: %s", path, out)


def admin_reload_handler(router: Router, path: str | Path | None) -> Any:
    """`POST /admin/reload` (see module docstring)."""

    async def handle(request: web.Request) -> web.Response:
        token = router.config.admin.token
        if token is None:
            return json_error(403, "Admin endpoints are disabled.", "permission_error", "admin_off")
        given = request.headers.get("Authorization", "")
        expected = f"Bearer {token}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            return json_error(401, "Bad or missing admin token.", "authentication_error", "token")
        if path is None:
            return json_error(
                409, "The router was not started from a policy file.", "invalid_request_error",
                "no_policy_file",
            )  # fmt: skip
        try:
            out = reload_file(router, path)
        except ReloadError as exc:
            return json_error(400, str(exc), "invalid_request_error", "invalid_policy")
        log.info("reloaded %s via admin endpoint: %s", path, out)
        return web.json_response({"reloaded": True, **out})

    return handle
