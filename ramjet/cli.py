"""`ramjet` command line. Each subcommand lives in `ramjet/commands/<name>.py` and
exposes `register(subparsers)`; the handler it sets returns a process exit code.

`ramjet serve` (the router; `ramjet stack` starts its router as one) and `ramjet native`
(which reports on it) load the compiled hot modules (ramjet/native.py) before any other
ramjet module is imported; every other command, and `import ramjet`, runs from source."""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence

import ramjet.commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ramjet", description="Cache-aware LLM request router")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(ramjet.commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"ramjet.commands.{info.name}")
        module.register(sub)
    return parser


# the commands that run the router's hot path in this process, or report on it
NATIVE_COMMANDS = frozenset({"serve", "native"})


def main(argv: Sequence[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    if given[:1] and given[0] in NATIVE_COMMANDS:
        from ramjet.native import install_ramjet

        install_ramjet()  # before build_parser imports the commands (and what they import)
    args = build_parser().parse_args(given)
    try:
        code: int = args.handler(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (`ramjet native | head -1`): stop quietly, as a Unix tool
        # does; stdout goes to /dev/null so the interpreter's exit flush cannot fail too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
