"""Reference-model step costs on this machine: prefill tokens/s at 512, 2k and 8k tokens of
context, decode step time (batch 1 and 4 at 2k context), DSpark verify step, the cost
of a 128-token SWA replay, and the Engram prefetch per forward (bytes, fetch time, the
exposed wait) with the fetch overlapped with the earlier layers and inline. Baselines
measured in the same run: the same 512-token prefill through the plain torch reference ops
(`kernels.dispatch.use_backend("reference")`); the inline Engram fetch.

    .venv/bin/python benchmarks/model_step.py [--threads 1] [--quick]

`make bench` runs `--quick` (no 8k point). Self-checks, or the run fails: the 512-token
prefill's logits are finite and pick the same next token through the default ops as
through the plain torch reference ops (the baseline computes the same thing), and every
draft+verify step emits at least one token.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# benchmarks/kernels.py would shadow the `kernels` package: drop this script's folder.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402

from engine_stub.model import MiniV4, ModelConfig  # noqa: E402
from kernels import dispatch  # noqa: E402


class BenchError(RuntimeError):
    """A self-check failed: the run measured something other than it claims."""


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(32, 127, (n,), generator=g).tolist()


def prefill_rate(model: MiniV4, n: int) -> tuple[float, float, float]:
    """(tokens/s by wall clock, wall seconds, tokens/s by this process's CPU time). On a
    shared machine the CPU-time rate is what one uncontended core would do."""
    st = model.new_state()
    c0, t0 = time.process_time(), time.perf_counter()
    model.prefill(st, _prompt(n))
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    return n / dt, dt, n / dc


def engram_prefetch(model: MiniV4, rounds: int = 4) -> None:
    """Per forward: Engram bytes fetched, fetch time, the time the layers waited for rows
    (exposed), and the forward's wall and CPU time; overlapped vs inline in alternating
    rounds, for a 2048-token prefill (512-token chunks) and 8 batch-4 decode steps at 2k."""
    pf = model.backbone.engram
    keep = pf.overlap
    acc: dict[tuple[str, bool], list[float]] = {}
    states = [model.new_state() for _ in range(4)]
    for i, st in enumerate(states):
        model.prefill(st, _prompt(2048, seed=10 + i))

    def prefill() -> None:
        model.prefill(model.new_state(), _prompt(2048, seed=1))

    def decode() -> None:
        for _ in range(8):
            model.decode_batch(states, [int(s.last_logits.argmax()) for s in states])  # type: ignore[union-attr]

    try:
        for r in range(rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                pf.overlap = on
                for kind, fn in (("prefill 2048", prefill), ("decode batch 4", decode)):
                    s0 = model.engram_stats
                    c0, t0 = time.process_time(), time.perf_counter()
                    fn()
                    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                    s1 = model.engram_stats
                    got = (
                        s1.forwards - s0.forwards,
                        s1.bytes - s0.bytes,
                        s1.seconds - s0.seconds,
                        s1.wait_seconds - s0.wait_seconds,
                        wall,
                        cpu,
                    )
                    a = acc.setdefault((kind, on), [0.0] * 6)
                    for j, v in enumerate(got):
                        a[j] += v
    finally:
        pf.overlap = keep
    for (kind, on), (n, nbytes, fetch, wait, wall, cpu) in acc.items():
        print(
            f"engram {kind:<14} {'overlapped' if on else 'inline':<10}: per forward "
            f"{nbytes / n / 1024:6.1f} KiB, fetch {fetch / n * 1e3:5.2f} ms, exposed wait "
            f"{wait / n * 1e3:5.2f} ms; forward {wall / n * 1e3:6.1f} ms wall, "
            f"{cpu / n * 1e3:6.1f} ms CPU"
        )
    for kind in ("prefill 2048", "decode batch 4"):
        on_, off = acc[(kind, True)], acc[(kind, False)]
        print(
            f"engram {kind}: overlap hides {1 - on_[3] / max(off[3], 1e-12):.0%} of the inline "
            f"wait; forward CPU time overlapped/inline {on_[5] / off[5]:.2f}x, wall "
            f"{on_[4] / off[4]:.2f}x"
        )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="skip the 8k point")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = MiniV4(ModelConfig.tiny(window=128), seed=0)
    prefill_rate(model, 256)  # warm up

    load = os.getloadavg()[0]
    print(
        f"reference model step costs (threads={args.threads}, window=128, "
        f"load average {load:.1f} on {os.cpu_count()} CPUs)"
    )
    sizes = [512, 2048] if args.quick else [512, 2048, 8192]
    rates = {}
    for n in sizes:
        rate, dt, cpu_rate = prefill_rate(model, n)
        rates[n] = rate
        print(
            f"prefill {n:>5} tokens: {rate:8.0f} tokens/s  ({dt:.2f} s wall; "
            f"{cpu_rate:.0f} tokens/s per CPU-second)"
        )

    st = model.new_state()
    model.prefill(st, _prompt(2048))
    steps = 16
    t0 = time.perf_counter()
    for _ in range(steps):
        model.decode_batch([st], [int(st.last_logits.argmax())])  # type: ignore[union-attr]
    d1 = (time.perf_counter() - t0) / steps
    others = []
    for i in range(3):
        o = model.new_state()
        model.prefill(o, _prompt(2048, seed=i + 1))
        others.append(o)
    batch = [st, *others]
    t0 = time.perf_counter()
    for _ in range(steps):
        model.decode_batch(batch, [int(s.last_logits.argmax()) for s in batch])  # type: ignore[union-attr]
    d4 = (time.perf_counter() - t0) / steps
    print(f"decode step @2k: batch 1 {d1 * 1e3:.1f} ms, batch 4 {d4 * 1e3:.1f} ms")

    t0 = time.perf_counter()
    emitted = 0
    for _ in range(8):
        draft = model.draft(st, 5)
        out, _ = model.verify(st, draft.tokens)
        if not out:
            raise BenchError("a draft+verify step emitted no token")
        emitted += len(out)
    dv = (time.perf_counter() - t0) / 8
    print(f"draft+verify step (5 drafts) @2k: {dv * 1e3:.1f} ms, {emitted / 8:.2f} tokens/step")

    n = st.n_tokens // 256 * 256
    blobs = [model.export_global(st, s, s + 256) for s in range(0, n, 256)]
    r = model.state_from_global(blobs, n, tokens=st.tokens[:n])
    t0 = time.perf_counter()
    model.replay(r, st.tokens[n - 128 : n])
    rp = time.perf_counter() - t0
    print(f"replay 128 tokens @{n}: {rp * 1e3:.1f} ms")

    engram_prefetch(model)

    with dispatch.use_backend("reference"):
        prefill_rate(model, 256)  # warm up
        b, _, _ = prefill_rate(model, 512)
        ref = model.prefill(model.new_state(), _prompt(512))
    print(f"baseline (reference ops) prefill 512: {b:.0f} tokens/s; speedup {rates[512] / b:.1f}x")
    fast = model.prefill(model.new_state(), _prompt(512))
    if not (bool(torch.isfinite(fast).all()) and bool(torch.isfinite(ref).all())):
        raise BenchError("non-finite logits after the 512-token prefill")
    if int(fast.argmax()) != int(ref.argmax()):
        raise BenchError("the default and the reference ops pick different next tokens")
    diff = float((fast - ref).abs().max())
    print(
        "self-check: the 512-token prefill's logits are finite and pick the same next token "
        f"through the default and the reference ops (max |diff| {diff:.2e}); every "
        f"draft+verify step emitted a token ({emitted} in 8 steps)"
    )
    print(
        f"model step result: prefill 512 {rates[512]:.0f} tokens/s ({rates[512] / b:.1f}x the "
        f"reference ops), decode @2k batch 1 {d1 * 1e3:.1f} ms, batch 4 {d4 * 1e3:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
