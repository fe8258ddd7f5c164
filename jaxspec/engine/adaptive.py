"""Adaptive speculation: the draft length per batch-size bucket, from measured acceptance and cost.

Speculation pays while verifying k+1 tokens costs about one decode step. As the
batch grows, decode stops being bandwidth-bound and verify stops being free,
so the best draft length falls, down to 0 (plain decoding).

Model (chain drafts): r_i is the rate at which draft position i is accepted
given position i-1 was: accepted over reached, both counted over verify steps
with a half-life of `rate_half_life` reached positions, so a call weighs what
it saw. (An EMA per call let one batch-1 call of a repetitive prompt lift E(3)
at batch 8 from 1.4 to 2.2 and switch the bucket to a losing chain of 3 for a
call, then drop it back: at C = 8 the server read 0.96x of speculation off with it, 1.04x
with the counts, 5 interleaved rounds each.) A step drafting k
tokens commits E(k) = 1 + sum_{i<=k} prod_{j<=i} r_j tokens on average
(bonus included). cost(k, bucket) is the seconds per iteration in a decode
bucket (batch size, context): seeded by a start-up calibration of every
bucket, then an EMA of measured device calls. The context is part of the key
because a call's cost grows with it: were it left out, the draft length in use
would be charged for long contexts while the others kept their cheap
calibration, and the policy would drift towards whatever it is not using.
The choice maximises E(k) / cost(k, bucket); it switches only when the winner beats
the current choice by `hysteresis`, so noise does not flap it. With a `margin` (the server's
`serve.adaptive_margin`) a draft length must beat plain decoding by it, and a tie goes to plain
decoding (`choose` says why). Positions
beyond the deepest one observed reuse its rate.

Exploration: a bucket's second and following calls first run each other
candidate once (`explore`), so the comparison is between live costs from the
start: the start-up calibration misses host overhead and real drafts, and a
live cost against a calibrated one biased the choice (at C = 32 the server ran
a chain of 1 for 23 of batch 32's 49 calls, at 0.85x plain decoding's live
tokens/s). Then, now and then, a call runs another candidate (round robin), so
the costs stay live and acceptance keeps being measured while at k = 0. The
first probe comes after `probe_every` calls; each probe that leaves the choice
as it was doubles the gap to the next, up to `max_probe_every`, and a switch
resets it. A probe at a large batch is the losing program by construction (a
k = 3 call over 32 rows costs ~2.5 plain calls for ~1.4x the tokens), so a
fixed gap of 16 calls cost the server 8% at C = 32; a settled bucket now pays
a fraction of a percent.
"""

from __future__ import annotations

import logging
from typing import Hashable, Mapping, Sequence

log = logging.getLogger("jaxspec.adaptive")


