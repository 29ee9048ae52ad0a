"""`ramjet native`: whether the compiled hot modules run (ramjet/native.py), and which.

Prints `native: N modules compiled (mypyc, build/native)` and each module, or
`native: pure Python (<state>: <reason>)` (the env switch RAMJET_NATIVE=0, no build, or a
stale one: the files changed since it was built). Exit 1 only when the build is current
and a listed module still did not load from it.
"""

from __future__ import annotations

import argparse

from ramjet.native import describe


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("native", help="which hot modules run compiled (mypyc)")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    text, rc = describe()
    print(text)
    return rc
