"""Envelope: canonical bytes, signing, decoding, the test vectors, bodies, key ring, CLI."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from reports_fixtures import E0, KEYS

from ramjet.cli import main as cli_main
from ramjet.reports.bodies import (
    BodyError,
    DeltaBody,
    DeltaBuilder,
    LoadBody,
    ProfileBody,
    SnapshotBody,
    encode_body,
    pack_keys,
    parse_body,
)
from ramjet.reports.config import KeysConfig
from ramjet.reports.envelope import (
    DOMAIN,
    Envelope,
    EnvelopeError,
    decode,
    sign,
    verify_signature,
)
from ramjet.reports.keys import KeyError_, KeyRing, load_private_key, parse_public_key
from ramjet.types import EngineId, PrefixKey, Tier

VECTORS = Path(__file__).resolve().parents[2] / "vectors" / "report_envelope.json"


def test_vectors_reproduce_canonical_bytes_signature_and_body() -> None:
    doc = json.loads(VECTORS.read_text())
    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(doc["seed_hex"]))
    pub = parse_public_key(_b64(doc["public_key_hex"]))
    assert key.public_key().public_bytes_raw().hex() == doc["public_key_hex"]
    assert len(doc["cases"]) >= 3
    for case in doc["cases"]:
        env = Envelope(
            EngineId(case["engine_id"]),
            case["key_id"],
            case["epoch"],
            case["seq"],
            case["issued_at_ms"],
            case["kind"],
            case["body"].encode(),
        )
        assert env.canonical_bytes().hex() == case["canonical_hex"]
        frame = sign(env, key)
        assert frame.hex() == case["frame_hex"]
        assert frame[-64:].hex() == case["signature_hex"]
        signed = decode(frame, 1 << 20)
        assert signed.envelope == env and verify_signature(signed, pub)
        # the body text is what the pydantic model encodes to
        body = parse_body(case["kind"], case["body"].encode())
        assert encode_body(body).decode() == case["body"]


def _b64(hexkey: str) -> str:
    import base64

    return base64.b64encode(bytes.fromhex(hexkey)).decode()


def test_canonical_bytes_are_length_prefixed_fields() -> None:
    env = Envelope(EngineId("e0"), "k", 1, 2, 3, "load", b"{}")
    c = env.canonical_bytes()
    assert c.startswith(DOMAIN)
    assert c[len(DOMAIN) :] == (
        b"\x00\x00\x00\x02e0"
        + b"\x00\x00\x00\x01k"
        + b"\x00\x00\x00\x08" + (1).to_bytes(8, "big")
        + b"\x00\x00\x00\x08" + (2).to_bytes(8, "big")
        + b"\x00\x00\x00\x08" + (3).to_bytes(8, "big")
        + b"\x00\x00\x00\x04load"
        + b"\x00\x00\x00\x02{}"
    )  # fmt: skip
    # moving a byte between fields changes the bytes (no ambiguity)
    other = Envelope(EngineId("e0k"), "k", 1, 2, 3, "load", b"{}")
    assert other.canonical_bytes() != c


def test_envelope_rejects_bad_fields() -> None:
    for bad in (
        {"engine_id": ""},
        {"engine_id": "e 0"},
        {"key_id": "x" * 65},
        {"seq": -1},
        {"epoch": 2**64},
        {"kind": "gossip"},
        {"issued_at_ms": True},
    ):
        fields: dict[str, object] = {
            "engine_id": "e0",
            "key_id": "k",
            "epoch": 1,
            "seq": 1,
            "issued_at_ms": 1,
            "kind": "delta",
            "body": b"",
        }
        fields.update(bad)
        with pytest.raises(ValueError):
            Envelope(**fields)  # type: ignore[arg-type]


def test_decode_refuses_oversize_before_parsing_and_reports_reasons() -> None:
    f = sign(Envelope(E0, "e0-a", 1, 1, 1, "delta", b"{}"), KEYS["e0-a"])
    with pytest.raises(EnvelopeError) as e:
        decode(f, len(f) - 1)
    assert e.value.reason == "oversize"
    with pytest.raises(EnvelopeError) as e:
        decode(b"\xff" * 10_000_000, 4 << 20)  # 10 MB of garbage: refused by its length
    assert e.value.reason == "oversize"
    with pytest.raises(EnvelopeError) as e:
        decode(f[:-68], 1 << 20)
    assert e.value.reason == "missing_signature"
    for cut in range(len(f) - 68):
        with pytest.raises(EnvelopeError):
            decode(f[:cut], 1 << 20)


def test_key_packing_and_bounds() -> None:
    keys = [0, 1, 2**64 - 1, 0x1122334455667788]
    body = parse_body("delta", encode_body(DeltaBody(evicted=tuple(PrefixKey(k) for k in keys))))
    assert isinstance(body, DeltaBody) and list(body.evicted) == keys
    # a million keys cost 8 MB packed (10.7 MB in base64): over any cap before parsing
    assert len(pack_keys(range(1000))) == 10_668
    with pytest.raises(BodyError):
        parse_body("delta", b'{"evicted": "' + b"A" * (1 << 23) + b'"}')
    with pytest.raises(BodyError):
        parse_body(
            "delta",
            encode_body(DeltaBody(evicted=tuple(PrefixKey(i) for i in range(10)))),
            max_keys=9,
        )
    with pytest.raises(ValueError):
        DeltaBody(evicted=(PrefixKey(-1),))
    for raw in (
        b'{"evicted": "AAA="}',
        b'{"evicted": 5}',
        b'{"x": 1}',
        b"nope",
        b'{"stored": [{"tier": "l3", "keys": ""}]}',
    ):
        with pytest.raises(BodyError):
            parse_body("delta", raw)
    with pytest.raises(BodyError):
        parse_body("snapshot", b'{"residency": []}')  # seq is required
    assert isinstance(parse_body("snapshot", b'{"seq": 0}'), SnapshotBody)
    with pytest.raises(BodyError):
        parse_body(
            "load",
            b'{"queued_prompt_tokens": 1, "running_requests": 0, "waiting_requests": 0, "kv_utilization": 2}',
        )


def test_profile_body_is_the_engine_profile() -> None:
    from ramjet.policy.profile import CurvePoint, EngineProfile

    prof = EngineProfile(
        prefill_curve=[CurvePoint(context_tokens=0, seconds_per_token=1e-4)],
        replay_floor_s=0.01,
        global_kv_bytes_per_token=1024,
    )
    body = parse_body("profile", encode_body(ProfileBody.model_validate(prof.model_dump())))
    assert isinstance(body, EngineProfile) and body.model_dump() == prof.model_dump()
    with pytest.raises(BodyError):
        parse_body("profile", b'{"prefill_curve": []}')


def test_delta_builder_keeps_the_last_change_per_key() -> None:
    b = DeltaBuilder()
    b.stored(PrefixKey(1), Tier.HBM)
    b.moved(PrefixKey(1), Tier.HOST)  # stored then moved in one delta: stored in host
    b.stored(PrefixKey(2), Tier.HBM, ttl_ms=1500)
    b.evicted(PrefixKey(2))
    b.moved(PrefixKey(3), Tier.SSD)
    b.swa_created(PrefixKey(9), 60_000)
    b.swa_created(PrefixKey(10), 60_000)
    b.swa_expired(PrefixKey(10))
    d = b.build()
    assert [(t.tier, t.keys) for t in d.stored] == [("host", (1,))]
    assert [(t.tier, t.keys) for t in d.moved] == [("ssd", (3,))]
    assert d.evicted == (2,) and d.swa_expired == (10,)
    assert [(s.keys, s.ttl_ms) for s in d.swa_created] == [((9,), 60_000)]
    assert len(b) == 0 and b.build().is_empty()
    assert isinstance(
        parse_body(
            "load",
            encode_body(
                LoadBody(
                    queued_prompt_tokens=0, running_requests=0, waiting_requests=0, kv_utilization=0
                )
            ),
        ),
        LoadBody,
    )


def test_key_ring_from_config_files_and_inline(tmp_path: Path) -> None:
    rc = cli_main(
        ["keys", "generate", "--engine", "e0", "--key-id", "e0-x", "--out", str(tmp_path)]
    )
    assert rc == 0
    priv = tmp_path / "e0-x.key"
    assert stat.S_IMODE(os.stat(priv).st_mode) == 0o600
    assert (
        cli_main(["keys", "generate", "--engine", "e0", "--key-id", "e0-x", "--out", str(tmp_path)])
        == 2
    )
    assert (
        cli_main(
            ["keys", "generate", "--engine", "bad id", "--key-id", "k", "--out", str(tmp_path)]
        )
        == 2
    )
    signer = load_private_key(priv)
    cfg = KeysConfig.model_validate(
        {
            "engines": {
                "e0": [{"key_id": "e0-x", "public_key_file": "e0-x.pub"}],
                "e1": [
                    {
                        "key_id": "e1-a",
                        "public_key": _b64(KEYS["e1-a"].public_key().public_bytes_raw().hex()),
                    }
                ],
            },
            "retired": ["e0-gone"],
        }
    )
    ring = KeyRing.from_config(cfg, base_dir=tmp_path)
    assert ring.engines() == {"e0", "e1"}
    key = ring.lookup("e0-x", E0)
    assert not isinstance(key, str)
    f = sign(Envelope(E0, "e0-x", 1, 1, 1, "delta", b"{}"), signer)
    assert verify_signature(decode(f, 1 << 20), key)
    assert ring.lookup("e0-gone", E0) == "retired_key"
    assert ring.lookup("e1-a", E0) == "wrong_engine_key"
    assert ring.lookup("zz", E0) == "unknown_key"


def test_keys_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        KeysConfig.model_validate({"engines": {"e0": [{"key_id": "k"}]}})  # no key
    with pytest.raises(ValueError):  # one key id for two engines
        KeysConfig.model_validate(
            {
                "engines": {
                    "e0": [{"key_id": "k", "public_key": "x"}],
                    "e1": [{"key_id": "k", "public_key": "x"}],
                }
            }
        )
    bad = KeysConfig.model_validate(
        {"engines": {"e0": [{"key_id": "k", "public_key": "bm90IGEga2V5"}]}}
    )
    with pytest.raises(KeyError_, match=r"e0\[k\]"):
        KeyRing.from_config(bad)
    missing = KeysConfig.model_validate(
        {"engines": {"e0": [{"key_id": "k", "public_key_file": "nope.pub"}]}}
    )
    with pytest.raises(KeyError_, match="cannot read"):
        KeyRing.from_config(missing, tmp_path)
