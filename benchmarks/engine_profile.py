"""Reference-engine profile, and TTFT per turn of a 20-turn agent session.

Prints the profile the engine measures at start (`engine_stub.profiler`, fast mode) and,
for one agent session (a system prompt, then per turn a user message, an assistant reply
and a tool result), the time to first token of each turn in three regimes, through the
engine's own restore path (`PromptCache`) on the real model:

- warm: global KV and SWA state from the previous turn are live (SWA resume);
- swa-expired: the SWA pool is emptied before each turn (bounded replay of one window);
- cold: no cache at all (the baseline: full prefill every turn).

TTFT here is restore + prefill + the first token's logits (no HTTP, no queue).
Run: .venv/bin/python benchmarks/engine_profile.py [--turns 20] [--window 128] [--quick]
(`--quick`, make bench: 6 turns). Self-check, or the run fails: every turn's first token
is the same in the three regimes (a restore computes what a full prefill computes), warm
turns after the first restore cached tokens and cold ones none.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_stub.kvstore import GlobalKVStore
from engine_stub.model import MiniV4, ModelConfig
from engine_stub.profiler import Profiler
from engine_stub.prompt_cache import PromptCache
from engine_stub.swa_pool import SWAPool
from ramjet.decisions.prompt_work import PromptWork
from ramjet.keys.prefix import compute_keys, key_seed, render_chat


def session(turns: int) -> list[list[dict[str, str]]]:
    msgs = [{"role": "system", "content": "You are a coding agent. Use tools; be brief. " * 12}]
    prompts = []
    for t in range(turns):
        msgs.append(
            {"role": "user", "content": f"Step {t}: open src/mod_{t}.py and fix the failing test."}
        )
        prompts.append(list(msgs))
        msgs.append({"role": "assistant", "content": f"Reading src/mod_{t}.py now."})
        msgs.append(
            {
                "role": "tool",
                "content": f"src/mod_{t}.py: def f{t}(x): return x + {t}  # 2 tests fail\n",
            }
        )
    return prompts


def run(
    model: MiniV4, prompts: list[list[dict[str, str]]], regime: str, tmp: Path
) -> list[tuple[float, PromptWork, int]]:
    kv = GlobalKVStore(
        block_tokens=model.cfg.block_tokens,
        capacity_tokens=(1 << 20, 0, 0),
        cache_dir=None,
        fingerprint="bench",
    )
    swa = SWAPool(cap_bytes=1 << 30, ttl_s=3600)
    cache = PromptCache(model, kv, swa, window=model.cfg.window)
    seed = key_seed("mini-v4")
    out = []
    for msgs in prompts:
        rendered = render_chat(msgs)
        keys = compute_keys(rendered, seed)
        ids = list(rendered.text)
        if regime == "swa-expired":
            swa.ttl_s = 1e-9
            swa.sweep()
            swa.ttl_s = 3600
        work = PromptWork()
        t0 = time.perf_counter()
        if regime == "cold":
            st, start = model.new_state(), 0
        else:
            st, start = cache.restore(ids, keys, work)
        logits = model.prefill(st, ids[start:])
        token = int(logits.argmax())
        ttft = time.perf_counter() - t0
        work.prefilled_tokens = len(ids) - start
        if regime != "cold":
            cache.store(st, ids, keys)
        out.append((ttft, work, token))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="--turns 6 (make bench)")
    args = ap.parse_args()
    if args.quick:
        args.turns = 6
    torch.set_num_threads(args.threads)
    model = MiniV4(ModelConfig.tiny(window=args.window), seed=0)
    t0 = time.perf_counter()
    prof = Profiler(model, mode="fast").run()
    print(f"# profile (fast mode, {time.perf_counter() - t0:.1f}s)")
    print(json.dumps(prof.to_json()["profile"], indent=1))
    prompts = session(args.turns)
    results = {r: run(model, prompts, r, Path("/tmp")) for r in ("warm", "swa-expired", "cold")}
    print(f"\n# TTFT per turn, ms (window {args.window}); tokens: prompt / cached / replayed")
    print(
        f"{'turn':>4} {'prompt':>6} | {'warm':>8} {'cached':>6} | {'swa-exp':>8} {'replay':>6} | {'cold':>8}"
    )
    for i in range(len(prompts)):
        (tw, ww, _), (ts, ws, _), (tc, _, _) = (
            results["warm"][i],
            results["swa-expired"][i],
            results["cold"][i],
        )
        n = len(render_chat(prompts[i]).text)
        print(
            f"{i + 1:>4} {n:>6} | {tw * 1e3:>8.1f} {ww.cached_tokens:>6} | {ts * 1e3:>8.1f} {ws.replayed_tokens:>6} | {tc * 1e3:>8.1f}"
        )
    mean = {r: statistics.mean(t for t, _, _ in v[1:]) for r, v in results.items()}
    print(f"\nmean TTFT turns 2..{len(prompts)}: warm {mean['warm'] * 1e3:.1f} ms, "
          f"swa-expired {mean['swa-expired'] * 1e3:.1f} ms, cold {mean['cold'] * 1e3:.1f} ms")  # fmt: skip
    print(f"cold / warm = {mean['cold'] / mean['warm']:.1f}x; swa-expired / warm = {mean['swa-expired'] / mean['warm']:.2f}x "
          f"(replay floor {prof.profile.replay_floor_s * 1e3:.1f} ms)")  # fmt: skip
    for regime, ms in mean.items():
        print(
            f"figure: engine restore TTFT, turns 2..{len(prompts)} / {regime} = {ms * 1e3:.1f} ms"
        )
    bad = check(results)
    if bad:
        print(f"self-check: FAILED: {'; '.join(bad[:3])}")
        return 1
    print(
        f"self-check: {len(prompts)} turns: the first token is the same warm, SWA-expired and "
        "cold; warm turns after the first restored cached tokens, cold ones none"
    )
    return 0


def check(results: dict[str, list[tuple[float, PromptWork, int]]]) -> list[str]:
    bad = []
    for i, ((_, ww, a), (_, _, b), (_, cw, c)) in enumerate(
        zip(results["warm"], results["swa-expired"], results["cold"], strict=True)
    ):
        if not a == b == c:
            bad.append(f"turn {i + 1}: first token warm {a}, swa-expired {b}, cold {c}")
        if i > 0 and ww.cached_tokens <= 0:
            bad.append(f"turn {i + 1}: the warm restore cached nothing")
        if cw.cached_tokens:
            bad.append(f"turn {i + 1}: cold cached {cw.cached_tokens} tokens")
    return bad


if __name__ == "__main__":
    sys.exit(main())
