"""Time a virtual CPU executed nothing, from `perf record -a` across a benchmark: the
residency benchmarks' `--perf` (diagnostic; needs `perf` and the right to record every CPU).

On a VM, host-side work (its exits, its handling of faults on guest memory, its
scheduling) stops a vCPU while the guest's clocks run on, the CPU clock of the thread
that was running among them: a loop turn that spans such a pause reads that much longer
in `time.thread_time()` without a line of it run. `perf record -a` samples every CPU at
a fixed rate, idle included, so a stretch with no sample of any task on the CPU the
loop's thread was running on, with that thread's samples on both sides, is such a pause.
`absent(windows)` gives, for each (start, end) on CLOCK_MONOTONIC, the seconds of it
that the loop's thread spent in those stretches beyond one sampling period each.

On the 2-core dev VM (20M-block Redis run, 2026-12-07) each vCPU had 66-81 stretches
over 8 ms without a sample in 20 minutes, the longest 92 and 102 ms.
"""

from __future__ import annotations

import bisect
import signal
import subprocess
import threading
from pathlib import Path

HZ = 1999
"""Samples a second per CPU: a pause is resolved to about half a millisecond."""


class PerfRecord:
    """`perf record -a -F HZ -k CLOCK_MONOTONIC` (no call graphs) while in the block."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.tid = threading.get_native_id()
        """The thread whose pauses count: the one that entered (the event loop's)."""
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PerfRecord:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        cmd = ["perf", "record", "-a", "-F", str(HZ), "-k", "CLOCK_MONOTONIC", "-o", str(self.out)]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:  # a perf that cannot record (no perf, no right to) exits at once
            assert self._proc.stderr is not None
            self._proc.wait(2.0)
            raise RuntimeError(f"perf record exited: {self._proc.stderr.read().decode()[-300:]}")
        except subprocess.TimeoutExpired:
            return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGTERM)  # SIGINT may be ignored (a background job)
        self._proc.wait(120)

    def absent(self, windows: list[tuple[float, float]]) -> list[float]:
        """Per window, the seconds the thread's vCPU was paused under it (see above)."""
        if not windows:
            return []
        lo = min(s for s, _ in windows) - 0.05
        hi = max(e for _, e in windows) + 0.05
        out = subprocess.run(
            [
                "perf",
                "script",
                "-i",
                str(self.out),
                "-F",
                "tid,cpu,time",
                "--time",
                f"{lo:.6f},{hi:.6f}",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        times: dict[int, list[float]] = {}  # per CPU, every sample's time
        mine: dict[int, set[float]] = {}  # per CPU, the thread's samples' times
        for line in out.splitlines():
            parts = line.replace("[", " ").replace("]", " ").replace(":", " ").split()
            if len(parts) < 3:
                continue
            tid, cpu, t = int(parts[0]), int(parts[1]), float(parts[2])
            times.setdefault(cpu, []).append(t)
            if tid == self.tid:
                mine.setdefault(cpu, set()).add(t)
        for ts in times.values():
            ts.sort()
        return absent_in(times, mine, windows, 1.0 / HZ)


def absent_in(
    times: dict[int, list[float]],
    mine: dict[int, set[float]],
    windows: list[tuple[float, float]],
    period: float,
) -> list[float]:
    """Per window, the seconds under it of every stretch over two sampling periods with no
    sample on a CPU (`times`: each CPU's sample times, sorted) between two samples of the
    thread (`mine`), less one period each."""
    res = []
    for start, end in windows:
        gone = 0.0
        for cpu, ts in times.items():
            own = mine.get(cpu, set())
            j = max(0, bisect.bisect_left(ts, start) - 1)
            while j + 1 < len(ts) and ts[j] <= end:
                a, b = ts[j], ts[j + 1]
                if b - a > 2 * period and a in own and b in own:
                    gone += max(0.0, min(b, end) - max(a, start) - period)
                j += 1
        res.append(gone)
    return res
