"""`ramjet stack`'s ephemeral report keys: one keypair per local engine without keys, a
policy copy naming the public key files, relative key files of the original resolved."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from ramjet.config import PolicyFileError, load_policy
from ramjet.reports.envelope import Envelope, decode, verify_signature
from ramjet.reports.keys import KeyRing, load_private_key, write_keypair
from ramjet.reports.local_keys import ephemeral_keys
from ramjet.types import EngineId

POLICY = """\
engines:
  - {id: e0, url: "http://127.0.0.1:8101"}
  - {id: e1, url: "http://127.0.0.1:8102"}
  - {id: e2, url: "http://127.0.0.1:8103"}
incumbent: {name: prefix_affinity}
keys:
  engines:
    e1:
      - {key_id: e1-ops, public_key_file: keys/e1-ops.pub}
"""


def test_keys_for_engines_without_and_a_policy_copy_that_loads_anywhere(tmp_path: Path) -> None:
    site = tmp_path / "site"
    write_keypair(site / "keys", "e1-ops")
    policy = site / "policy.yaml"
    policy.write_text(POLICY)
    out = tmp_path / "stack-keys"
    keys = ephemeral_keys(policy, ["e0", "e1"], out)

    assert keys.skipped == ("e1",) and set(keys.engine_args) == {"e0"}
    flag, priv, flag2, kid = keys.engine_args["e0"]
    assert (flag, flag2, kid) == ("--key", "--key-id", "e0-stack")
    assert stat.S_IMODE(Path(priv).stat().st_mode) == 0o600
    copy = load_policy(keys.policy_path)
    assert keys.policy_path.parent == out
    # the relative key file of the original is absolute in the copy
    (e1_entry,) = copy.keys.engines["e1"]
    assert e1_entry.public_key_file == (site / "keys" / "e1-ops.pub").resolve()
    ring = KeyRing.from_config(copy.keys, base_dir=tmp_path / "elsewhere")
    assert ring.engines() == {EngineId("e0"), EngineId("e1")}  # e2 is not local: no key

    # what the engine signs with its --key verifies under the router's copy
    from ramjet.reports.envelope import sign

    frame = sign(
        Envelope(EngineId("e0"), "e0-stack", 1, 1, 1, "load", b"{}"), load_private_key(Path(priv))
    )
    got = ring.lookup("e0-stack", EngineId("e0"))
    assert not isinstance(got, str) and verify_signature(decode(frame, 1 << 20), got)


def test_a_bad_policy_writes_nothing(tmp_path: Path) -> None:
    policy = tmp_path / "bad.yaml"
    policy.write_text("engines: []\nincumbent: {name: round_robin}\n")
    with pytest.raises(PolicyFileError):
        ephemeral_keys(policy, ["e0"], tmp_path / "out")
    assert not (tmp_path / "out").exists()
