"""How many draft tokens a step should carry: as many as pay for themselves.

With per-draft acceptance rate a, a request that carries k drafts emits on average
E(k) = (1 - a^(k+1)) / (1 - a) tokens per step. Carrying them makes the step compute B(k+1)
tokens instead of B. A step without drafts takes t(B), t(n) = fixed + per_token x n: the weights
streamed once a step (fixed) and the work per token; one with drafts takes t(B(k+1)) + x(B(k+1)),
where x(n), fitted the same way to what drafted steps took beyond t, is what drafts add besides
tokens: proposing them (a draft model's own forwards), and a step with drafts does not overlap
the next one's scheduling (x is 0 until drafted steps were timed). The speedup of k drafts
over none is E(k) t(B) / (t(B(k+1)) + x(B(k+1))); the controller picks the k that maximizes it,
and 0 unless that beats 1 by a margin. At batch 1 the step is all weight streaming, so drafts
are nearly free; at large batches the per-token work dominates and drafts stop paying. Where
only a share h of the requests gets drafts (prompt lookup finds no match for the others), the
step emits B((1 - h) + h E(k)) tokens for t(B(1 + h k)) + x(B(1 + h k)).

a is estimated as each draft position were a coin flip until the first rejection: kept drafts
over kept drafts plus rejections (a request whose drafts were all kept saw no rejection). While
drafts are off, a cheap proposer's unverified first drafts, scored against the tokens that
came, keep a and h measured (`Speculator.shadow`); for others, an exploring step now and then.

`StepCosts` learns fixed and per_token from the steps the engine times (least squares over a
window), starting from a prior, so the choice follows the hardware and the model it runs on.
"""

from __future__ import annotations

from collections import deque


class Rate:
    """Exponential moving average of a success rate, one update per step (prior: 0.5)."""

    def __init__(self, prior: float = 0.5, weight: float = 0.1) -> None:
        self.value = prior
        self.weight = weight

    def update(self, trials: int, successes: int) -> None:
        if trials > 0:
            self.value += self.weight * (successes / trials - self.value)


class StepCosts:
    """t(n) = fixed + per_token x n seconds for a step of n tokens, fitted to recent steps;
    `signed`: either term may be negative (a difference of costs)."""

    def __init__(
        self, fixed: float, per_token: float, window: int = 256, signed: bool = False
    ) -> None:
        self.fixed = fixed
        self.per_token = per_token
        self.signed = signed
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        # Running sums over the window: n, x, y, x^2, xy (so a step costs O(1) to fit).
        self._sums = [0.0] * 5

    def seconds(self, num_tokens: float) -> float:
        return self.fixed + self.per_token * num_tokens

    def observe(self, num_tokens: int, seconds: float) -> None:
        """A timed step. Over steps of one size only, the work per token stays and the fixed
        cost moves to fit them; over several sizes both do."""
        if len(self._samples) == self._samples.maxlen:
            self._add(*self._samples[0], sign=-1.0)
        self._samples.append((num_tokens, seconds))
        self._add(num_tokens, seconds, sign=1.0)
        n, sx, sy, sxx, sxy = self._sums
        var = sxx - sx * sx / n
        if var <= 1e-9 * max(sxx, 1.0):  # (one size only)
            fixed = (sy - self.per_token * sx) / n
            self.fixed = fixed if self.signed else max(fixed, 1e-6)
            return
        slope = (sxy - sx * sy / n) / var
        intercept = (sy - slope * sx) / n
        if self.signed or (slope > 0 and intercept > 0):
            self.per_token, self.fixed = slope, intercept

    def _add(self, x: float, y: float, sign: float) -> None:
        for i, term in enumerate((1.0, x, y, x * x, x * y)):
            self._sums[i] += sign * term


def expected_tokens(acceptance: float, num_drafts: int) -> float:
    """Tokens a request emits per step on average with `num_drafts` drafts."""
    if acceptance >= 1.0:
        return float(num_drafts + 1)
    return (1.0 - acceptance ** (num_drafts + 1)) / (1.0 - acceptance)


def choose_num_drafts(
    batch_size: int,
    acceptance: float,
    max_drafts: int,
    costs: StepCosts,
    extra: StepCosts | None = None,
    margin: float = 1.05,
    proposal_rate: float = 1.0,
) -> int:
    """The draft count (0..max_drafts) with the best expected speedup for this batch, where a
    share `proposal_rate` of the requests gets drafts, steps cost `costs` and those with drafts
    `extra` more (none by default); 0 when none beats decoding without drafts by `margin`."""
    if batch_size < 1:
        return 0
    base = costs.seconds(batch_size)
    h = proposal_rate
    best, best_speedup = 0, margin
    for k in range(1, max_drafts + 1):
        tokens = (1 - h) + h * expected_tokens(acceptance, k)
        size = batch_size * (1 + h * k)
        drafted = costs.seconds(size) + (max(extra.seconds(size), 0.0) if extra else 0.0)
        speedup = tokens * base / drafted
        if speedup > best_speedup:
            best, best_speedup = k, speedup
    return best


