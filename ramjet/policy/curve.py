"""The prefill curve's arithmetic (`ramjet.policy.profile`, whose docstring defines it),
as a plain class the build compiles (`ramjet.native`).

`EngineProfile` is a pydantic model, so its module stays interpreted; the cost model
asks its curve for a prefill time several times per engine per request, and sums one
for each of the router's requests in flight there (`cost.queued_seconds`: the sum is
kept by the engine's jobs tuple, `PrefillCurve.jobs_seconds`). The profile
builds one `PrefillCurve` from its points and overhead (`EngineProfile.curve`) and its
`prefill_seconds` and `_rate` answer through it, so both ways of asking give the same
figures from one implementation.
"""

from __future__ import annotations

from typing import Final

MEMO_SIZE: Final = 4096
"""Answers kept per curve before they are forgotten at once."""
JOBS_MEMO_SIZE: Final = 256
"""Sums over jobs in flight (`PrefillCurve.jobs_seconds`) kept per curve before they are
forgotten at once."""


class PrefillCurve:
    """Piecewise-linear seconds per token through (`xs`, `ys`), `xs` strictly increasing
    (the profile validates it), plus a fixed `overhead_s` per prefill."""

    __slots__ = ("_answers", "_jobs", "overhead_s", "xs", "ys")

    def __init__(self, xs: tuple[float, ...], ys: tuple[float, ...], overhead_s: float) -> None:
        if not xs or len(xs) != len(ys):
            raise ValueError("a prefill curve needs one rate per context, at least one")
        self.xs = xs
        self.ys = ys
        self.overhead_s = overhead_s
        self._answers: dict[tuple[int, int], float] = {}
        self._jobs: dict[int, tuple[tuple[tuple[int, int], ...], float, int]] = {}

    def __reduce__(
        self,
    ) -> tuple[type[PrefillCurve], tuple[tuple[float, ...], tuple[float, ...], float]]:
        # A profile that was asked keeps its curve in its __dict__ (`EngineProfile.curve`),
        # so copying or pickling the profile copies the curve: made again from its points
        # and overhead (the answers are not kept). A compiled class needs this said.
        return PrefillCurve, (self.xs, self.ys, self.overhead_s)

    def rate(self, x: float) -> float:
        """Seconds per token at context `x` (the profile module's docstring)."""
        xs, ys = self.xs, self.ys
        last = len(xs) - 1
        if last == 0:
            return ys[0]
        i = 0  # bisect_right(xs, x) - 1, clipped to [0, last - 1]
        while i < last - 1 and xs[i + 1] <= x:
            i += 1
        if x < xs[i]:  # before the first point: hold flat
            return ys[i]
        slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
        if x > xs[last]:
            # past the last point: no faster than the whole curve's trend (a noisy last
            # segment must not run away), and never falling below the last rate
            trend = (ys[last] - ys[0]) / (xs[last] - xs[0])
            return ys[last] + max(0.0, min(slope, trend)) * (x - xs[last])
        return max(0.0, ys[i] + slope * (x - xs[i]))

    def seconds(self, new_tokens: int, context_tokens: int = 0) -> float:
        """Time to prefill `new_tokens` on top of `context_tokens` cached ones. Answers
        are kept (up to `MEMO_SIZE`, then forgotten at once): one decision asks the same
        figure several times (the stand-in profile, then each engine priced with it)."""
        if new_tokens <= 0:
            return 0.0
        key = (new_tokens, context_tokens)
        answers = self._answers
        got = answers.get(key)
        if got is None:
            if len(answers) >= MEMO_SIZE:
                answers.clear()
            got = self.integral(new_tokens, context_tokens)
            answers[key] = got
        return got

    def jobs_seconds(self, jobs: tuple[tuple[int, int], ...]) -> tuple[float, int]:
        """(the overhead plus, job by job in order, each job's `seconds` less the overhead;
        the new tokens of the jobs counted) over `jobs`, (new tokens, context tokens) each
        (a job of no new tokens adds nothing): `cost.queued_seconds`' sum over the
        router's requests in flight on an engine, added in that order, so the figure is
        the same float. Kept by the tuple's identity (up to `JOBS_MEMO_SIZE`, then
        forgotten at once; the entry holds the tuple, so its id is not reused while kept):
        an engine's jobs tuple is made once per change (`EngineState.jobs`), so each
        request's pick pays for the engines whose jobs changed since the last, not for
        every job of every engine. A new tuple of the same jobs is summed again."""
        memo = self._jobs
        key = id(jobs)
        kept = memo.get(key)
        if kept is not None and kept[0] is jobs:
            return kept[1], kept[2]
        answers = self._answers
        over = self.overhead_s
        total = over
        counted = 0
        for job in jobs:
            n = job[0]
            if n > 0:
                got = answers.get(job)  # the job is the memo's key: (new, context)
                if got is None:
                    got = self.seconds(n, job[1])
                total += got - over
                counted += n
        if len(memo) >= JOBS_MEMO_SIZE:
            memo.clear()
        memo[key] = (jobs, total, counted)
        return total, counted

    def integral(self, new_tokens: int, context_tokens: int) -> float:
        """`seconds` without the memo: the overhead plus the exact integral of the rate
        (linear between knots) from the context to the context plus the new tokens."""
        lo = float(context_tokens)
        hi = float(context_tokens + new_tokens)
        total = 0.0
        a, ra = lo, self.rate(lo)
        for x in self.xs:  # the knots strictly inside (lo, hi), in order
            if lo < x < hi:
                rx = self.rate(x)
                total += (ra + rx) / 2 * (x - a)
                a, ra = x, rx
        rb = self.rate(hi)
        total += (ra + rb) / 2 * (hi - a)
        return self.overhead_s + total