class AdaptiveSteps:
    def __init__(self, candidates: Sequence[int], cost: Mapping[tuple, float], *, ema: float = 0.1,
                 hysteresis: float = 0.1, probe_every: int = 16, max_probe_every: int = 256,
                 prior_rate: float = 0.5, explore: bool = True, plausible: float = 0.75,
                 rate_half_life: float = 256.0, margin: float = 0.0):
        self.candidates = tuple(sorted(set(candidates)))
        if not self.candidates or min(self.candidates) < 0:
            raise ValueError(f"adaptive candidates must be non-negative draft lengths, got {candidates}")
        self.cost = dict(cost)
        self.ema = ema
        self.hysteresis = hysteresis
        if margin < 0:
            raise ValueError(f"adaptive margin must be >= 0, got {margin}")
        # Speculation must beat plain decoding (k = 0, when a candidate) by this much, and falls back
        # to it as soon as it does not: see `choose`.
        self.margin = margin if 0 in self.candidates else 0.0
        self.probe_every = probe_every
        self.max_probe_every = max(max_probe_every, probe_every)
        depth = max(self.candidates)
        self.rates = [prior_rate] * depth  # r_1..r_depth
        self._accepted = [0.0] * depth  # decayed counts behind each observed rate
        self._reached = [0.0] * depth
        self._decay = 0.5 ** (1.0 / rate_half_life)  # per reached position
        self.current: dict[Hashable, int] = {}  # bucket -> k
        self._calls: dict[Hashable, int] = {}
        self._probe_turn: dict[Hashable, int] = {}
        self._probe_gap: dict[Hashable, int] = {}  # calls between probes, doubled while the choice holds
        self._next_probe: dict[Hashable, int] = {}  # the call number of the bucket's next probe
        self._live: set = set()  # (k, bucket) costs measured while serving
        self.explore = explore
        self.plausible = plausible
        self._explored: set = set()  # (k, bucket) run once by exploration
        self._calibration: dict[tuple, float] = {}  # (k, bucket) -> its calibrated cost, once live

    # ---- model -------------------------------------------------------------------

    @property
    def observed(self) -> list[bool]:
        """Per draft position: whether any verify step has reached it (else its rate is the prior)."""
        return [r > 0 for r in self._reached]

    def _rate(self, i: int) -> float:
        """r_{i+1} (0-based i): observed, else the deepest observed shallower one."""
        for j in range(i, -1, -1):
            if self._reached[j] > 0:
                return self.rates[j]
        return self.rates[i]

    def expected_tokens(self, k: int) -> float:
        total, p = 1.0, 1.0
        for i in range(k):
            p *= self._rate(i)
            total += p
        return total

    def estimated_cost(self, k: int, b: Hashable) -> float | None:
        """Live, else calibrated; with exploration a calibration is scaled by the bucket's mean
        live / calibrated ratio (real rows cost 2-4x the dummy ones at C = 32), so that it compares
        with live costs."""
        cost = self.cost.get((k, b))
        if cost is None or (k, b) in self._live or not self.explore:
            return cost
        ratios = [self.cost[(j, b)] / self._calibration[(j, b)] for j in self.candidates
                  if (j, b) in self._calibration]
        cost = cost * sum(ratios) / len(ratios) if ratios else cost
        return max(cost, self._live_ratio_floor(k, b))

    def _live_ratio_floor(self, k: int, b: Hashable) -> float:
        """Drafting never gets relatively cheaper with more rows or more drafts: a verify of k+1
        rows per sequence grows from bandwidth- towards compute-bound with the batch, and a longer
        draft costs at least a shorter one. So in a (batch, context) bucket, k costs at least plain's
        estimate times the largest live j / plain ratio with 0 < j <= k at a batch <= b (same
        context). At C = 32 the server learns at batch 16, or from a chain of 1 at batch 32, that
        a chain of 3 costs 2+ plain calls, where the dummy-row calibration of batch 32 says 1.8 and
        live it costs 3.4."""
        if k == 0 or not isinstance(b, tuple) or len(b) != 2:
            return 0.0
        ratios = [self.cost[(j, s)] / self.cost[(0, s)] for (j, s) in self._live
                  if 0 < j <= k and (j, s) != (k, b) and isinstance(s, tuple) and len(s) == 2
                  and s[1] == b[1] and s[0] <= b[0] and (0, s) in self._live]
        plain = self.estimated_cost(0, b)
        return plain * max(ratios) if ratios and plain else 0.0

    def score(self, k: int, b: Hashable) -> float:
        cost = self.estimated_cost(k, b)
        return self.expected_tokens(k) / cost if cost else 0.0

    def _worth_running(self, k: int, cur: int, b: Hashable) -> bool:
        """Whether exploring or probing k is worth a call: a shorter draft always (it costs less than
        `cur`'s call), a longer one only if its estimate is within `plausible` of `cur`'s score (a
        chain of 3 over 32 rows costs 3.4 plain calls live, for 1.2x the tokens)."""
        return k < cur or self.score(k, b) >= self.plausible * self.score(cur, b)

    # ---- policy ------------------------------------------------------------------

    def _adjusted(self, k: int, b: Hashable) -> float:
        """The score the choice compares: a draft length's divided by 1 + `margin`."""
        return self.score(k, b) / (1 + self.margin) if k else self.score(k, b)

    def best(self, b: Hashable) -> int:
        return max(self.candidates, key=lambda k: (self._adjusted(k, b), -k))

    def choose(self, b: Hashable) -> int:
        """The draft length of bucket b's next call. The current choice holds until another beats it
        by `hysteresis`. With a `margin`, scores of k > 0 count 1 + margin less, and a draft length
        no longer ahead of plain decoding by the margin is judged as if plain were current: it gives
        way at once, to plain or to a draft length that beats plain by the hysteresis. Speculation
        has costs outside its iterations that the score misses: rows that commit different numbers
        of tokens end at different iterations, and the last rows of a batch then run at a smaller
        batch (a wave of 8 equal requests at C = 8 lost ~10% to that with a chain of 1 that tied
        plain decoding per iteration). So a tie goes to plain decoding, and switching to a draft
        length takes (1 + hysteresis)(1 + margin) of plain's score."""
        prev = self.current.get(b)
        best = self.best(b)
        base = prev
        if base and self.margin and self._adjusted(0, b) >= self._adjusted(base, b):
            base = 0  # no longer ahead of plain decoding by the margin: choose as if plain were current
        ahead = base is None or self._adjusted(best, b) > (1 + self.hysteresis) * self._adjusted(base, b)
        cur = best if ahead else base
        self.current[b] = cur
        n = self._calls.get(b, 0) + 1
        self._calls[b] = n
        if cur != prev:  # a new choice (or the first): probe soon again
            log.info("adaptive: bucket %s -> k=%d (was %s; call %d): %s", b, cur, prev, n, self.describe(b))
            self._probe_gap[b] = self.probe_every
            self._next_probe[b] = n - 1 + self.probe_every
        if self.explore and n > 1:  # the first call measured `cur`; then each other candidate once
            fresh = [k for k in self.candidates if k != cur and (k, b) not in self._live
                     and (k, b) not in self._explored and self._worth_running(k, cur, b)]
            if fresh:
                self._explored.add((fresh[0], b))
                return fresh[0]
        others = [k for k in self.candidates if k != cur and (not self.explore or self._worth_running(k, cur, b))]
        if others and n >= self._next_probe[b]:
            turn = self._probe_turn.get(b, 0)
            self._probe_turn[b] = turn + 1
            self._probe_gap[b] = gap = min(2 * self._probe_gap[b], self.max_probe_every)
            self._next_probe[b] = n + gap
            return others[turn % len(others)]
        return cur

    def describe(self, b: Hashable) -> str:
        """Each candidate's E(k), cost (live or calibrated) and score in bucket b, for the log."""
        return ", ".join(
            f"k={k} E={self.expected_tokens(k):.2f} cost={1e3 * (self.estimated_cost(k, b) or 0):.1f}ms"
            f"{'' if (k, b) in self._live else ' (calibrated)'} score={self.score(k, b):.0f}" for k in self.candidates)

    def observe(self, k: int, b: Hashable, accept_lens: Sequence[int], seconds_per_iteration: float | None) -> None:
        """accept_lens: committed tokens per verify step (num_accepted + 1) at draft length k."""
        if seconds_per_iteration and seconds_per_iteration > 0:
            # The first live measurement replaces the calibration outright.
            old = self.cost.get((k, b)) if (k, b) in self._live else None
            if old is None and self.cost.get((k, b)):
                self._calibration[(k, b)] = self.cost[(k, b)]
            self._live.add((k, b))
            self.cost[(k, b)] = seconds_per_iteration if old is None else (
                (1 - self.ema) * old + self.ema * seconds_per_iteration)
        if k == 0 or not accept_lens:
            return
        for i in range(k):  # position i+1: reached if i drafts were accepted
            reached = sum(1 for a in accept_lens if a - 1 >= i)
            if not reached:
                break
            keep = self._decay ** reached
            self._accepted[i] = keep * self._accepted[i] + sum(1 for a in accept_lens if a - 1 >= i + 1)
            self._reached[i] = keep * self._reached[i] + reached
            self.rates[i] = self._accepted[i] / self._reached[i]


