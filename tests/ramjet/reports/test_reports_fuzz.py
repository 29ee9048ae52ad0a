"""Fuzz the verifier (RELIABILITY rows 17-22): thousands of mutated reports, real Ed25519
keys, valid reports interleaved. Every mutant is rejected; every valid report accepted;
the tables end exactly as the valid reports alone make them."""

from __future__ import annotations

import random
import time
from collections import Counter

from reports_fixtures import E0, E1, KEYS, WALL0, frame, rig

from ramjet.reports.bodies import DeltaBody, SnapshotBody, TierKeys, encode_body
from ramjet.reports.envelope import Envelope, sign
from ramjet.reports.verify import Accepted, Rejected
from ramjet.residency.store import Table
from ramjet.types import PrefixKey, Tier

MUTANTS_WANTED = 10_000
TIERS = ("hbm", "host", "ssd")


def test_fuzz_verifier_rejects_every_mutant_and_accepts_every_valid_report() -> None:
    rng = random.Random(20261129)
    r = rig(rate_per_s=1e6, burst=10**6, max_report_bytes=8192, max_keys=64)
    proc = r.processor
    model: dict[int, Tier] = {}  # what the valid reports say e0 holds
    accepted_valid: list[bytes] = []
    kinds: Counter[str] = Counter()
    mutants = valid = 0
    seq = 0
    epoch = 7
    ms = int(WALL0 * 1000)
    started = time.perf_counter()

    def reject(f: bytes, kind: str, expected: object = None) -> None:
        nonlocal mutants
        out = proc.submit(f, expected_engine=expected)  # type: ignore[arg-type]
        assert isinstance(out, Rejected), (kind, out)
        kinds[kind] += 1
        mutants += 1

    def signed(body: bytes, **kw: object) -> bytes:
        fields = {
            "engine_id": E0,
            "key_id": "e0-a",
            "epoch": epoch,
            "seq": seq + 1,
            "issued_at_ms": ms,
            "kind": "delta",
            "body": body,
        }
        signer = kw.pop("signer", None)
        fields.update(kw)
        return sign(Envelope(**fields), KEYS[signer or fields["key_id"]])  # type: ignore[arg-type]

    while mutants < MUTANTS_WANTED:
        # the next valid report: mostly deltas, sometimes a snapshot of the model
        ms += 1
        r.clocks.wall = ms / 1000
        if rng.random() < 0.08:
            by_tier: dict[str, list[PrefixKey]] = {}
            for k, t in model.items():
                by_tier.setdefault(t.label, []).append(PrefixKey(k))
            body_obj = SnapshotBody(
                seq=seq,
                residency=[TierKeys(tier=t, keys=tuple(ks)) for t, ks in by_tier.items()],  # type: ignore[arg-type]
            )
            v = frame(body_obj, epoch=epoch, seq=seq, issued_at_ms=ms)
            next_seq, change = seq, None
        else:
            k, t = rng.randrange(40), rng.choice(TIERS)
            if rng.random() < 0.3 and model:
                k = rng.choice(list(model))
                body_obj = DeltaBody(evicted=(PrefixKey(k),))
                change = (k, None)
            else:
                body_obj = DeltaBody(stored=[TierKeys(tier=t, keys=(PrefixKey(k),))])  # type: ignore[arg-type]
                change = (k, Tier.parse(t))
            key_id = rng.choice(("e0-a", "e0-b"))  # rotation overlap: both valid
            v = frame(body_obj, epoch=epoch, seq=seq + 1, issued_at_ms=ms, key_id=key_id)
            next_seq = seq + 1

        # mutants of it and around it
        for _ in range(3):
            b = bytearray(v)
            for _ in range(rng.randint(1, 3)):
                i = rng.randrange(len(b))
                b[i] ^= 1 << rng.randrange(8)
            reject(bytes(b), "bit_flip")
        reject(v[: rng.randrange(len(v))], "truncation")
        reject(v + bytes(rng.randrange(1, 8)), "trailing_bytes")
        reject(v + bytes(9000), "oversize")
        body = encode_body(body_obj)
        reject(signed(body, seq=next_seq, signer="stranger"), "wrong_key")
        reject(signed(body, seq=next_seq, key_id="e0-old"), "retired_key")
        reject(signed(body, seq=next_seq, key_id="e1-a"), "other_engine_key")
        reject(
            signed(body, engine_id=E1, key_id="e1-a", seq=next_seq, signer="e0-a"),
            "signed_by_other_engine",
        )
        reject(signed(body, seq=next_seq, issued_at_ms=ms - 121_000), "too_old")
        reject(signed(body, seq=next_seq, issued_at_ms=ms + 6_000), "future")
        if accepted_valid:
            reject(rng.choice(accepted_valid), "replay")
        if seq >= 1:
            reject(signed(body, seq=rng.randint(1, seq)), "reordered")
            reject(signed(body, epoch=epoch - 1, seq=next_seq), "old_epoch")
        bad = rng.choice(
            [
                b"{",
                b"[]",
                b'{"stored": [{"tier": "l4", "keys": ""}]}',
                b'{"evicted": "not base64!"}',
                b'{"evicted": "AAAA"}',
                b'{"surprise": 1}',
                encode_body(DeltaBody(evicted=tuple(PrefixKey(i) for i in range(65)))),
            ]
        )
        reject(signed(bad, seq=next_seq), "malformed_body")
        reject(frame(body_obj, engine=E1, key_id="e1-a", issued_at_ms=ms), "engine_mismatch", E0)

        out = proc.submit(v, expected_engine=E0)
        assert isinstance(out, Accepted), out
        valid += 1
        accepted_valid.append(v)
        seq = next_seq
        if change is not None:
            k, t2 = change
            if t2 is None:
                model.pop(k, None)
            else:
                model[k] = t2

    elapsed = time.perf_counter() - started
    assert mutants >= MUTANTS_WANTED and valid > 500
    assert len(kinds) == 15, kinds
    counted = sum(
        s.value
        for m in r.registry.collect()
        if m.name == "ramjet_reports_rejected"
        for s in m.samples
        if s.name == "ramjet_reports_rejected_total"
    )
    assert counted == mutants
    # the tables hold exactly what the valid reports say
    held = {
        k: e.tier
        for k in range(40)
        if (e := r.tables.store.get(Table.GLOBAL, E0, PrefixKey(k), r.clocks.mono, False))
    }
    assert held == model
    assert proc.cursor(E0) is not None and proc.cursor(E0).seq == seq  # type: ignore[union-attr]
    assert r.accepted("e0", "delta") + r.accepted("e0", "snapshot") == valid
    assert elapsed < 60, f"fuzz took {elapsed:.1f} s"
