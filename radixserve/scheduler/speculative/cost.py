"""When a draft token is worth verifying: what a verify step costs here, and each request's odds.

What a verify step costs depends on the machine: with AMX (or vdpbf16ps) a forward of eight
tokens per request costs little more than one, while on an AVX2-only CPU the bf16 matmuls are
compute-bound from about four rows on, and each extra token costs nearly half a decode step. A
verify step also runs every layer through the per-layer path, while a plain decode step takes
the fused native loop. So the drafter measures instead of assuming (StepCost):

- the time of a plain decode step of B requests, fitted as a line in B (decayed least squares),
  so p(B), the seconds per token of decoding B requests, is that over B;
- a + b * N, the time of a verify step of N tokens (the same kind of fit over verify steps): a is
  its fixed cost, b what one more token in it costs.

Then, for B running requests:
- a draft node that will be emitted with probability q gains q tokens for b seconds, worth it when
  q > b / p(B): the reach threshold below which nodes are left out of the trees;
- the step verifies only if its expected tokens, B plus the drafts' summed reach G, cost less than
  decoding them would: (B + G) * p(B) > a + b * (B + drafts).

SpeculationState (scheduler/request.py) estimates, per request, the chance that a draft is
accepted given that its parent was, from the request's recent verify steps (decaying, so a request
whose text stops or starts repeating is re-judged). A node's reach is the product of these odds
(and of the index's share for a branch) down its path.

A request whose drafts keep failing thus stops drafting, and a batch where drafts cannot pay stops
verifying. To keep the measurements fresh a plain decode step runs at least every
PLAIN_STEP_INTERVAL steps and a verify step is tried at least every EXPLORE_INTERVAL steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Each new measurement's weight against the ones before (a half-life of about 14).
DECAY = 0.95
# A plain decode step at least this often, and a verify step (when there are drafts) at least
# this often, so that both costs stay measured.
PLAIN_STEP_INTERVAL = 32
EXPLORE_INTERVAL = 64
# The reach threshold until both costs are measured: with the requests' prior odds of 0.5, first
# drafts are one token deep, a cheap first measurement.
INITIAL_REACH_THRESHOLD = 0.5


@dataclass
class LineFit:
    """Decayed least squares of seconds against tokens: seconds ~ a + b * tokens."""

    weight: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0
    tokens_sq: float = 0.0
    tokens_seconds: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        self.weight = self.weight * DECAY + 1.0
        self.tokens = self.tokens * DECAY + tokens
        self.seconds = self.seconds * DECAY + seconds
        self.tokens_sq = self.tokens_sq * DECAY + tokens * tokens
        self.tokens_seconds = self.tokens_seconds * DECAY + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(a, b), both >= 0; None until forwards of different sizes were seen."""
        spread = self.weight * self.tokens_sq - self.tokens * self.tokens
        if self.weight <= 0 or spread <= 1e-9 * max(1.0, self.weight * self.tokens_sq):
            return None
        slope = max(0.0, (self.weight * self.tokens_seconds - self.tokens * self.seconds) / spread)
        intercept = max(0.0, (self.seconds - slope * self.tokens) / self.weight)
        return intercept, slope

    def at(self, tokens: int) -> float | None:
        """The fitted seconds for a forward of `tokens`; with one size seen so far, that size's
        seconds per token times tokens; None before any."""
        fitted = self.fit()
        if fitted is not None:
            return fitted[0] + fitted[1] * tokens
        return self.seconds / self.tokens * tokens if self.tokens > 0 else None


@dataclass
class StepCost:
    """Plain decode steps (tokens = the batch) and verify steps, each fitted as a line."""

    plain: LineFit = field(default_factory=LineFit)
    verify: LineFit = field(default_factory=LineFit)
    steps_since_plain: int = 0
    steps_since_verify: int = 0

    def observe(self, tokens: int, seconds: float, plain: bool) -> None:
        (self.plain if plain else self.verify).observe(tokens, seconds)
        self.steps_since_plain = 0 if plain else self.steps_since_plain + 1
        self.steps_since_verify = self.steps_since_verify + 1 if plain else 0

    @property
    def needs_plain_step(self) -> bool:
        return self.steps_since_plain >= PLAIN_STEP_INTERVAL

    def _costs(self, batch: int) -> tuple[float, float, float] | None:
        """(seconds per token of a plain step of `batch`, verify a, verify b), once measured."""
        plain, fitted = self.plain.at(batch), self.verify.fit()
        if plain is None or fitted is None or plain <= 0:
            return None
        return plain / batch, fitted[0], fitted[1]

    def reach_threshold(self, batch: int) -> float:
        """The least chance of being emitted a draft token needs to be worth verifying in a step
        of `batch` requests: b / p (INITIAL_REACH_THRESHOLD while either is unmeasured)."""
        costs = self._costs(batch)
        if costs is None:
            return INITIAL_REACH_THRESHOLD
        per_token, _, slope = costs
        return min(1.0, slope / per_token)

    def worth_verifying(self, batch: int, drafts: int, expected_extra: float) -> bool:
        """Whether a verify step of `drafts` drafts expected to add `expected_extra` tokens beats
        a plain decode step of the batch (yes while unmeasured, and now and then to re-measure)."""
        costs = self._costs(batch)
        if costs is None or self.steps_since_verify >= EXPLORE_INTERVAL:
            return True
        per_token, intercept, slope = costs
        return (batch + expected_extra) * per_token > intercept + slope * (batch + drafts)
