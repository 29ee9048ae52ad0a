"""`python -m engine_stub serve ...` runs one reference engine; `python -m engine_stub
profile` prints its measured profile as JSON. See `engine_stub.server` for the HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ramjet.config import DEFAULT_AGING

log = logging.getLogger("engine_stub")


def _positive(kind: type) -> Callable[[str], object]:
    def parse(text: str) -> object:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
        return v

    return parse


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return v


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return v


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="mini-v4", help="served model name (also seeds the prefix keys)"
    )
    p.add_argument("--seed", type=int, default=0, help="weight seed")
    p.add_argument("--window", type=_positive(int), default=128, help="SWA window in tokens")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=_positive(int), default=1, help="torch CPU threads")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine_stub", description="Ramjet's reference engine"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    s.add_argument("--id", required=True, help="engine id (as in the router's policy file)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_nonneg_int, required=True)
    _model_args(s)
    s.add_argument(
        "--cache-dir", type=Path, default=None, help="SSD tier directory (kept across restarts)"
    )
    s.add_argument("--swa-ttl", type=_positive(float), default=60.0, help="SWA idle TTL, seconds")
    s.add_argument(
        "--global-ttl", type=_positive(float), default=72 * 3600.0, help="global-KV TTL, seconds"
    )
    s.add_argument("--hbm-tokens", type=_nonneg_int, default=65536)
    s.add_argument("--host-tokens", type=_nonneg_int, default=262144)
    s.add_argument("--ssd-tokens", type=_nonneg_int, default=1048576)
    s.add_argument(
        "--swa-bytes", type=_positive(int), default=None, help="SWA pool cap (default 10%% of RAM)"
    )
    s.add_argument(
        "--pool-dir",
        type=Path,
        default=None,
        help="a global-KV pool directory shared with other engines (kvpool): every block "
        "computed is written through, a local miss reads it",
    )
    s.add_argument("--pool-id", default="pool0", help="the pool's id in the router's policy")
    s.add_argument(
        "--pool-bytes", type=_positive(int), default=1 << 30, help="the pool's byte capacity"
    )
    s.add_argument(
        "--pool-durable", action="store_true", help="fsync each block published (an SSD pool)"
    )
    s.add_argument(
        "--swa-pool-dir",
        type=Path,
        default=None,
        help="an SWA-state pool directory shared with other engines",
    )
    s.add_argument("--swa-pool-id", default="swa0", help="the SWA pool's id in the policy")
    s.add_argument(
        "--swa-pool-bytes",
        type=_positive(int),
        default=256 << 20,
        help="the SWA pool's byte capacity",
    )
    s.add_argument("--max-queue", type=_nonneg_int, default=64, help="waiting requests before 503")
    s.add_argument("--max-batch", type=_positive(int), default=8, help="running requests (slots)")
    s.add_argument("--prefill-chunk", type=_positive(int), default=512)
    s.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="priority: the request's integer priority, lowest first (ties by arrival)",
    )
    s.add_argument(
        "--priority-variant",
        choices=["chunk", "vllm"],
        default="chunk",
        help="chunk: preempt a prefill at chunk boundaries; vllm: vLLM V1's (running first)",
    )
    s.add_argument(
        "--priority-aging",
        type=_nonneg_float,
        default=DEFAULT_AGING,
        help="the router's priority aging (bands the queue-wait metric only)",
    )
    s.add_argument(
        "--max-gen", type=_positive(int), default=256, help="budget at reasoning_effort=100"
    )
    s.add_argument("--no-spec", action="store_true", help="disable DSpark speculative decoding")
    s.add_argument(
        "--profile", dest="profile_mode", choices=["fast", "full", "skip"], default="fast"
    )
    s.add_argument(
        "--probe-lock",
        default=None,
        help="lock file engines on this host share while probing (default: one in the "
        "temp directory; '' for none)",
    )
    s.add_argument(
        "--key", type=Path, default=None, help="Ed25519 private key file for signed reports"
    )
    s.add_argument("--key-id", default=None, help="key id published with the reports")
    s.add_argument(
        "--kv-events",
        default=None,
        metavar="ENDPOINT",
        help="also publish cache events in vLLM's ZMQ wire format (e.g. tcp://127.0.0.1:5557)",
    )
    s.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT", help="replay socket")
    s.add_argument(
        "--kv-events-drop-live",
        default="",
        metavar="SEQS",
        help="test fault: batch seqs (comma-separated) kept for replay but not sent live",
    )
    s.add_argument("--log-level", default="INFO")
    s.set_defaults(handler=_serve)
    p = sub.add_parser("profile", help="measure this machine and print the profile as JSON")
    _model_args(p)
    p.add_argument("--mode", choices=["fast", "full"], default="fast")
    p.set_defaults(handler=_profile)
    mem = sub.add_parser("memory", help="print the model's memory figures for a config")
    mem.add_argument("--config", choices=["full", "tiny"], default="tiny")
    mem.add_argument("--window", type=_positive(int), default=128, help="window of --config tiny")
    mem.add_argument("--json", action="store_true")
    mem.set_defaults(handler=_memory)
    return parser


def _memory(args: argparse.Namespace) -> int:
    from engine_stub.model.memory import print_memory

    return print_memory(args.config, args.window, args.json)


def _settings(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from engine_stub.engine import EngineSettings

    return EngineSettings(
        engine_id=args.id,
        model_name=args.model,
        seed=args.seed,
        window=args.window,
        device=args.device,
        cache_dir=args.cache_dir,
        hbm_tokens=args.hbm_tokens,
        host_tokens=args.host_tokens,
        ssd_tokens=args.ssd_tokens,
        global_ttl_s=args.global_ttl,
        swa_ttl_s=args.swa_ttl,
        swa_bytes=args.swa_bytes,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        prefill_chunk=args.prefill_chunk,
        scheduling_policy=args.scheduling_policy,
        priority_variant=args.priority_variant,
        priority_aging=args.priority_aging,
        max_gen_tokens=args.max_gen,
        speculate=not args.no_spec,
        profile_mode=args.profile_mode,
        probe_lock=_probe_lock(args.probe_lock),
        threads=args.threads,
        pool_dir=args.pool_dir,
        pool_id=args.pool_id,
        pool_bytes=args.pool_bytes,
        pool_durable=args.pool_durable,
        swa_pool_dir=args.swa_pool_dir,
        swa_pool_id=args.swa_pool_id,
        swa_pool_bytes=args.swa_pool_bytes,
    )


def _probe_lock(arg: str | None) -> str | None:
    from ramjet.runtime.probe_lock import DEFAULT_PROBE_LOCK

    return DEFAULT_PROBE_LOCK if arg is None else (arg or None)


def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from engine_stub.engine import Engine
    from engine_stub.reporting import attach_reports
    from engine_stub.server import build_app

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    engine = Engine(_settings(args))
    engine.start()
    app = build_app(engine)
    attach_reports(app, engine, key_file=args.key, key_id=args.key_id)
    bridge = None
    if args.kv_events:
        from engine_stub.vllm_events import VllmEventBridge, ZmqEventPublisher

        drop = [int(x) for x in args.kv_events_drop_live.split(",") if x.strip()]
        publisher = ZmqEventPublisher(args.kv_events, args.kv_events_replay, drop_live=drop)
        bridge = VllmEventBridge(
            engine.events, publisher, model=args.model, block_tokens=engine.kv.block_tokens
        )

    async def main() -> None:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        log.info(
            "engine %s serving %s on http://%s:%d epoch=%d",
            args.id, args.model, args.host, args.port, engine.epoch,
        )  # fmt: skip
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        if bridge is not None:
            bridge.close()
        engine.close()
    return 0


def _profile(args: argparse.Namespace) -> int:
    import torch

    from engine_stub.model import MiniV4, ModelConfig
    from engine_stub.profiler import Profiler

    torch.set_num_threads(args.threads)
    model = MiniV4(ModelConfig.tiny(window=args.window), seed=args.seed, device=args.device)
    result = Profiler(model, mode=args.mode, device=args.device).run()
    json.dump(result.to_json(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
