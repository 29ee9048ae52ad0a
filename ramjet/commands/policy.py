"""`ramjet policy check FILE`: validate a policy file (its tree and each policy's
parameters) and print the effective policy, defaults filled in. Exit 2 on error, with
the field path."""

from __future__ import annotations

import argparse
import sys

import yaml

from ramjet.config import PolicyFileError, effective_policy, load_policy
from ramjet.policy.registry import PolicyConfigError, validate_params


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("policy", help="policy files")
    sub = p.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    check = sub.add_parser("check", help="validate a policy file and print the effective policy")
    check.add_argument("file")
    check.set_defaults(handler=_check)


def _check(args: argparse.Namespace) -> int:
    try:
        config = load_policy(args.file)
        data = effective_policy(config)
        for role in ("incumbent", "candidate"):
            ref = getattr(config, role)
            if ref is not None:
                params = validate_params(ref.name, ref.params, path=f"{role}.params")
                data[role]["params"] = params.model_dump(mode="json")
    except PolicyFileError as exc:
        print(exc, file=sys.stderr)
        return 2
    except PolicyConfigError as exc:
        print(f"{args.file}: invalid policy file\n  {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump(data, sort_keys=False))
    return 0
