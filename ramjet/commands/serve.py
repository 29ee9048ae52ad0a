"""`ramjet serve --policy FILE [--host H] [--port P]`: run the router (uvloop) until
SIGTERM/SIGINT, then drain."""

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
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
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
        uvloop.run(serve(config, args.host, args.port, policy_path=args.policy))
    except PolicyConfigError as exc:
        print(f"{args.policy}: invalid policy file\n  {exc}", file=sys.stderr)
        return 2
    return 0
