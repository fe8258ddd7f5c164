"""Host-side speculative-decoding statistics: tau, acceptance, histograms, timing.

Inputs are what the engine records per request: the accept length of every
verify step, i.e. committed tokens = num_accepted + 1 (the bonus-token
convention in `jaxspec.speculative.verify`), and how many draft tokens that step
proposed: num_draft_tokens - 1, or the non-padding count when a drafter padded.

`SpecMetrics` keeps only additive counts, so merging across requests, batches
or runs is exact; every ratio is derived from the counts on demand. Aggregate
ratios are therefore step-weighted (total committed / total verify steps), not
a mean of per-request ratios.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

IntSeq = Sequence[int] | np.ndarray


# --------------------------------------------------------------------------
# Pure helpers over one request's steps
# --------------------------------------------------------------------------


def _as_int_array(x: Any, what: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(arr == np.round(arr)):
            raise ValueError(f"{what} must hold integers, got {arr!r}")
    return arr.astype(np.int64)


def _is_scalar(x: Any) -> bool:
    # Not np.ndim: it chokes on ragged per-request lists.
    return isinstance(x, (int, np.integer)) or (isinstance(x, np.ndarray) and x.ndim == 0)


def _proposed_per_step(num_proposed: int | IntSeq, steps: int) -> np.ndarray:
    """Broadcast a per-step constant (num_draft_tokens - 1) to every step."""
    if _is_scalar(num_proposed):
        return np.full(steps, int(num_proposed), np.int64)
    prop = _as_int_array(num_proposed, "num_proposed")
    if prop.size != steps:
        raise ValueError(f"num_proposed has {prop.size} entries for {steps} verify steps")
    return prop


def accept_length_counts(accept_lengths: IntSeq) -> tuple[int, ...]:
    """Histogram as a tuple: entry k-1 counts the steps that committed k tokens,
    for k = 1 .. max(accept_lengths) (empty input -> ())."""
    arr = _as_int_array(accept_lengths, "accept_lengths")
    if arr.size == 0:
        return ()
    if arr.min() < 1:
        raise ValueError(f"accept lengths must be >= 1 (bonus included), got {int(arr.min())}")
    return tuple(int(c) for c in np.bincount(arr - 1))


def position_acceptance(counts: Sequence[int], max_depth: int | None = None) -> tuple[float, ...]:
    """Fraction of verify steps with num_accepted >= d, for d = 1 .. max_depth.

    `counts` is an accept-length histogram (`accept_length_counts`); max_depth
    defaults to the deepest acceptance seen. No steps -> all NaN.
    """
    if max_depth is None:
        max_depth = max(len(counts) - 1, 0)
    steps = sum(counts)
    # num_accepted >= d  <=>  accept length >= d + 1  <=>  histogram index >= d.
    return tuple(_ratio(sum(counts[d:]), steps) for d in range(1, max_depth + 1))


def conditional_position_acceptance(counts: Sequence[int], max_depth: int | None = None) -> tuple[float, ...]:
    """P(draft position d accepted | positions 1 .. d-1 accepted), d = 1 .. max_depth.

    The EAGLE papers' per-position acceptance: of the verify steps that reached
    position d (accepted at least d - 1 drafts), the fraction that accepted it
    too. Unlike `position_acceptance` (unconditional) it does not decay just
    because earlier positions failed. A position no step reached is NaN.
    """
    if max_depth is None:
        max_depth = max(len(counts) - 1, 0)
    # Steps with num_accepted >= d are those at histogram index >= d.
    reached = [sum(counts[d:]) for d in range(max_depth + 1)]
    return tuple(_ratio(reached[d], reached[d - 1]) for d in range(1, max_depth + 1))


def _ratio(num: int, den: int) -> float:
    return num / den if den else math.nan


def _json_float(x: float) -> float | None:
    return None if math.isnan(x) else x


# --------------------------------------------------------------------------
# SpecMetrics
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SpecMetrics:
    """Additive counts for one request or any merge of them."""

    num_requests: int = 0
    num_verify_steps: int = 0
    num_committed: int = 0  # sum of accept lengths (bonus tokens included)
    num_proposed: int = 0  # draft tokens proposed (padding excluded)
    accept_length_counts: tuple[int, ...] = ()  # [k-1] = steps committing k tokens

    # ---- derived -------------------------------------------------------

    @property
    def num_accepted(self) -> int:
        """Accepted draft tokens: every step's bonus is committed but not a draft."""
        return self.num_committed - self.num_verify_steps

    @property
    def tau(self) -> float:
        """tau, as the EAGLE / Medusa papers define it: mean committed tokens per verify
        step, the bonus token included (plain decoding = 1). NaN without steps. The one
        definition: the CLI, the API, the server and the benchmarks all read it here."""
        return _ratio(self.num_committed, self.num_verify_steps)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (NaN if nothing was proposed)."""
        return _ratio(self.num_accepted, self.num_proposed)

    @property
    def histogram(self) -> dict[int, int]:
        """{accept length: steps} for lengths 1 .. max seen (zeros included)."""
        return {k + 1: c for k, c in enumerate(self.accept_length_counts)}

    def position_acceptance(self, max_depth: int | None = None) -> tuple[float, ...]:
        return position_acceptance(self.accept_length_counts, max_depth)

    def conditional_position_acceptance(self, max_depth: int | None = None) -> tuple[float, ...]:
        return conditional_position_acceptance(self.accept_length_counts, max_depth)

    # ---- combination ----------------------------------------------------

    def merge(self, other: SpecMetrics) -> SpecMetrics:
        a, b = self.accept_length_counts, other.accept_length_counts
        n = max(len(a), len(b))
        counts = tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0)
                       for i in range(n))
        return SpecMetrics(
            num_requests=self.num_requests + other.num_requests,
            num_verify_steps=self.num_verify_steps + other.num_verify_steps,
            num_committed=self.num_committed + other.num_committed,
            num_proposed=self.num_proposed + other.num_proposed,
            accept_length_counts=counts,
        )

    def __add__(self, other: SpecMetrics) -> SpecMetrics:
        return self.merge(other)

    # ---- output ---------------------------------------------------------

    def to_dict(self, max_depth: int | None = None) -> dict[str, Any]:
        """JSON-able: raw counts (enough for `from_dict`) plus derived ratios;
        undefined ratios are None rather than NaN, which JSON lacks."""
        return {
            "num_requests": self.num_requests,
            "num_verify_steps": self.num_verify_steps,
            "num_committed": self.num_committed,
            "num_accepted": self.num_accepted,
            "num_proposed": self.num_proposed,
            "tau": _json_float(self.tau),
            "acceptance_rate": _json_float(self.acceptance_rate),
            "accept_length_counts": list(self.accept_length_counts),
            "position_acceptance": [_json_float(x) for x in self.position_acceptance(max_depth)],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpecMetrics:
        """Inverse of `to_dict` (derived fields are ignored and recomputed)."""
        return cls(
            num_requests=int(d["num_requests"]),
            num_verify_steps=int(d["num_verify_steps"]),
            num_committed=int(d["num_committed"]),
            num_proposed=int(d["num_proposed"]),
            accept_length_counts=tuple(int(c) for c in d["accept_length_counts"]),
        )

    def summary_line(self, prefix: str = "spec") -> str:
        """One line for the CLI: tau, acceptance, counts, then the accept-length
        histogram (len[1..max]) and position_acceptance (pos, depth 1 first):

          spec: tau=2.40 accept=46.7% (7/15 drafts) steps=5 reqs=1 len[1..4]=1/2/1/1
                pos=0.80/0.40/0.20            (all on one line)
        """
        if not self.num_verify_steps:
            return f"{prefix}: no verify steps"
        rate = self.acceptance_rate
        rate_s = "n/a" if math.isnan(rate) else f"{100 * rate:.1f}%"
        hist = "/".join(str(c) for c in self.accept_length_counts)
        pos = "/".join(f"{p:.2f}" for p in self.position_acceptance())
        line = (f"{prefix}: tau={self.tau:.2f} accept={rate_s} "
                f"({self.num_accepted}/{self.num_proposed} drafts) "
                f"steps={self.num_verify_steps} reqs={self.num_requests} "
                f"len[1..{len(self.accept_length_counts)}]={hist}")
        return line + (f" pos={pos}" if pos else "")


# --------------------------------------------------------------------------
# Construction
# --------------------------------------------------------------------------


def request_metrics(accept_lengths: IntSeq, num_proposed: int | IntSeq) -> SpecMetrics:
    """Metrics of one request.

    accept_lengths: committed tokens per verify step (num_accepted + 1).
    num_proposed: drafts proposed per step, one int for every step
    (num_draft_tokens - 1) or one per step (non-padding counts).
    """
    acc = _as_int_array(accept_lengths, "accept_lengths")
    prop = _proposed_per_step(num_proposed, acc.size)
    if prop.size and prop.min() < 0:
        raise ValueError(f"num_proposed must be >= 0, got {int(prop.min())}")
    counts = accept_length_counts(acc)  # also rejects accept lengths < 1
    over = np.nonzero(acc - 1 > prop)[0]
    if over.size:
        i = int(over[0])
        raise ValueError(f"step {i}: accept length {int(acc[i])} means {int(acc[i]) - 1} "
                         f"accepted drafts, but only {int(prop[i])} were proposed")
    return SpecMetrics(
        num_requests=1,
        num_verify_steps=int(acc.size),
        num_committed=int(acc.sum()),
        num_proposed=int(prop.sum()),
        accept_length_counts=counts,
    )


def merge_metrics(metrics: Iterable[SpecMetrics]) -> SpecMetrics:
    total = SpecMetrics()
    for m in metrics:
        total = total.merge(m)
    return total


# --------------------------------------------------------------------------
# Phase timing
# --------------------------------------------------------------------------


class PhaseTimer:
    """Accumulate wall time per named phase (draft / verify / other / ...).

    JAX dispatch is asynchronous: a phase only measures device work if the
    code inside it blocks on its outputs (`jax.block_until_ready`) before the
    phase closes; otherwise it measures dispatch and the time lands in
    whichever later phase blocks.
    """

    PHASES = ("draft", "verify", "other")

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self.seconds: dict[str, float] = {p: 0.0 for p in self.PHASES}
        self.counts: dict[str, int] = {p: 0 for p in self.PHASES}

    def add(self, name: str, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"phase {name!r}: negative duration {seconds}")
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + 1

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = self._clock()
        try:
            yield
        finally:
            self.add(name, self._clock() - start)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def merge(self, other: PhaseTimer) -> PhaseTimer:
        out = PhaseTimer(self._clock)
        for src in (self, other):
            for name, s in src.seconds.items():
                out.seconds[name] = out.seconds.get(name, 0.0) + s
                out.counts[name] = out.counts.get(name, 0) + src.counts.get(name, 0)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "seconds": dict(self.seconds),
            "counts": dict(self.counts),
            "total_s": self.total,
        }
