"""`ramjet pool-reporter`: the signed reports of one shared pool (protocol section 9).

    ramjet pool-reporter --pool-dir /dev/shm/ramjet/host0 --id host0 --tier host \\
        --key keys/host0-a.key --key-id host0-a --port 8111

Lists the `kvpool` directory every `--interval` seconds (`ramjet.sidecar.pool_watch`)
and serves its deltas and snapshots, signed with the pool's key and naming the pool as
the reporter, on `GET /ramjet/reports` and `GET /ramjet/snapshot`. Routers pull it like
an engine: list the URL under `reports.engines.<pool id>`, the public key under
`keys.engines.<pool id>`, and the pool under `fabric.pools`. `--key-map` names how a
pool file's key becomes a router key (`KEY_MAPS`; `hex`: the reference engine's, the
router key in 16 hex digits; `vllm`: vLLM block hashes written by our connector, mapped
from the metadata beside each block, `VllmPoolKeys`, with `--model` (the router's model
name), `--block-tokens` (the engines' `--block-size`) and the engines' hash settings,
`--vllm-hash-algo` and `--vllm-none-hash-seed` (their PYTHONHASHSEED, if set)). `--tier swa`: a pool of SWA states, live `--swa-ttl`
seconds after their last use (the engines' `--swa-ttl`). Exit 2 on a bad argument or
key, 0 on SIGINT/TERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ramjet.reports.envelope import ID_PATTERN
from ramjet.reports.keys import KeyError_, load_private_key
from ramjet.types import EngineId, Tier

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from ramjet.sidecar.pool_watch import KeyMap


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("pool-reporter", help="sign a shared pool's holdings as reports")
    p.add_argument("--pool-dir", required=True, type=Path, help="the kvpool directory")
    p.add_argument("--id", required=True, help="the pool's id (fabric.pools[].id)")
    p.add_argument("--tier", required=True, choices=["host", "ssd", "swa"])
    p.add_argument("--key", required=True, type=Path, help="Ed25519 private key (PKCS#8 PEM)")
    p.add_argument("--key-id", required=True)
    p.add_argument("--key-map", default="hex", help="pool key -> router key (default: hex)")
    p.add_argument("--model", help="--key-map vllm: the model name requests carry")
    p.add_argument("--block-tokens", type=int, help="--key-map vllm: the engines' --block-size")
    p.add_argument("--vllm-hash-algo", default="sha256_cbor", choices=["sha256", "sha256_cbor"],
                   help="--key-map vllm: the engines' --prefix-caching-hash-algo")  # fmt: skip
    p.add_argument("--vllm-none-hash-seed", default=None,
                   help="--key-map vllm: the engines' PYTHONHASHSEED (default: unset)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="serves /ramjet/reports")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between scans")
    p.add_argument("--swa-ttl", type=float, default=60.0, help="SWA idle TTL (--tier swa)")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from ramjet.sidecar.pool_watch import KEY_MAPS

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    problems = []
    if not ID_PATTERN.fullmatch(args.id):
        problems.append(f"--id: bad pool id {args.id!r}")
    if args.key_map not in KEY_MAPS and args.key_map != "vllm":
        problems.append(f"--key-map: one of {', '.join(sorted([*KEY_MAPS, 'vllm']))}")
    if args.key_map == "vllm" and (not args.model or not args.block_tokens):
        problems.append("--key-map vllm needs --model and --block-tokens")
    if args.block_tokens is not None and args.block_tokens <= 0:
        problems.append("--block-tokens must be positive")
    if args.key_map == "vllm" and args.tier == "swa":
        problems.append("--key-map vllm: a pool of global KV (--tier host or ssd)")
    if not args.interval > 0 or not args.swa_ttl > 0:
        problems.append("--interval and --swa-ttl must be > 0")
    if not 0 <= args.port <= 65535:
        problems.append("--port: 0-65535")
    if args.pool_dir.exists() and not args.pool_dir.is_dir():
        problems.append(f"--pool-dir: {args.pool_dir} is not a directory")
    if problems:
        print("pool-reporter: " + "; ".join(problems), file=sys.stderr)
        return 2
    try:
        key = load_private_key(args.key)
    except KeyError_ as exc:
        print(f"pool-reporter: {exc}", file=sys.stderr)
        return 2
    tier: Tier | Literal["swa"] = "swa" if args.tier == "swa" else Tier.parse(args.tier)
    key_map: KeyMap
    if args.key_map == "vllm":
        from kvpool import Pool
        from ramjet.sidecar.engine_hashes import VLLM_DEFAULT_NONE_HASH_SEED
        from ramjet.sidecar.pool_watch import VllmPoolKeys

        seed = args.vllm_none_hash_seed or VLLM_DEFAULT_NONE_HASH_SEED
        pool = Pool(args.pool_dir, 1 << 62)  # reads each block's metadata, nothing more
        key_map = VllmPoolKeys(pool, args.model, args.block_tokens, args.vllm_hash_algo, seed)
    else:
        key_map = KEY_MAPS[args.key_map]
    asyncio.run(serve(args, key, tier, key_map))
    return 0


async def serve(
    args: argparse.Namespace,
    key: Ed25519PrivateKey,
    tier: Tier | Literal["swa"],
    key_map: KeyMap,
) -> None:
    """Serve the pool's reports until SIGINT/SIGTERM (the pool directory is created
    if missing: an empty pool reports nothing until the engines write to it)."""
    from aiohttp import web

    from kvpool import Pool
    from ramjet.reports.publisher import ReportPublisher
    from ramjet.sidecar.pool_watch import PoolWatcher

    log = logging.getLogger("ramjet.pool_reporter")
    pool = Pool(args.pool_dir, 1 << 62)  # only listed here: the engines own its capacity
    holder: list[PoolWatcher] = []
    publisher = ReportPublisher(
        EngineId(args.id), key, args.key_id, snapshot=lambda: holder[0].snapshot()
    )
    watcher = PoolWatcher(pool, publisher, tier, key_map, args.interval, swa_ttl_s=args.swa_ttl)
    holder.append(watcher)
    app = web.Application()
    publisher.add_routes(app)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    await publisher.start()
    await watcher.start()
    log.info("pool %s (%s) at %s: reports on http://%s:%d", args.id, args.tier, args.pool_dir,
             args.host, args.port)  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await watcher.stop()
    await publisher.stop()
    await runner.cleanup()
