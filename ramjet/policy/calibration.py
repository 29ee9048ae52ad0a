"""Online calibration of the predicted TTFT: per engine, the weights of the cost model's
terms, fitted to the TTFTs the router (or the simulator) realises.

The analytic model (`ramjet.policy.cost`) prices a request on engine e from a profile
probed once: prefill by the probed curve, restore and replay by the probed bandwidths
and floor, the wait from the queued work ahead, and the packing term. Each is a feature
x_i; the calibrated prediction is

    TTFT = w_prefill·x_prefill + w_context·x_context + w_resume·(x_restore + x_replay)
           + w_wait·x_wait + w_packing·x_packing + fixed_s

with weights that start at the profile (1, 0, 1, 1, 1; fixed 0 s) and are fitted per
engine by recursive least squares with forgetting on every realised TTFT y. x_prefill is
the profile's prefill of the new tokens at their context; x_context is that prefill at
context 0 times context / `CONTEXT_SCALE` tokens: the attention-like cost that grows with
the context, which a curve probed at short contexts, or probed flat under load, misses.
Its weight starts at 0 (the profile as probed), moves slowly (a narrow prior: it is
nearly collinear with x_prefill) and only grows if the engine shows it.

- Warm-up: an engine's first `WARMUP` samples fit one common scale (the median of
  realised over predicted TTFT), applied to every multiplicative term: a profile probed
  on a busy host is off by about one factor everywhere, which three requests show and
  eight cannot split into terms. The per-term fit below starts from there.
- Relative error is what an operator reads, so each sample is weighted by 1/y²: the
  regression is of 1 on z = x / y (`TtftCalibration.observe`), and its residual
  e = 1 - w·z = (y - ŷ) / y is the relative error.
- Robust: e is clipped to ±`clip`·σ before the update, σ a running mean of the clipped
  |e| (floored at `SIGMA_FLOOR`), so a single 10x outlier moves the weights by at most
  the gain times that bound; a lasting change (an engine 2x slower) shows as errors of
  one sign (`DRIFT`), which raises σ and the covariance, and is learnt within about ten
  requests (tests/ramjet/policy/test_calibration.py states the bound it holds).
- Bounded: each multiplicative weight stays in [`W_MIN`, `W_MAX`] (context [0, W_MAX]),
  the fixed term in [0, `FIXED_MAX_S`] (projection after each step); the covariance of a
  direction that no sample excites (packing on a one-job-per-step engine) is capped, so
  it cannot wind up under forgetting and swing the weight when the term first appears.

The router feeds it from `ramjet.decisions.accounting` (the candidate's features for the
engine that answered, at the response's end), the simulator from its own realised TTFTs
(`simulations.simulator`); both read the weights through `FleetStats.calibration`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ramjet.types import EngineId

TERMS: tuple[str, ...] = ("prefill", "context", "resume", "wait", "packing", "fixed")
"""The calibrated terms, in feature order (`fixed` is a constant in seconds)."""
FEATURES: tuple[str, ...] = (
    "x_prefill_s",
    "x_context_s",
    "x_resume_s",
    "x_wait_s",
    "x_packing_s",
)
"""The decision components that carry the raw (profile-priced) features."""

W_MIN = 0.25
W_MAX = 4.0
FIXED_MAX_S = 0.1
SIGMA_FLOOR = 0.05
CONTEXT_SCALE = 8192.0
"""Tokens of context at which x_context equals the prefill at context 0."""
DRIFT = 0.15
"""A running mean of the signed relative error beyond this: the engine has changed (a
co-located job, a profile probed under load): the covariance is multiplied by
`DRIFT_GAIN` (bounded by its cap), at most once per `DRIFT_COOLDOWN` samples, so the
weights follow within about ten samples without being thrown about by a run of noise."""
DRIFT_GAIN = 4.0
DRIFT_COOLDOWN = 8
WARMUP = 8
"""Samples over which an engine's first fit is one common scale: the median of realised
over predicted TTFT (from `WARMUP_MIN` samples on), applied to every multiplicative term.
A profile probed on a busy host is off by about one factor in every term, and a handful
of requests cannot tell the terms apart, but can tell that factor; the median keeps one
odd request from setting it. The per-term fit starts from the scaled weights."""
WARMUP_MIN = 3


@dataclass(frozen=True, slots=True)
class TtftWeights:
    """One engine's calibrated weights (`TERMS`), and how many samples fitted them."""

    prefill: float = 1.0
    context: float = 0.0
    resume: float = 1.0
    wait: float = 1.0
    packing: float = 1.0
    fixed_s: float = 0.0
    samples: int = 0

    def as_dict(self) -> dict[str, float]:
        return {
            "prefill": self.prefill,
            "context": self.context,
            "resume": self.resume,
            "wait": self.wait,
            "packing": self.packing,
            "fixed_s": self.fixed_s,
        }


