"""`ramjet serve --policy FILE [--host H] [--port P] [--ops-port O] [--shutdown-delay S]`:
run the router (uvloop) until SIGTERM/SIGINT, then (after S seconds of failing /readyz
while serving) drain. With O, /metrics and /admin/reload are served on port O only."""

from __future__ import annotations

import argparse
import logging
import sys

from ramjet.config import PolicyFileError, load_policy
from ramjet.policy.registry import PolicyConfigError


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("serve", help="run the router")
    p.add_argument("--policy", default="policies/observe.yaml", help="policy YAML file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--shutdown-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="on SIGTERM, fail /readyz but keep serving this long before draining, so a "
        "load balancer polling /readyz stops sending first (Kubernetes: a preStop sleep "
        "does this; see docs/operations.md)",
    )
    p.add_argument(
        "--ops-port",
        type=int,
        default=None,
        help="serve /metrics and /admin/reload (and /healthz, /readyz) on this port only, "
        "not on the client port (a Service or firewall then keeps them from clients)",
    )
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    if not 0 <= args.shutdown_delay <= 600:
        print("--shutdown-delay: seconds in [0, 600]", file=sys.stderr)
        return 2
    if args.ops_port is not None and not (0 < args.ops_port < 65536 and args.ops_port != args.port):
        print("--ops-port: a port in 1-65535 other than --port", file=sys.stderr)
        return 2
    try:
        config = load_policy(args.policy)
    except PolicyFileError as exc:
        print(exc, file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.logging.level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvloop

    from ramjet.app.server import serve
    from ramjet.native import current

    # installed by ramjet/cli.py before anything imported the hot modules
    logging.getLogger("ramjet.native").info("%s", current().line())

    try:
        uvloop.run(
            serve(
                config,
                args.host,
                args.port,
                policy_path=args.policy,
                shutdown_delay_s=args.shutdown_delay,
                ops_port=args.ops_port,
            )
        )
    except PolicyConfigError as exc:
        print(f"{args.policy}: invalid policy file\n  {exc}", file=sys.stderr)
        return 2
    return 0
