"""Issue 11 end to end: a reference-engine process publishing its cache events in vLLM's
ZMQ wire format (`--kv-events`, with a replay socket), a `ramjet sidecar` process signing
them with its own key, and the real router (in this process) routing in front of the
engine with token-block keys (`key_pools`, the reference engine's byte tokenizer) and
pulling the sidecar's reports. The router knows only the sidecar's public key.

Workload: multi-turn chat sessions with tiers small enough that blocks are demoted
HBM -> host -> SSD; the engine withholds live batch 2 (kept for replay). Then:
- the sidecar saw the gap and healed it from the replay socket (no truncation);
- the router's residency for the engine (exact entries) equals the engine's own cache
  (`/cache`, in text keys, mapped onto token keys by the prompts sent), with demoted
  blocks in it;
- an unsigned frame and a frame forged with another key, pushed to the router's push listener,
  are refused and change nothing.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))

from engines import EngineProcess, free_port
from sidecars import SidecarProcess as Sidecar
from sidecars import get_json as _get_json
from sidecars import router_blocks as _router_blocks

from ramjet.app.server import RouterServer
from ramjet.config import load_policy
from ramjet.fleet.signals import REPORTS_KEY
from ramjet.keys.prefix import compute_keys, key_seed, render_chat
from ramjet.keys.tokens import compute_token_keys, token_key_seed
from ramjet.reports.bodies import DeltaBody, encode_body
from ramjet.reports.envelope import Envelope, sign

pytestmark = pytest.mark.timeout(90)

MODEL = "mini-v4"


def _endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


async def test_sidecar_signs_vllm_events_and_router_matches_engine(tmp_path: Path) -> None:
    from ramjet.reports.keys import write_keypair

    priv, _pub, _ = write_keypair(tmp_path / "keys", "e0-sc")
    ev, rp = _endpoint(), _endpoint()
    (tmp_path / "e0").mkdir()
    engine = EngineProcess(
        "e0",
        free_port(),
        tmp_path / "e0",
        {
            "window": 16, "profile": "skip", "log_level": "WARNING", "max_gen": 4,
            "hbm_tokens": 512, "host_tokens": 512, "ssd_tokens": 65536,
            "kv_events": ev, "kv_events_replay": rp, "kv_events_drop_live": "2",
        },
    )  # fmt: skip
    sidecar: Sidecar | None = None
    server: RouterServer | None = None
    try:
        await asyncio.to_thread(engine.start)
        sc_port = free_port()
        argv = [sys.executable, "-m", "ramjet", "sidecar", "--engine-kind", "vllm",
                "--engine-id", "e0", "--engine-url", engine.url, "--events", ev, "--replay", rp,
                "--key", str(priv), "--key-id", "e0-sc", "--model", MODEL,
                "--block-tokens", "256", "--port", str(sc_port), "--load-interval", "0.5",
                "--profile", "skip",
                "--log-level", "WARNING"]  # fmt: skip
        sidecar = await asyncio.to_thread(Sidecar, argv, sc_port, tmp_path / "sidecar.log")
        policy = tmp_path / "policy.yaml"
        policy.write_text(f"""\
engines:
  - {{id: e0, url: "{engine.url}"}}
incumbent: {{name: prefix_affinity}}
timeouts: {{first_byte_s: 30, connect_s: 1}}
key_pools:
  - {{name: ref, engines: [e0], keys_mode: tokens, tokenizer: bytes, block_tokens: 256}}
reports:
  engines: {{e0: "{sidecar.url}"}}
  poll: {{wait_s: 0.5, timeout_s: 3, backoff_min_s: 0.05, backoff_max_s: 0.2}}
  push: {{port: 0}}
keys:
  engines:
    e0: [{{key_id: e0-sc, public_key_file: keys/e0-sc.pub}}]
""")
        server = RouterServer(load_policy(policy), policy_path=str(policy))
        await server.start()
        await asyncio.sleep(0.5)  # ZMQ slow joiner: the subscription reaches the engine

        text_to_token: dict[int, int] = {}
        sessions = [
            [{"role": "system", "content": f"Session {n}: agent {n} at work. " * 20},
             {"role": "user", "content": f"Start task {n}."}]
            for n in range(3)
        ]  # fmt: skip
        async with aiohttp.ClientSession() as http:
            for turn in range(3):
                for msgs in sessions:
                    rendered = render_chat(msgs)
                    tk = compute_keys(rendered, key_seed(MODEL)).blocks
                    kk = compute_token_keys(list(rendered.text), token_key_seed(MODEL), 256)
                    text_to_token.update(zip(tk, kk.blocks, strict=True))
                    body = {"model": MODEL, "messages": msgs, "max_tokens": 2}
                    async with http.post(server.url + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        data = await r.json()
                    msgs += [
                        {"role": "assistant", "content": data["choices"][0]["message"]["content"]},
                        {"role": "user", "content": f"Continue with step {turn}."},
                    ]

            # the router's residency equals the engine's cache, mapped onto token keys
            deadline = time.monotonic() + 15
            while True:
                cache = await asyncio.to_thread(_get_json, engine.url + "/cache")
                blocks = {b["key"]: b["tier"] for b in cache["blocks"]}
                assert set(blocks) <= set(text_to_token), "engine holds a block never sent"
                want = {text_to_token[k]: t for k, t in blocks.items()}
                mine = _router_blocks(server, "e0")
                if mine == want:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"router {sorted(mine.items())[:6]} != engine {sorted(want.items())[:6]}"
                        f"; sidecar {sidecar.health()}"
                    )
                await asyncio.sleep(0.2)
            assert {"hbm", "host", "ssd"} <= set(want.values()), want
            health = sidecar.health()
            assert health["stream"]["gaps"] >= 1 and health["stream"]["healed"] >= 1, health
            assert health["stream"].get("truncated", 0) == 0, health

            # unsigned and forged frames pushed straight to the router change nothing
            before = _router_blocks(server, "e0")
            forged = Envelope(
                "e0", "e0-sc", 2**62, 1, int(time.time() * 1000), "delta",
                encode_body(DeltaBody(evicted=tuple(before))),
            )  # fmt: skip
            frames = [
                sign(forged, Ed25519PrivateKey.generate()),  # right key id, wrong key
                sign(forged, Ed25519PrivateKey.generate())[:-68],  # no signature
                json.dumps({"evicted": list(before)}).encode(),  # not a frame at all
            ]
            for frame in frames:
                async with http.post(server.app[REPORTS_KEY].push_url, data=frame) as r:
                    assert r.status == 400, (r.status, await r.text())
            assert _router_blocks(server, "e0") == before
            reg = server.router.metrics.registry
            rejected = sum(
                reg.get_sample_value(
                    "ramjet_reports_rejected_total", {"engine": e, "reason": reason}
                )
                or 0.0
                for e in ("e0", "unknown")
                for reason in ("bad_signature", "malformed", "missing_signature")
            )
            assert rejected >= 3
    finally:
        if server is not None:
            await server.stop(drain_s=1.0)
        if sidecar is not None:
            sidecar.stop()
        engine.stop()
