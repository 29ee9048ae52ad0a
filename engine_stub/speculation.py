"""DSpark scheduling: how many draft positions to verify, from the confidence head and the
current batch.

The draft pass predicts up to `max_draft` positions with a confidence c_i each (the
predicted chance that position i is accepted given positions < i are). The chance that
the first i positions all survive is s_i = c_1 * ... * c_i, so verifying k positions
yields, in expectation, E(k) = 1 + s_1 + ... + s_k tokens (the 1 is the backbone's own
next token, which a verification always produces).

Costs, measured online (EMAs seeded by the first observations):
- a plain batched decode step over B sequences costs `plain_s(B)`, i.e. plain_s(B) / B
  per sequence-token: batching amortizes the per-pass overhead;
- a DSpark step for one sequence costs draft_s + verify_s(k), verify_s(k) =
  verify_base_s + k * verify_token_s (one backbone pass over k + 1 rows).

Choice: k* = argmax_k E(k) / (draft_s + verify_s(k)) over k in 1..max_draft with
s_k >= min_survival (a position that probably dies is wasted work); verify k* positions
if that rate beats the plain rate B / plain_s(B), else decode plainly. So a large batch
(cheap plain tokens) or a low-confidence draft means fewer or no verified positions.
Before drafting, a bound (E <= 1 + max_draft) skips the draft pass when even a perfect
draft could not win.

Calibration: the confidence head's survival is scaled by `calibration` = accepted /
predicted-surviving positions so far (an untrained or drifting head over-promises), and
one step in `explore_every` speculates regardless so the calibration can recover.

Acceptance (accepted / verified positions) and effective tokens per sequence-step are
EMAs read by metrics and the load report.
"""

from __future__ import annotations

import time
from typing import Any


def _ema(old: float | None, new: float, alpha: float = 0.2) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


class Speculator:
    def __init__(
        self, model: Any, *, max_draft: int | None = None, min_survival: float = 0.2
    ) -> None:
        self.model = model
        cfg = getattr(model, "cfg", None)
        self.max_draft = max_draft or int(getattr(cfg, "draft_block", 5))
        self.min_survival = min_survival
        self.plain_s: dict[int, float] = {}
        self.draft_s: float | None = None
        self.verify_base_s: float | None = None
        self.verify_token_s: float | None = None
        self.acceptance = 0.0
        self.tokens_per_step = 1.0
        self.proposed_total = 0
        self.accepted_total = 0
        self.spec_steps = 0
        self.predicted_total = 0.0
        self.explore_every = 32
        self._since_explore = 0

    @property
    def calibration(self) -> float:
        if self.predicted_total < 4:
            return 1.0
        return min(1.5, self.accepted_total / self.predicted_total)

    # -- cost model -----------------------------------------------------------------

    def observe_plain(self, batch: int, seconds: float) -> None:
        self.plain_s[batch] = _ema(self.plain_s.get(batch), seconds)
        self.tokens_per_step = _ema(self.tokens_per_step, 1.0, 0.05)

    def _plain_rate(self, batch: int) -> float | None:
        """Plain decode tokens per second per sequence at this batch size, if known."""
        known = self.plain_s.get(batch)
        if known is None and not self.plain_s and self.verify_base_s is not None:
            known = self.verify_base_s  # one backbone pass over a few rows
        if known is None and self.plain_s:
            b0 = min(self.plain_s, key=lambda b: abs(b - batch))
            known = self.plain_s[b0] * max(1.0, batch / b0) ** 0.5  # sublinear in batch
        return None if known is None else batch / known

    def _spec_cost(self, k: int) -> float | None:
        if self.draft_s is None or self.verify_base_s is None:
            return None
        return self.draft_s + self.verify_base_s + k * (self.verify_token_s or 0.0)

    def choose(self, confidences: list[float], batch: int) -> int:
        """Draft positions worth verifying (0: decode plainly)."""
        survival, s = [], 1.0
        for c in confidences[: self.max_draft]:
            s *= max(0.0, min(1.0, float(c)))
            survival.append(min(1.0, s * self.calibration))
        plain = self._plain_rate(batch)
        best_k, best_rate = 0, -1.0
        expected = 1.0
        for k, s_k in enumerate(survival, start=1):
            if s_k < self.min_survival:
                break
            expected += s_k
            cost = self._spec_cost(k)
            rate = expected / cost if cost else expected  # unmeasured: explore
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0:
            return 0
        if plain is not None and self._spec_cost(best_k) is not None and best_rate <= plain:
            return 0
        return best_k

    def worth_drafting(self, batch: int) -> bool:
        plain = self._plain_rate(batch)
        cost = self._spec_cost(1)
        if plain is None or cost is None:
            return True
        return (1 + self.max_draft * self.calibration) / cost > plain

    # -- one step -------------------------------------------------------------------

    def step(self, state: Any, pending: int, batch: int, left: int) -> list[int] | None:
        """Feed `pending`, draft, verify the chosen positions; returns the new tokens
        (accepted drafts then the backbone's next token), or None to decode plainly."""
        if left < 2 or not self.worth_drafting(batch):
            return None
        t0 = time.perf_counter()
        tokens, confidences = draft_block(self.model, state, pending, self.max_draft)
        t1 = time.perf_counter()
        self.draft_s = _ema(self.draft_s, t1 - t0)
        k = min(self.choose(confidences, batch), left - 1)
        self._since_explore += 1
        if k <= 0 and self._since_explore >= self.explore_every:
            k = 1
        if k <= 0:
            return None
        self._since_explore = 0
        surv = 1.0
        for c in confidences[:k]:
            surv *= c
            self.predicted_total += surv
        accepted, bonus = verify_block(self.model, state, pending, tokens[:k])
        dt = time.perf_counter() - t1
        if self.verify_base_s is None:
            self.verify_base_s = dt / (1 + 0.1 * k)
            self.verify_token_s = 0.1 * self.verify_base_s
        else:
            self.verify_base_s = _ema(self.verify_base_s, dt - k * (self.verify_token_s or 0.0))
        self.spec_steps += 1
        self.proposed_total += k
        self.accepted_total += len(accepted)
        self.acceptance = _ema(self.acceptance if self.spec_steps > 1 else None, len(accepted) / k)
        self.tokens_per_step = _ema(self.tokens_per_step, 1 + len(accepted), 0.05)
        return [*accepted, bonus]


def draft_block(model: Any, state: Any, pending: int, n: int) -> tuple[list[int], list[float]]:
    """The model's draft of the n tokens after `pending` (= argmax of the state's last
    logits: greedy decoding's certain next token), with their confidences."""
    d = model.draft(state, n)
    return [int(t) for t in d.tokens.tolist()], [float(c) for c in d.confidences.tolist()]


def verify_block(model: Any, state: Any, pending: int, draft: list[int]) -> tuple[list[int], int]:
    """Verify `draft` after `pending`: the model processes pending + the accepted drafts
    and returns them; the backbone's next token (argmax of the new last logits) is the
    step's extra token, emitted but not yet processed (the scheduler's next `pending`)."""
    emitted, _stats = model.verify(state, draft)
    if int(emitted[0]) != pending:
        raise RuntimeError("DSpark verify: the state's greedy token is not the pending token")
    return [int(t) for t in emitted[1:]], int(state.last_logits.argmax())