class EngineAdaptive:
    """The offline engine's policy (`Engine(adaptive=True)`): per batch bucket, the draft length
    among `widths` (k -> verify width: 0 is plain decoding, the largest k the configured shape,
    the others shorter chains, `spec.adaptive_lengths`) that `AdaptiveSteps` scores highest.

    The engine runs a whole batch in one on-device loop, so the choice is made per batch, before
    it starts. Costs are seconds per loop iteration in the bucket. Plain decoding and the
    configured shape are calibrated the first time a bucket is used (a short dummy batch through
    both programs); a shorter chain starts at the cost interpolated between them by verify width
    (the verify is what grows with k) and is compiled only when chosen, so a length no bucket
    wants costs no compile. Every real batch then updates its program's cost (an EMA; the first
    replaces the estimate). Acceptance rates are shared across buckets (a batch-1 run informs the
    batch-8 choice) and start at `prior_rate`. There is no probing: a whole batch spent on the
    losing program costs more offline than a server's single probe call.
    """

    def __init__(self, widths: Mapping[int, int], *, hysteresis: float = 0.1, prior_rate: float = 0.5):
        self.widths = dict(widths)
        self.depth = max(self.widths)
        if 0 not in self.widths or self.depth == 0:
            raise ValueError(f"the engine's policy needs plain decoding (k = 0) and a draft length, got {widths}")
        self.measured = (0, self.depth)  # calibrated per bucket; the others are interpolated
        self.steps = AdaptiveSteps(tuple(self.widths), {}, hysteresis=hysteresis, probe_every=2**31,
                                   prior_rate=prior_rate, explore=False)
        self.choices: dict[Hashable, list[int]] = {}  # bucket -> k of each batch run there

    def calibrated(self, bucket: Hashable) -> bool:
        return all((k, bucket) in self.steps.cost for k in self.steps.candidates)

    def calibrate(self, bucket: Hashable, seconds_per_iteration: Mapping[int, float]) -> None:
        """Measured costs of k = 0 and the configured shape; the shorter chains' by width between them."""
        c0, cd = (max(seconds_per_iteration[k], 1e-9) for k in self.measured)
        w0, wd = self.widths[0], self.widths[self.depth]
        for k, w in self.widths.items():
            self.steps.cost[(k, bucket)] = c0 + (cd - c0) * (w - w0) / max(wd - w0, 1)

    def choose(self, bucket: Hashable) -> int:
        k = self.steps.choose(bucket)
        self.choices.setdefault(bucket, []).append(k)
        return k

    def observe(self, k: int, bucket: Hashable, accept_lens: Sequence[int], seconds_per_iteration: float | None):
        self.steps.observe(k, bucket, accept_lens, seconds_per_iteration)

    def summary(self) -> str:
        """One line: each bucket's batches by draft length, and the expected tokens per step."""
        if not self.choices:
            return "adaptive: no batches"
        parts = []
        for (b, ctx), ks in sorted(self.choices.items()):
            runs = ", ".join(f"{'plain' if k == 0 else f'k={k}'} x{ks.count(k)}" for k in sorted(set(ks)))
            parts.append(f"batch {b} ctx {ctx}: {runs}")
        expected = ", ".join(f"k={k}: {self.steps.expected_tokens(k):.2f}" for k in self.steps.candidates if k)
        return f"adaptive: {'; '.join(parts)} (E[tokens/step] {expected})"


def calibrate(runner) -> None:
    """Time a decode call per (k, batch bucket, context bucket) of a serving `ModelRunner` on dummy
    rows, into runner.decode_seconds: the policy's prior for draft lengths it has not tried yet in
    a bucket."""
    import time

    import numpy as np

    from jaxspec.engine.types import RowInput
    from jaxspec.sampling_params import SamplingParams

    endless = SamplingParams(max_tokens=10**6)
    for k in runner.candidates:
        for b in runner.batch_buckets:
            for ctx in runner.context_buckets:
                rows = [RowInput(tokens=[1] * 8, prompt_len=8, page_row=np.zeros(runner.max_pages, np.int32),
                                 slot=runner.num_slots, params=endless) for _ in range(b)]
                times = []
                for _ in range(2):  # the first call warms up
                    t0 = time.perf_counter()
                    _, iters = runner.decode(k, rows, ctx)
                    times.append((time.perf_counter() - t0) / max(iters, 1))
                runner.decode_seconds[(k, (b, ctx))] = times[-1]