PROFILE = TtftWeights()
"""The weights of the uncalibrated model: the profile as probed."""


class TtftCalibration:
    """One engine's recursive least squares (module docstring). Not thread-safe: the
    router's event loop or the simulator's loop owns it."""

    __slots__ = (
        "_bias",
        "_cap",
        "_cooldown",
        "_p",
        "_ratios",
        "_samples",
        "_sigma",
        "_start",
        "_w",
        "clip",
        "forgetting",
    )

    def __init__(
        self,
        forgetting: float = 0.95,
        clip: float = 2.5,
        prior: Sequence[float] = (4.0, 0.25, 4.0, 4.0, 4.0, 0.01),
        start: TtftWeights = PROFILE,
    ) -> None:
        if not 0.5 < forgetting <= 1.0:
            raise ValueError("forgetting must be in (0.5, 1]")
        if not clip > 0:
            raise ValueError("clip must be > 0")
        if len(prior) != len(TERMS) or min(prior) <= 0:
            raise ValueError(f"prior needs {len(TERMS)} positive variances")
        self.forgetting = forgetting
        self.clip = clip
        n = len(TERMS)
        self._w = [
            start.prefill,
            start.context,
            start.resume,
            start.wait,
            start.packing,
            start.fixed_s,
        ]
        self._p = [[prior[i] if i == j else 0.0 for j in range(n)] for i in range(n)]
        self._cap = [10.0 * v for v in prior]
        self._sigma = 0.5
        self._bias = 0.0
        self._cooldown = 0
        self._samples = 0
        self._start = list(self._w)
        self._ratios: list[float] = []

    def weights(self) -> TtftWeights:
        w = self._w
        return TtftWeights(w[0], w[1], w[2], w[3], w[4], w[5], self._samples)

    def observe(self, features: Sequence[float], realized_s: float) -> float | None:
        """Fit one sample: `features` in `FEATURES` order (seconds), `realized_s` the TTFT.
        Returns the relative error (y - ŷ) / y of the prediction before the update, or
        None for a sample that cannot be used (non-positive or non-finite)."""
        if not (realized_s > 0 and math.isfinite(realized_s)) or len(features) != len(FEATURES):
            return None
        if not all(math.isfinite(x) and x >= 0 for x in features):
            return None
        z = [x / realized_s for x in features]
        z.append(1.0 / realized_s)
        n = len(z)
        w, p = self._w, self._p
        e = 1.0 - sum(w[i] * z[i] for i in range(n))
        if self._samples < WARMUP:
            self._warm(z)
            self._samples += 1
            return e
        bound = self.clip * self._sigma
        ec = min(max(e, -bound), bound)
        self._sigma = max(0.8 * self._sigma + 0.2 * abs(ec), SIGMA_FLOOR)
        self._bias = 0.8 * self._bias + 0.2 * ec
        self._cooldown -= 1
        if abs(self._bias) > DRIFT and self._cooldown <= 0:  # one sign: the engine changed
            for row in p:  # forget what came before, once per DRIFT_COOLDOWN samples
                for j in range(n):
                    row[j] *= DRIFT_GAIN
            self._cooldown = DRIFT_COOLDOWN
        pz = [sum(p[i][j] * z[j] for j in range(n)) for i in range(n)]
        lam = self.forgetting
        denom = lam + sum(z[i] * pz[i] for i in range(n))
        k = [v / denom for v in pz]
        for i in range(n):
            w[i] += k[i] * ec
            for j in range(n):
                p[i][j] = (p[i][j] - k[i] * pz[j]) / lam
        self._bound()
        self._samples += 1
        return e

    def _warm(self, z: Sequence[float]) -> None:
        """One warm-up sample (`WARMUP`): the realised over the profile's prediction, and
        the weights at the profile times the median of those ratios so far."""
        start = self._start
        predicted = sum(start[i] * z[i] for i in range(len(z)))  # over realised: ŷ / y
        if predicted > 0:
            self._ratios.append(1.0 / predicted)
        if len(self._ratios) < WARMUP_MIN:
            return
        ratios = sorted(self._ratios)
        mid = len(ratios) // 2
        scale = ratios[mid] if len(ratios) % 2 else 0.5 * (ratios[mid - 1] + ratios[mid])
        scale = min(max(scale, W_MIN), W_MAX)
        last = len(start) - 1  # the fixed term is not a multiple of the profile
        for i in range(last):
            self._w[i] = start[i] * scale
        self._bound()

    def _bound(self) -> None:
        w, p, n = self._w, self._p, len(self._w)
        for i in range(n - 1):
            w[i] = min(max(w[i], 0.0 if i == 1 else W_MIN), W_MAX)  # context may be 0
        w[n - 1] = min(max(w[n - 1], 0.0), FIXED_MAX_S)
        for i in range(n):
            if p[i][i] > self._cap[i]:
                s = math.sqrt(self._cap[i] / p[i][i])
                for j in range(n):
                    p[i][j] *= s
                    p[j][i] *= s


