"""The engine's profiler: measures, on the machine it runs on, the figures the router's cost
model predicts TTFT from, as a `ramjet.policy.profile.EngineProfile`.

- Prefill curve: one sequence is grown through context lengths c_0 < c_1 < ...; at each
  c_i, prefilling `probe` new tokens is timed, giving seconds per token at c_i. The fixed
  per-call overhead is the intercept of two probe sizes at context 0.
- Replay floor: a state rebuilt from exported global blocks (`state_from_global`) replays
  its last window (`replay`), timed; this is what an SWA miss with warm global KV costs.
- Tier restore costs: a throw-away `GlobalKVStore` (same code as serving) holds real
  blocks; they are demoted to host, then to SSD, and fetched back. Latency is the median
  one-block fetch; bandwidth is bytes / (time - latency) of a many-block fetch.
- Decode step time (batch 1), DSpark acceptance and tokens per step (a short greedy run
  through `Speculator`), bytes per token (global state bytes per block / block tokens)
  and SWA bytes per sequence (`export_tail`).

Modes: "fast" (at start, a few seconds: short contexts, few repeats) and "full"
(`python -m engine_stub profile --mode full`: longer contexts, more repeats).
"""

from __future__ import annotations

import logging
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_stub.kvstore import GlobalKVStore
from engine_stub.speculation import Speculator
from ramjet.policy.profile import CurvePoint, EngineProfile, TierCost
from ramjet.runtime.probe_lock import DEFAULT_PROBE_LOCK, host_lock
from ramjet.types import PrefixKey, Tier

log = logging.getLogger(__name__)

_MODES: dict[str, dict[str, Any]] = {
    "fast": {"contexts": [0, 256, 512], "probe": 64, "repeats": 2, "blocks": 8, "spec_steps": 6},
    "full": {
        "contexts": [0, 512, 1024, 2048, 4096],
        "probe": 128,
        "repeats": 3,
        "blocks": 32,
        "spec_steps": 24,
    },
}


@dataclass
class ProfileResult:
    profile: EngineProfile
    extra: dict[str, Any] = field(default_factory=dict)
    """Figures the profile schema has no field for (timings of each phase, raw points)."""

    def to_json(self) -> dict[str, Any]:
        return {"profile": self.profile.model_dump(mode="json"), "extra": self.extra}


