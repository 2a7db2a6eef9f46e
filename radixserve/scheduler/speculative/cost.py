"""When a draft token is worth verifying: what a verify step costs here, and each request's odds.

What a verify step costs depends on the machine: with AMX (or vdpbf16ps) a forward of eight
tokens per request costs little more than one, while on an AVX2-only CPU the bf16 matmuls are
compute-bound from about four rows on, and each extra token costs nearly half a decode step. A
verify step also runs every layer through the per-layer path, while a plain decode step takes
the fused native loop. So the drafter measures instead of assuming (StepCost):

- p, the seconds per token of plain decode steps (their time over their batch size);
- a + b * N, the time of a verify step of N tokens (decayed least squares over verify steps): a
  is its fixed cost, b what one more token in it costs.

Then, for B running requests:
- a draft node that will be emitted with probability q gains q tokens for b seconds, worth it when
  q > b / p: the reach threshold below which nodes are left out of the trees;
- the step verifies only if its expected tokens, B plus the drafts' summed reach G, cost less than
  decoding them would: (B + G) * p > a + b * (B + drafts).

SpeculationState (scheduler/request.py) estimates, per request, the chance that a draft is
accepted given that its parent was, from the request's recent verify steps (decaying, so a request
whose text stops or starts repeating is re-judged). A node's reach is the product of these odds
(and of the index's share for a branch) down its path.

A request whose drafts keep failing thus stops drafting, and a batch where drafts cannot pay stops
verifying. To keep the measurements fresh a plain decode step runs at least every
PLAIN_STEP_INTERVAL steps and a verify step is tried at least every EXPLORE_INTERVAL steps.
"""

from __future__ import annotations

from dataclasses import dataclass

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
class StepCost:
    # Plain decode steps: decayed seconds and tokens.
    plain_seconds: float = 0.0
    plain_tokens: float = 0.0
    # Verify steps: decayed least-squares sums of seconds against tokens.
    weight: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0
    tokens_sq: float = 0.0
    tokens_seconds: float = 0.0
    steps_since_plain: int = 0
    steps_since_verify: int = 0

    def observe(self, tokens: int, seconds: float, plain: bool) -> None:
        if plain:
            self.plain_seconds = self.plain_seconds * DECAY + seconds
            self.plain_tokens = self.plain_tokens * DECAY + tokens
            self.steps_since_plain = 0
            self.steps_since_verify += 1
            return
        for name in ("weight", "tokens", "seconds", "tokens_sq", "tokens_seconds"):
            setattr(self, name, getattr(self, name) * DECAY)
        self.weight += 1.0
        self.tokens += tokens
        self.seconds += seconds
        self.tokens_sq += tokens * tokens
        self.tokens_seconds += tokens * seconds
        self.steps_since_plain += 1
        self.steps_since_verify = 0

    @property
    def needs_plain_step(self) -> bool:
        return self.steps_since_plain >= PLAIN_STEP_INTERVAL

    @property
    def plain_token_seconds(self) -> float | None:
        """p: seconds per token of a plain decode step."""
        return self.plain_seconds / self.plain_tokens if self.plain_tokens > 0 else None

    def verify_fit(self) -> tuple[float, float] | None:
        """(a, b) of verify steps, b >= 0; None until verify steps of different sizes were seen."""
        spread = self.weight * self.tokens_sq - self.tokens * self.tokens
        if self.weight <= 0 or spread <= 1e-9 * max(1.0, self.weight * self.tokens_sq):
            return None
        slope = max(0.0, (self.weight * self.tokens_seconds - self.tokens * self.seconds) / spread)
        intercept = max(0.0, (self.seconds - slope * self.tokens) / self.weight)
        return intercept, slope

    def reach_threshold(self) -> float:
        """The least chance of being emitted a draft token needs to be worth verifying: b / p
        (INITIAL_REACH_THRESHOLD while either is unmeasured)."""
        per_token, fitted = self.plain_token_seconds, self.verify_fit()
        if per_token is None or fitted is None or per_token <= 0:
            return INITIAL_REACH_THRESHOLD
        return min(1.0, fitted[1] / per_token)

    def worth_verifying(self, batch: int, drafts: int, expected_extra: float) -> bool:
        """Whether a verify step of `drafts` drafts expected to add `expected_extra` tokens beats
        a plain decode step of the batch (yes while unmeasured, and now and then to re-measure)."""
        per_token, fitted = self.plain_token_seconds, self.verify_fit()
        if per_token is None or fitted is None or self.steps_since_verify >= EXPLORE_INTERVAL:
            return True
        intercept, slope = fitted
        return (batch + expected_extra) * per_token > intercept + slope * (batch + drafts)