class Calibrations:
    """`TtftCalibration` per engine, made on first sample; `weights()` is what
    `FleetStats.calibration` carries (engines with no sample are absent: profile)."""

    __slots__ = ("_by_engine", "_snapshot", "clip", "forgetting")

    def __init__(self, forgetting: float = 0.95, clip: float = 2.5) -> None:
        TtftCalibration(forgetting, clip)  # validates the parameters once, here
        self.forgetting = forgetting
        self.clip = clip
        self._by_engine: dict[EngineId, TtftCalibration] = {}
        self._snapshot: dict[EngineId, TtftWeights] = {}

    def observe(
        self, engine: EngineId, features: Sequence[float], realized_s: float
    ) -> float | None:
        c = self._by_engine.get(engine)
        if c is None:
            c = self._by_engine[engine] = TtftCalibration(self.forgetting, self.clip)
        e = c.observe(features, realized_s)
        if e is not None:
            self._snapshot = {**self._snapshot, engine: c.weights()}
        return e

    def weights(self) -> Mapping[EngineId, TtftWeights]:
        """The current weights per engine (a new mapping after each sample, so a caller
        may keep it)."""
        return self._snapshot


def features_of(components: Mapping[str, float]) -> list[float] | None:
    """The raw features a decision recorded for one engine (`FEATURES`), or None when
    the decision has none (a policy other than `tier_aware`)."""
    out = []
    for name in FEATURES:
        v = components.get(name)
        if v is None:
            return None
        out.append(float(v))
    return out


def service_s(weights: TtftWeights, features: Sequence[float]) -> float:
    """The calibrated service part of a prediction (prefill, its context, restore and
    replay, fixed):
    what is not waiting. Realised TTFT minus this is the router's measure of the wait
    where the engine reports none (`ramjet.decisions.accounting`)."""
    w, f = weights, features
    return w.prefill * f[0] + w.context * f[1] + w.resume * f[2] + w.fixed_s
