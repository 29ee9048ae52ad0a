"""`ramjet sidecar`: run beside a vLLM or SGLang engine; its KV events become Ramjet's
signed reports (`ramjet.sidecar`; how to run each engine: `docs/real-engines.md`).

    ramjet sidecar --engine-kind vllm --engine-id v0 --engine-url http://127.0.0.1:8000 \\
        --events ipc:///run/ramjet/v0-kv-events --replay tcp://127.0.0.1:5558 \\
        --key keys/v0-2026a.key --key-id v0-2026a --model deepseek-ai/DeepSeek-V4.1-Flash \\
        --block-tokens 16 --host 10.0.0.10 --port 9100

The engine must *bind* its events endpoint (vLLM and SGLang bind only `ipc://`, `inproc://`,
`*` or `::` endpoints and connect otherwise), hence an `ipc://` path beside the engine.
Routers pull from `http://HOST:PORT/ramjet/reports` (list it under `reports.engines`) or
the sidecar pushes with `--push-url`. `--token-file` guards `POST /reset_prefix_cache`
(off without it) and the pulls (routers send `reports.pull_token_file`). Exit 2 on a bad argument or key, 0 on SIGINT/TERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from ramjet.policy.profile import TierCost
from ramjet.reports.envelope import ID_PATTERN
from ramjet.reports.keys import KeyError_, load_private_key
from ramjet.runtime.probe_lock import DEFAULT_PROBE_LOCK


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("sidecar", help="sign a vLLM/SGLang engine's KV events as reports")
    p.add_argument("--engine-kind", required=True, choices=["vllm", "sglang"])
    p.add_argument("--engine-id", required=True, help="the engine's id in the router's policy")
    p.add_argument("--engine-url", required=True, help="the engine's HTTP base URL")
    p.add_argument("--events", required=True, help="the engine's KV-event PUB endpoint")
    p.add_argument("--replay", default=None, help="the engine's replay ROUTER endpoint")
    p.add_argument("--topic", default="", help="event topic to subscribe to (default: all)")
    p.add_argument("--key", required=True, help="Ed25519 private key (PKCS#8 PEM)")
    p.add_argument("--key-id", required=True)
    p.add_argument("--model", required=True, help="served model name (seeds the token keys)")
    p.add_argument("--block-tokens", type=int, default=16, help="the engine's block/page size")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9100, help="serves /ramjet/reports")
    p.add_argument("--push-url", default=None, help="also POST reports to a router")
    p.add_argument("--load-interval", type=float, default=1.0, help="seconds between loads")
    p.add_argument("--no-scrape", action="store_true", help="do not read the engine's /metrics")
    p.add_argument(
        "--profile",
        choices=["skip", "probe"],
        default="probe",
        help="probe: time requests at start and publish the measured profile (default); "
        "skip: publish none, and routers price the engine with their default profile",
    )
    p.add_argument("--profile-file", default=None, help="publish this EngineProfile JSON")
    p.add_argument(
        "--probe-sizes",
        default=None,
        help="prompt sizes in the engine's tokens, comma-separated (default: 256, 1024, "
        "4096, ... up to the engine's max model length, which is probed last)",
    )
    p.add_argument(
        "--probe-lock",
        default=DEFAULT_PROBE_LOCK,
        help="lock file the engines of this host share while probing, so that no probe "
        "measures another's load ('' for none)",
    )
    p.add_argument("--kv-bytes-per-token", type=float, default=None)
    p.add_argument("--host-gbps", type=float, default=None, help="host->GPU restore GB/s")
    p.add_argument("--ssd-gbps", type=float, default=None, help="storage restore GB/s")
    p.add_argument(
        "--events-warn-after",
        type=float,
        default=30.0,
        help="seconds after start with no KV event before a loud warning (what to check)",
    )
    p.add_argument(
        "--token-file",
        default=None,
        help="file holding a bearer token (16+ characters) that POST /reset_prefix_cache "
        "and the report pulls must send (routers: reports.pull_token_file); without it the "
        "reset is off and pulls are open",
    )
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(handler=_run)


def _fail(msg: str) -> int:
    print(f"sidecar: {msg}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> int:
    from ramjet.reports.publisher import push_path
    from ramjet.sidecar.engine_client import engine_base
    from ramjet.sidecar.runner import Sidecar, SidecarSettings

    try:
        engine_base(args.engine_url)
    except ValueError as exc:
        return _fail(f"--engine-url: {exc}")
    if args.push_url is not None:
        try:
            push_path(args.push_url)
        except ValueError as exc:
            return _fail(f"--push-url: {exc}")
    for name, value in (("--engine-id", args.engine_id), ("--key-id", args.key_id)):
        if not ID_PATTERN.fullmatch(value):
            return _fail(f"{name} {value!r}: must match {ID_PATTERN.pattern}")
    if args.block_tokens <= 0:
        return _fail("--block-tokens must be positive")
    sizes: tuple[int, ...] | None = None
    if args.probe_sizes is not None:
        try:
            sizes = tuple(int(x) for x in args.probe_sizes.split(","))
        except ValueError:
            return _fail("--probe-sizes: comma-separated integers")
        if not sizes or sorted(set(sizes)) != list(sizes) or sizes[0] <= 0:
            return _fail("--probe-sizes: positive and strictly increasing")
    tiered = bool(args.host_gbps or args.ssd_gbps)
    if args.profile == "probe" and tiered and args.kv_bytes_per_token is None:
        return _fail("--host-gbps/--ssd-gbps need --kv-bytes-per-token (the model's KV size)")
    try:
        key = load_private_key(args.key)
    except KeyError_ as exc:
        return _fail(str(exc))
    token: str | None = None
    if args.token_file is not None:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            return _fail(f"--token-file: {exc}")
        if len(token) < 16 or any(c.isspace() for c in token):
            return _fail("--token-file: the token must be 16+ characters, no whitespace")
    tiers = {}
    if args.host_gbps:
        tiers["host"] = TierCost(bandwidth_bytes_per_s=args.host_gbps * 1e9)
    if args.ssd_gbps:
        tiers["ssd"] = TierCost(bandwidth_bytes_per_s=args.ssd_gbps * 1e9)
    settings = SidecarSettings(
        engine_kind=args.engine_kind,
        engine_id=args.engine_id,
        engine_url=args.engine_url,
        events_url=args.events,
        replay_url=args.replay,
        key_id=args.key_id,
        model=args.model,
        block_tokens=args.block_tokens,
        topic=args.topic.encode(),
        push_url=args.push_url,
        load_interval_s=args.load_interval,
        scrape_metrics=not args.no_scrape,
        profile=args.profile,
        profile_file=args.profile_file,
        probe_sizes=sizes,
        probe_lock=args.probe_lock or None,
        global_kv_bytes_per_token=args.kv_bytes_per_token or 1.0,
        tiers=tiers,
        events_warn_after_s=args.events_warn_after,
        token=token,
    )
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        sidecar = Sidecar(settings, key)
    except ImportError as exc:
        return _fail(f"{exc}: install the extra with pip install 'ramjet[sidecar]'")
    asyncio.run(_serve(sidecar, args.host, args.port))
    return 0


async def _serve(sidecar: object, host: str, port: int) -> None:
    from aiohttp import web

    from ramjet.sidecar.runner import Sidecar

    assert isinstance(sidecar, Sidecar)
    app = web.Application()
    sidecar.add_routes(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    # catch up on the engine's history (replay) before answering anyone: a /health or
    # snapshot served earlier would show an empty cache the engine does not have
    await sidecar.start()
    site = web.TCPSite(runner, host, port)
    await site.start()
    logging.getLogger("ramjet.sidecar").info(
        "sidecar for %s on http://%s:%d (events %s)",
        sidecar.settings.engine_id,
        host,
        port,
        sidecar.settings.events_url,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await sidecar.stop()
        await runner.cleanup()
