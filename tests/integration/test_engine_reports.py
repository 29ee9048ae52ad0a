"""Reference-engine process: its cache events, load and profile come out as reports
signed with the key given by --key/--key-id, served at /ramjet/reports and
/ramjet/snapshot."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from engines import start_engine

from ramjet.reports.envelope import decode, verify_signature
from ramjet.reports.keys import write_keypair
from ramjet.reports.transport import iter_frames


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return bytes(resp.read())


def test_engine_signs_its_cache_deltas_snapshot_and_profile(tmp_path: Path) -> None:
    priv, _pub, key = write_keypair(tmp_path / "keys", "e0-a")
    with start_engine("e0", key=priv, key_id="e0-a", profile="fast") as eng:
        msgs = [
            {"role": "system", "content": "You are a careful agent. " * 24},
            {"role": "user", "content": "hi"},
        ]
        eng.chat(msgs, max_tokens=2)
        time.sleep(0.4)  # deltas flush every 100 ms
        epoch = eng.health()["epoch"]
        batch = _get(f"{eng.url}/ramjet/reports?epoch={epoch}&after=0")
        frames = [decode(f, 1 << 20) for f in iter_frames(batch)]
        kinds = {s.envelope.kind for s in frames}
        assert {"delta", "profile"} <= kinds, kinds
        for s in frames:
            assert s.envelope.engine_id == "e0" and s.envelope.key_id == "e0-a"
            assert s.envelope.epoch == epoch
            assert verify_signature(s, key.public_key())
        delta = next(s for s in frames if s.envelope.kind == "delta")
        assert json.loads(delta.envelope.body)["stored"]  # the two prompt blocks
        snap = decode(_get(f"{eng.url}/ramjet/snapshot"), 1 << 20)
        assert snap.envelope.kind == "snapshot" and verify_signature(snap, key.public_key())
