"""When a draft token is worth verifying: the forward's cost per token, and each request's odds.

What a verify step costs depends on the machine: with AMX (or vdpbf16ps) a forward of eight
tokens per request costs little more than one, while on an AVX2-only CPU the bf16 matmuls are
compute-bound from about four rows on, and each extra token costs nearly half a decode step. So
the drafter measures instead of assuming:

- StepCost fits the time of every decode and verify forward as a + b * tokens (least squares,
  recent forwards weighted most). b is what one more token in a forward costs; (a + b * B) / B is
  what a token costs when the B running requests decode one token each.
- A draft node that will be emitted with probability q gains q tokens for b seconds, which beats
  decoding when q > b / ((a + b * B) / B): that ratio is the reach threshold.
- SpeculationState (scheduler/request.py) estimates, per request, the chance that a draft is
  accepted given that its parent was, from the request's recent verify steps (decaying, so a
  request whose text stops or starts repeating is re-judged). A node's reach is the product of
  these odds (and of the index's share for a branch) down its path.

A request whose drafts keep failing thus stops drafting (every node falls below the threshold);
its evidence decays on the steps it sits out, until a short draft is tried again. To keep the fit
informed a plain decode step runs at least every PLAIN_STEP_INTERVAL steps.
"""

from __future__ import annotations

from dataclasses import dataclass

# Each new forward's weight against the ones before (a half-life of about 14 forwards).
DECAY = 0.95
# A plain decode step at least this often, so that the fit sees forwards of two sizes.
PLAIN_STEP_INTERVAL = 32
# The reach threshold until the fit exists: with the requests' prior odds of 0.5, first drafts
# are one token deep, a cheap first measurement.
INITIAL_REACH_THRESHOLD = 0.5


@dataclass
class StepCost:
    """Decayed least squares of forward seconds against tokens in the forward."""

    weight: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0
    tokens_sq: float = 0.0
    tokens_seconds: float = 0.0
    steps_since_plain: int = 0

    def observe(self, tokens: int, seconds: float, plain: bool) -> None:
        for name in ("weight", "tokens", "seconds", "tokens_sq", "tokens_seconds"):
            setattr(self, name, getattr(self, name) * DECAY)
        self.weight += 1.0
        self.tokens += tokens
        self.seconds += seconds
        self.tokens_sq += tokens * tokens
        self.tokens_seconds += tokens * seconds
        self.steps_since_plain = 0 if plain else self.steps_since_plain + 1

    @property
    def needs_plain_step(self) -> bool:
        return self.steps_since_plain >= PLAIN_STEP_INTERVAL

    def fit(self) -> tuple[float, float] | None:
        """(a, b) with b >= 0, or None until forwards of different sizes were seen."""
        spread = self.weight * self.tokens_sq - self.tokens * self.tokens
        if self.weight <= 0 or spread <= 1e-9 * max(1.0, self.weight * self.tokens_sq):
            return None
        slope = max(0.0, (self.weight * self.tokens_seconds - self.tokens * self.seconds) / spread)
        intercept = max(0.0, (self.seconds - slope * self.tokens) / self.weight)
        return intercept, slope

    def reach_threshold(self, batch: int) -> float:
        """The least chance of being emitted a draft token needs to be worth verifying in a step
        of `batch` requests (INITIAL_REACH_THRESHOLD while the cost is unknown)."""
        fitted = self.fit()
        if fitted is None:
            return INITIAL_REACH_THRESHOLD
        intercept, slope = fitted
        per_token = (intercept + slope * batch) / batch
        return min(1.0, slope / per_token) if per_token > 0 else 0.0