class DraftLength:
    """The engine's choice of drafts per request for each step: `max_drafts`, or with
    `adaptive` the count `choose_num_drafts` finds worth it for the batch, from the acceptance
    and the step costs (with and without drafts) observed so far."""

    # After this many steps without drafts, one step tries a single draft per request, so the
    # acceptance and the cost of drafted steps stay measured (they change with the traffic).
    # Each try that does not bring drafts back doubles the wait, up to the most.
    EXPLORE_EVERY = 64
    MAX_EXPLORE_EVERY = 1024
    OUTLIER = 10.0  # (times the predicted cost: see observe_cost)
    OUTLIER_RUN = 2  # (outliers in a row ignored: the next is what such steps cost now)

    def __init__(
        self, max_drafts: int, adaptive: bool, costs: StepCosts, explores: bool = True
    ) -> None:
        """`explores`: try one draft per request now and then while drafts are off (for a
        proposer whose acceptance is not measured otherwise)."""
        self.max_drafts = max_drafts
        self.adaptive = adaptive
        self.explores = explores
        self.costs = costs  # steps without drafts
        self.extra = StepCosts(0.0, 0.0, signed=True)  # what steps with drafts took beyond
        self.acceptance = Rate()  # a: per draft position, until the first rejection
        self.proposal_rate = Rate(prior=1.0)  # h: decoding requests that got drafts
        self._steps_without = 0
        self._explore_every = self.EXPLORE_EVERY
        self._last_drafted = False  # (whether the last step timed had drafts asked for)
        self._outliers = {False: 0, True: 0}  # outliers in a row, of steps without and with

    def choose(self, batch_size: int) -> int:
        if not batch_size:
            return 0
        if not self.adaptive:
            return self.max_drafts
        k = choose_num_drafts(
            batch_size,
            self.acceptance.value,
            self.max_drafts,
            self.costs,
            self.extra,
            proposal_rate=self.proposal_rate.value,
        )
        if k:
            self._steps_without, self._explore_every = 0, self.EXPLORE_EVERY
            return k
        self._steps_without += 1
        if not self.explores or self._steps_without < self._explore_every:
            return 0
        self._steps_without = 0
        self._explore_every = min(2 * self._explore_every, self.MAX_EXPLORE_EVERY)
        return 1

    def observe(self, num_accepted: int, num_rejected: int) -> None:
        """A finished step's kept drafts and rejections (drafted requests that had one
        rejected)."""
        if self.adaptive:
            self.acceptance.update(num_accepted + num_rejected, num_accepted)

    def observe_cost(self, num_tokens: int, seconds: float, drafted: bool) -> None:
        """A step's size and what it cost, from scheduling to its outputs taken; `drafted`:
        drafts were asked for it.

        Not fitted: a step that took more than OUTLIER times what its kind and size predict (a
        kernel compiled, a collector's pause: nothing drafts change), unless it follows
        OUTLIER_RUN such steps of its kind (then it is what they cost now: a draft model's
        proposals that take ten plain steps must stop drafts), and a step with drafts right after
        one without: its proposal caught up on what the pause left (the n-gram index, the draft
        model's cache), which drafting step after step does not pay. An exploration costs that
        once; what drafts cost when they are used is learned from steps that follow drafted ones."""
        if not self.adaptive:
            return
        resumed, self._last_drafted = drafted and not self._last_drafted, drafted
        plain = self.costs.seconds(num_tokens)
        predicted = plain + (max(self.extra.seconds(num_tokens), 0.0) if drafted else 0.0)
        if seconds > self.OUTLIER * predicted:
            self._outliers[drafted] += 1
            if self._outliers[drafted] <= self.OUTLIER_RUN:
                return
        else:
            self._outliers[drafted] = 0
        if resumed:
            return
        if drafted:
            self.extra.observe(num_tokens, seconds - plain)
        else:
            self.costs.observe(num_tokens, seconds)

    def observe_proposals(self, num_decoding: int, num_drafted: int) -> None:
        """Of `num_decoding` requests asked for drafts, `num_drafted` got some."""
        self.proposal_rate.update(num_decoding, num_drafted)