def _timed(fn: Any, *args: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


class Profiler:
    def __init__(
        self, model: Any, *, mode: str = "fast", device: str = "cpu", seed: int = 0
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"profile mode must be one of {sorted(_MODES)}, not {mode!r}")
        self.model = model
        self.cfg = model.cfg
        self.mode = mode
        self.p = _MODES[mode]
        self.device = device
        self.rng = random.Random(seed)

    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(32, 127) for _ in range(n)]

    def run(self) -> ProfileResult:
        t_start = time.perf_counter()
        extra: dict[str, Any] = {"mode": self.mode}
        curve, overhead = self._prefill_curve(extra)
        blobs, ids = self._blocks(2)
        bpt = statistics.mean(len(b) for b in blobs) / self.cfg.block_tokens
        replay_s = self._replay_floor(blobs, ids)
        tail_bytes = self._tail_bytes()
        tiers = self._tiers(max(1, int(bpt * self.cfg.block_tokens)), extra)
        decode_s = self._decode_step()
        acceptance, tps = self._spec(extra)
        extra["seconds"] = round(time.perf_counter() - t_start, 3)
        profile = EngineProfile(
            prefill_curve=curve,
            prefill_overhead_s=overhead,
            replay_floor_s=replay_s,
            replay_window_tokens=self.cfg.window,
            global_kv_bytes_per_token=bpt,
            swa_bytes_per_sequence=tail_bytes,
            tiers=tiers,
            decode_step_s=decode_s,
            spec_acceptance=acceptance,
            spec_tokens_per_step=max(1.0, tps),
        )
        return ProfileResult(profile, extra)

    # -- pieces -----------------------------------------------------------------------

    def _prefill_curve(self, extra: dict[str, Any]) -> tuple[list[CurvePoint], float]:
        m, probe, reps = self.model, self.p["probe"], self.p["repeats"]
        points: list[CurvePoint] = []
        raw = []
        for c in self.p["contexts"]:
            times = []
            for _ in range(reps):
                st = m.new_state()
                if c:
                    m.prefill(st, self._ids(c))
                dt, _ = _timed(m.prefill, st, self._ids(probe))
                times.append(dt)
            sec = min(times)
            raw.append((c, sec))
            points.append(CurvePoint(context_tokens=c, seconds_per_token=sec / probe))
        small = min(_timed(m.prefill, m.new_state(), self._ids(8))[0] for _ in range(reps))
        big = raw[0][1]
        slope = max(0.0, (big - small) / (probe - 8))
        overhead = max(0.0, small - 8 * slope)
        # the curve holds the marginal rate; take the fixed overhead out of it
        points = [
            CurvePoint(context_tokens=c, seconds_per_token=max(1e-9, (sec - overhead) / probe))
            for c, sec in raw
        ]
        extra["prefill_points"] = [
            {"context": c, "new": probe, "seconds": round(s, 6)} for c, s in raw
        ]
        return points, overhead

    def _blocks(self, n: int) -> tuple[list[bytes], list[int]]:
        bt = self.cfg.block_tokens
        ids = self._ids(n * bt)
        st = self.model.new_state()
        self.model.prefill(st, ids)
        return [self.model.export_global(st, i * bt, (i + 1) * bt) for i in range(n)], ids

    def _replay_floor(self, blobs: list[bytes], ids: list[int]) -> float:
        n = len(blobs) * self.cfg.block_tokens
        times = []
        for _ in range(self.p["repeats"]):
            st = self.model.state_from_global(blobs, n)
            dt, _ = _timed(self.model.replay, st, ids[n - self.cfg.window : n])
            times.append(dt)
        return min(times)

    def _tail_bytes(self) -> int:
        st = self.model.new_state()
        self.model.prefill(st, self._ids(self.cfg.window + 8))
        return len(self.model.export_tail(st))

    def _tiers(self, block_bytes: int, extra: dict[str, Any]) -> dict[str, TierCost]:
        n = self.p["blocks"]
        bt = self.cfg.block_tokens
        out: dict[str, TierCost] = {}
        with tempfile.TemporaryDirectory(prefix="engine-profile-") as tmp:
            store = GlobalKVStore(
                block_tokens=bt,
                capacity_tokens=(n * bt, n * bt, n * bt),
                cache_dir=Path(tmp),
                fingerprint="profile",
                device=self.device,
            )
            keys = [PrefixKey(self.rng.getrandbits(64)) for _ in range(n)]
            for k in keys:
                store.put(k, self.rng.randbytes(block_bytes))
            for tier in (Tier.HOST, Tier.SSD):
                singles = []
                for k in keys[: min(4, n)]:
                    self._sink(store, [k], tier)
                    singles.append(store.fetch([k]).seconds_by_tier[tier])
                latency = statistics.median(singles)
                self._sink(store, keys, tier)
                got = store.fetch(keys)
                total = got.seconds_by_tier[tier]
                bw = got.nbytes / max(1e-9, total - latency * 0.5)
                out[tier.label] = TierCost(bandwidth_bytes_per_s=bw, latency_s=latency)
                extra[f"{tier.label}_fetch"] = {"bytes": got.nbytes, "seconds": round(total, 6)}
        return out

    @staticmethod
    def _sink(store: GlobalKVStore, keys: list[PrefixKey], tier: Tier) -> None:
        for k in keys:
            while (t := store.tier_of(k)) is not None and t < tier:
                store.demote(k)

    def _decode_step(self) -> float:
        st = self.model.new_state()
        logits = self.model.prefill(st, self._ids(64))
        tok = int((logits[-1] if logits.dim() == 2 else logits).argmax())
        times = []
        for _ in range(max(3, self.p["repeats"] * 2)):
            dt, out = _timed(self.model.decode_batch, [st], [tok])
            tok = int(out[0].argmax())
            times.append(dt)
        return statistics.median(times)

    def _spec(self, extra: dict[str, Any]) -> tuple[float, float]:
        spec = Speculator(self.model, min_survival=0.0)
        st = self.model.new_state()
        logits = self.model.prefill(st, self._ids(64))
        tok = int((logits[-1] if logits.dim() == 2 else logits).argmax())
        produced = steps = 0
        for _ in range(self.p["spec_steps"]):
            got = spec.step(st, tok, 1, 64)
            if got is None:
                tok = int(self.model.decode_batch([st], [tok])[0].argmax())
                produced += 1
            else:
                tok = got[-1]
                produced += len(got)
            steps += 1
        acceptance = spec.accepted_total / spec.proposed_total if spec.proposed_total else 0.0
        extra["spec"] = {
            "steps": steps,
            "tokens": produced,
            "proposed": spec.proposed_total,
            "accepted": spec.accepted_total,
        }
        return acceptance, produced / max(1, steps)


MIN_CPU_SHARE = 0.7
"""A probe whose process got less CPU than this share of its threads' wall time was
measured while something else ran on its cores: it is taken again."""


def cpu_share(cpu_s: float, wall_s: float, threads: int) -> float:
    """The CPU the process got over what its `threads` could have used in `wall_s`."""
    if wall_s <= 0:
        return 1.0
    return cpu_s / (wall_s * max(1, min(threads, os.cpu_count() or 1)))


def probe_quietly(
    run: Callable[[], ProfileResult],
    *,
    threads: int,
    lock_path: str | None = DEFAULT_PROBE_LOCK,
    tries: int = 3,
    pause_s: float = 2.0,
    lock_timeout_s: float = 300.0,
) -> ProfileResult:
    """Run the profiler alone among this host's engines (`lock_path`, None: no lock),
    and again, up to `tries` times with a pause between, while it did not get its CPU
    (`MIN_CPU_SHARE`: another process was busy on its cores, so every figure would read
    slow). Keeps the run that got the most CPU and records, in `extra`, its `cpu_share`,
    the tries taken and `contended` when no try was quiet (the router's online
    calibration then corrects what the probe got wrong, `ramjet.policy.calibration`)."""
    with host_lock(lock_path, lock_timeout_s) as waited_s:
        best: tuple[float, ProfileResult] | None = None
        for i in range(max(1, tries)):
            c0, w0 = time.process_time(), time.perf_counter()
            result = run()
            share = cpu_share(time.process_time() - c0, time.perf_counter() - w0, threads)
            if best is None or share > best[0]:
                best = (share, result)
            if share >= MIN_CPU_SHARE:
                break
            log.warning(
                "profile try %d got %.0f%% of its CPU: something else is busy here",
                i + 1,
                100 * share,
            )
            if i + 1 < tries:
                time.sleep(pause_s)
        assert best is not None
        share, result = best
        result.extra.update(
            cpu_share=round(share, 3),
            probe_tries=i + 1,
            contended=share < MIN_CPU_SHARE,
            lock_wait_s=round(waited_s, 3),
        )
        return result
