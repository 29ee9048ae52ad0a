"""`ramjet keys generate --engine ID --key-id KID --out DIR`: write an Ed25519 keypair
for an engine's reports (`KID.key`, PKCS#8 PEM, mode 0600; `KID.pub`, PEM) and print
the `keys:` entry to paste into the router's policy file. Exit 2 on error."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ramjet.reports.envelope import ID_PATTERN
from ramjet.reports.keys import public_key_b64, write_keypair


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("keys", help="report signing keys")
    sub = p.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    gen = sub.add_parser("generate", help="write an Ed25519 keypair for an engine")
    gen.add_argument("--engine", required=True, help="engine id the key signs for")
    gen.add_argument("--key-id", required=True, help="key id (unique across engines)")
    gen.add_argument("--out", required=True, type=Path, help="folder for KID.key and KID.pub")
    gen.set_defaults(handler=_generate)


def _generate(args: argparse.Namespace) -> int:
    for name, value in (("--engine", args.engine), ("--key-id", args.key_id)):
        if not ID_PATTERN.fullmatch(value):
            print(f"{name} {value!r}: must match {ID_PATTERN.pattern}", file=sys.stderr)
            return 2
    try:
        priv, pub, key = write_keypair(args.out, args.key_id)
    except (OSError, FileExistsError) as exc:
        print(f"keys generate: {exc}", file=sys.stderr)
        return 2
    print(f"# private key (engine {args.engine} only): {priv}")
    print(f"# public key: {pub}")
    print("keys:\n  engines:")
    print(f"    {args.engine}:")
    print(f'      - {{key_id: {args.key_id}, public_key: "{public_key_b64(key.public_key())}"}}')
    return 0
