"""Cost of parsing and keying a request, against plain JSON parsing on the same machine.

    .venv/bin/python benchmarks/prefix_keys.py [--repeats N]
    .venv/bin/python benchmarks/prefix_keys.py --quick     # make bench: 5 repeats, ~20 s

Prints, for a 4 KB, 100 KB and 4 MB chat body: the median time of `parse_request`
(JSON decode + validation + canonical rendering + prefix keys), its breakdown for 4 MB,
the median time to merely decode 4 MB of JSON with the standard library and with msgspec,
the ratio keying+parse / plain parse, and the minor page faults per 4 MB request
(resource.getrusage ru_minflt delta), since fresh multi-megabyte buffers fault.
Before timing, each body's parse is checked (model, message count, the keys' blocks
cover the rendered prompt); `self-check:` says so, `figure:` lines carry the headline.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import msgspec

from ramjet.keys.prefix import compute_keys, key_seed, render_chat
from ramjet.request.parse import ParsedRequest, ParseLimits, parse_request
from ramjet.runtime.malloc import tune_malloc

PATH = "/v1/chat/completions"
LIMITS = ParseLimits(max_body_bytes=64 << 20)


def make_body(size: int) -> bytes:
    """A chat body of about `size` bytes: a long system prompt (code-like text with
    quotes, newlines and some non-ASCII), tools, and a few turns."""
    line = 'def f(x):\n    return x * 2  # "double" it, naïvely\n'
    turns = [{"role": "user", "content": "What does this do?"},
             {"role": "assistant", "content": "It doubles x."},
             {"role": "user", "content": "And for strings?"}]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
    base = len(json.dumps({"model": "ramjet-ref", "messages": turns, "tools": tools}))
    n = max(1, (size - base) // (len(json.dumps(line)) - 2))
    system = {"role": "system", "content": line * n}
    doc = {"model": "ramjet-ref", "messages": [system, *turns], "tools": tools, "stream": True}
    return json.dumps(doc, ensure_ascii=False).encode("utf-8")


def check_parse(label: str, raw: bytes, p: ParsedRequest) -> None:
    """The parse read the body it was given: its model, and the block keys of the prompt
    rendered here from the stdlib's decode; anything else stops the run (a wrong parse is
    never timed)."""
    doc = json.loads(raw)
    keys = compute_keys(render_chat(doc["messages"], doc["tools"]), key_seed(doc["model"]))
    got = (p.model, p.keys.blocks)
    want = (doc["model"], keys.blocks)
    if got != want or not keys.blocks:
        raise SystemExit(
            f"self-check: FAILED: {label} body parsed to model {p.model!r} with "
            f"{len(p.keys.blocks)} blocks, want {doc['model']!r} and {len(keys.blocks)} equal keys"
        )


def median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def faults_per_call(fn: Callable[[], object], repeats: int) -> float:
    fn()
    counts = []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fn()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return statistics.median(counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--quick", action="store_true", help="5 repeats (make bench)")
    ap.add_argument("--faults-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--malloc-tuned", action="store_true", help="call tune_malloc() first")
    args = ap.parse_args()
    if args.malloc_tuned:
        tune_malloc()  # before any large allocation, as its docstring says
    if args.faults_only:
        raw = make_body(4 << 20)
        gc.disable()
        f = faults_per_call(lambda: parse_request(PATH, raw, {}, LIMITS), args.repeats)
        t = median_s(lambda: parse_request(PATH, raw, {}, LIMITS), args.repeats)
        print(f"{f:.0f} {t * 1e3:.2f}")
        return
    r = 5 if args.quick else args.repeats
    gc.disable()  # the collector's pauses are not what we measure; bodies hold few objects
    figs: list[str] = []
    print(f"{'body':>8} {'bytes':>9} {'parse+key ms':>13} {'blocks':>7}")
    for label, size in (("4 KB", 4 << 10), ("100 KB", 100 << 10), ("4 MB", 4 << 20)):
        raw = make_body(size)
        p = parse_request(PATH, raw, {}, LIMITS)
        check_parse(label, raw, p)
        reps = r * 20 if size < (1 << 20) else r
        t = median_s(lambda raw=raw: parse_request(PATH, raw, {}, LIMITS), reps)  # type: ignore[misc]
        print(f"{label:>8} {len(raw):>9} {t * 1e3:>13.3f} {len(p.keys.blocks):>7}")
        figs.append(f"figure: prefix keys / parse+key {label} = {t * 1e3:.3f} ms")

    raw = make_body(4 << 20)
    obj = msgspec.json.decode(raw)
    t_std = median_s(lambda: json.loads(raw), r)
    t_msg = median_s(lambda: msgspec.json.decode(raw), r)
    t_all = median_s(lambda: parse_request(PATH, raw, {}, LIMITS), r)
    rendered = render_chat(obj["messages"], obj["tools"])
    seed = key_seed("ramjet-ref")
    t_render = median_s(lambda: render_chat(obj["messages"], obj["tools"]), r)
    t_keys = median_s(lambda: compute_keys(rendered, seed), r)
    print()
    print(f"4 MB breakdown: msgspec decode {t_msg * 1e3:.2f} ms, render {t_render * 1e3:.2f} ms, "
          f"keys {t_keys * 1e3:.2f} ms ({len(rendered.text) // 256} blocks), "
          f"whole parse_request {t_all * 1e3:.2f} ms")  # fmt: skip
    print(
        f"plain JSON decode of 4 MB: stdlib json {t_std * 1e3:.2f} ms, "
        f"msgspec {t_msg * 1e3:.2f} ms (stdlib/msgspec = {t_std / t_msg:.2f}x)"
    )
    print(f"ratio parse+key / plain msgspec decode (4 MB): {t_all / t_msg:.2f}x")
    print(f"ratio parse+key / plain stdlib json decode (4 MB): {t_all / t_std:.2f}x")

    print()
    f_all = faults_per_call(lambda: parse_request(PATH, raw, {}, LIMITS), r)
    f_dec = faults_per_call(lambda: msgspec.json.decode(raw), r)
    f_std = faults_per_call(lambda: json.loads(raw), r)
    print(
        f"minor page faults per 4 MB request (median): parse_request {f_all:.0f}, "
        f"msgspec decode alone {f_dec:.0f}, stdlib json decode alone {f_std:.0f} "
        f"(a 4 MB buffer is {(4 << 20) // resource.getpagesize()} pages)"
    )
    # Fresh processes, since malloc tuning only helps when applied at start.
    cmd = [sys.executable, __file__, "--faults-only", "--repeats", str(r)]
    out: dict[str, float] = {}
    for tag, extra in (("glibc defaults", []), ("tune_malloc()", ["--malloc-tuned"])):
        faults, ms = subprocess.run(
            cmd + extra, capture_output=True, text=True, check=True
        ).stdout.split()
        out[tag] = float(ms)
        print(f"fresh process, {tag:>15}: {faults:>5} faults and {ms} ms per 4 MB parse_request")
    print(f"tune_malloc speed-up on 4 MB: {out['glibc defaults'] / out['tune_malloc()']:.2f}x")
    figs.append(
        f"figure: prefix keys ratio / parse+key over msgspec decode, 4 MB = {t_all / t_msg:.2f} x"
    )
    print("\n".join(figs))
    print(
        "self-check: every body (4 KB, 100 KB, 4 MB) parsed to its model and the block keys "
        "of its prompt rendered from the stdlib's decode"
    )


if __name__ == "__main__":
    main()
