"""Ephemeral report keys for a local stack (`ramjet stack`).

`ephemeral_keys(policy_path, engine_ids, out_dir)`: for each engine id that the policy
lists no key for, write a fresh Ed25519 keypair `<id>-stack.key` / `<id>-stack.pub` into
`out_dir` (`write_keypair`: the private half mode 0600), and a copy of the policy,
`out_dir/policy.yaml`, whose `keys.engines` also lists each new public key file by
absolute path. Key files the original policy names by relative path are rewritten
against the original's folder, so the copy loads from anywhere. The caller starts each
engine with `engine_args[id]` (`--key FILE --key-id KID`) and the router with
`--policy <copy>`; the keys die with `out_dir`.

Engines the policy already lists keys for get nothing: their operator holds the private
key (`ramjet keys generate`), and the stack cannot sign for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ramjet.config import load_policy
from ramjet.reports.keys import write_keypair


@dataclass(frozen=True)
class StackKeys:
    policy_path: Path
    """The policy copy the router reads (the public keys merged in)."""
    engine_args: dict[str, list[str]] = field(default_factory=dict)
    """Engine id -> its `--key FILE --key-id KID` arguments."""
    skipped: tuple[str, ...] = ()
    """Engines the policy already lists keys for (left alone)."""


def ephemeral_keys(policy_path: Path, engine_ids: Sequence[str], out_dir: Path) -> StackKeys:
    """See the module docstring. Raises `PolicyFileError` when the policy (or the copy)
    does not load, OSError when the keys cannot be written."""
    load_policy(policy_path)  # refuse a bad file before writing anything
    data: dict[str, Any] = yaml.safe_load(policy_path.read_text(encoding="utf-8"))
    base = policy_path.resolve().parent
    keys = dict(data.get("keys") or {})
    engines: dict[str, list[dict[str, Any]]] = {
        str(e): [dict(entry) for entry in entries]
        for e, entries in (keys.get("engines") or {}).items()
    }
    for entries in engines.values():
        for entry in entries:
            f = entry.get("public_key_file")
            if f is not None and not Path(f).is_absolute():
                entry["public_key_file"] = str(base / f)
    args: dict[str, list[str]] = {}
    skipped = []
    for eid in engine_ids:
        if engines.get(eid):
            skipped.append(eid)
            continue
        kid = f"{eid}-stack"
        priv, pub, _ = write_keypair(out_dir, kid)
        engines[eid] = [{"key_id": kid, "public_key_file": str(pub.resolve())}]
        args[eid] = ["--key", str(priv.resolve()), "--key-id", kid]
    keys["engines"] = engines
    data["keys"] = keys
    copy = out_dir / "policy.yaml"
    copy.write_text(
        f"# {policy_path} with ephemeral report keys (ramjet stack)\n"
        + yaml.safe_dump(data, sort_keys=False),
        encoding="utf-8",
    )
    load_policy(copy)  # the copy must load as the original did
    return StackKeys(copy, args, tuple(skipped))
