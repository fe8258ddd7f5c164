"""Speculative metrics against hand-computed examples and a naive implementation."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from jaxspec.speculative import metrics as M
from jaxspec.speculative.metrics import PhaseTimer, SpecMetrics


def test_hand_computed_request():
    # num_draft_tokens = 4 -> 3 drafts proposed per step; accepted 2, 0, 3, 1, 1.
    m = M.request_metrics([3, 1, 4, 2, 2], 3)
    assert (m.num_requests, m.num_verify_steps, m.num_committed, m.num_proposed) == (1, 5, 12, 15)
    assert m.num_accepted == 7
    assert m.tau == pytest.approx(12 / 5)
    assert m.acceptance_rate == pytest.approx(7 / 15)
    assert m.accept_length_counts == (1, 2, 1, 1)
    assert m.histogram == {1: 1, 2: 2, 3: 1, 4: 1}
    # num_accepted >= 1: 4 of 5 steps; >= 2: 2; >= 3: 1.
    assert m.position_acceptance() == pytest.approx((0.8, 0.4, 0.2))
    assert m.position_acceptance(5) == pytest.approx((0.8, 0.4, 0.2, 0.0, 0.0))
    assert m.position_acceptance(1) == pytest.approx((0.8,))


def test_per_step_proposed_counts():
    # A drafter that padded: 3, 1, 0 real drafts; the last step could only commit the bonus.
    m = M.request_metrics(np.array([2, 2, 1]), [3, 1, 0])
    assert m.num_proposed == 4 and m.num_accepted == 2
    assert m.acceptance_rate == pytest.approx(0.5)
    assert m.accept_length_counts == (1, 2)


def batch(accept_lengths, num_proposed):
    """Per-request metrics and their merge (what the engine and the server do per batch)."""
    props = [num_proposed] * len(accept_lengths) if isinstance(num_proposed, int) else num_proposed
    per = [M.request_metrics(a, p) for a, p in zip(accept_lengths, props)]
    return per, M.merge_metrics(per)


def test_batch_and_merge():
    per, agg = batch([[1, 1, 2], [4, 4]], 3)
    assert [p.tau for p in per] == pytest.approx([4 / 3, 4.0])
    assert agg.num_requests == 2 and agg.num_verify_steps == 5
    # Aggregate tau is step-weighted: 12 / 5, not the mean of 4/3 and 4.
    assert agg.tau == pytest.approx(12 / 5)
    assert agg.acceptance_rate == pytest.approx(7 / 15)
    assert agg.accept_length_counts == (2, 1, 0, 2)
    assert agg.position_acceptance() == pytest.approx((0.6, 0.4, 0.4))
    assert per[0] + per[1] == agg == per[1].merge(per[0])
    assert M.merge_metrics([]) == SpecMetrics()

    per2, agg2 = batch([[1, 2], [3]], [[1, 1], 2])
    assert [p.num_proposed for p in per2] == [2, 2] and agg2.num_proposed == 4


def test_empty_and_undefined():
    m = M.request_metrics([], 3)
    assert m.num_verify_steps == 0 and m.accept_length_counts == ()
    assert math.isnan(m.tau) and math.isnan(m.acceptance_rate)
    assert m.position_acceptance() == ()
    assert all(math.isnan(x) for x in m.position_acceptance(2))
    d = m.to_dict(max_depth=2)
    assert d["tau"] is None and d["acceptance_rate"] is None and d["position_acceptance"] == [None, None]
    assert m.summary_line() == "spec: no verify steps"
    # Zero proposed drafts (e.g. an n-gram miss every step): tau defined, rate not.
    z = M.request_metrics([1, 1], 0)
    assert z.tau == 1.0 and math.isnan(z.acceptance_rate)
    assert "accept=n/a" in z.summary_line()


@pytest.mark.parametrize("acc, prop, message", [
    ([2, 0], 3, "must be >= 1"),
    ([5], 3, "step 0: accept length 5 means 4 accepted drafts, but only 3 were proposed"),
    ([1, 3], [3, 1], "step 1: accept length 3"),
    ([1, 2], [3], "num_proposed has 1 entries for 2 verify steps"),
    ([1], -1, "num_proposed must be >= 0"),
    ([[1, 2]], 3, "one-dimensional"),
    ([1.5], 3, "integers"),
])
def test_bad_inputs(acc, prop, message):
    with pytest.raises(ValueError, match=message):
        M.request_metrics(acc, prop)


def test_summary_line_and_json_roundtrip():
    _, agg = batch([[3, 1, 4, 2, 2]], 3)
    line = agg.summary_line()
    assert "\n" not in line
    assert line == ("spec: tau=2.40 accept=46.7% (7/15 drafts) steps=5 reqs=1 "
                    "len[1..4]=1/2/1/1 pos=0.80/0.40/0.20")
    d = json.loads(json.dumps(agg.to_dict()))
    assert d["tau"] == pytest.approx(2.4) and d["num_accepted"] == 7
    assert d["accept_length_counts"] == [1, 2, 1, 1]
    assert SpecMetrics.from_dict(d) == agg
    # Only bonus tokens: no pos= part.
    assert M.request_metrics([1, 1], 3).summary_line().endswith("len[1..1]=2")


def _naive(accept_lengths, proposed, max_depth):
    """Direct transcription of the definitions, step by step."""
    steps = [(a, p) for req_a, req_p in zip(accept_lengths, proposed) for a, p in zip(req_a, req_p)]
    n = len(steps)
    committed = sum(a for a, _ in steps)
    accepted = sum(a - 1 for a, _ in steps)
    prop = sum(p for _, p in steps)
    top = max((a for a, _ in steps), default=0)
    hist = [sum(1 for a, _ in steps if a == k) for k in range(1, top + 1)]
    pos = [sum(1 for a, _ in steps if a - 1 >= d) / n for d in range(1, max_depth + 1)]
    return committed / n, accepted / prop, hist, pos, n


def test_random_against_naive():
    rng = random.Random(0)
    for _ in range(200):
        n_draft = rng.randint(1, 8)
        reqs = rng.randint(1, 5)
        acc, prop = [], []
        for _ in range(reqs):
            steps = rng.randint(1, 12)
            p = [rng.randint(1, n_draft) for _ in range(steps)]
            acc.append([rng.randint(1, q + 1) for q in p])
            prop.append(p)
        per, agg = batch(acc, prop)
        depth = rng.randint(1, n_draft + 1)
        tau, rate, hist, pos, n = _naive(acc, prop, depth)
        assert agg.tau == pytest.approx(tau)
        assert agg.acceptance_rate == pytest.approx(rate)
        assert list(agg.accept_length_counts) == hist
        assert agg.position_acceptance(depth) == pytest.approx(pos)
        assert agg.num_verify_steps == n
        for a, p, m in zip(acc, prop, per):
            assert m.tau == pytest.approx(_naive([a], [p], 1)[0])
        # Merging in any grouping gives the same counts.
        rng.shuffle(per)
        cut = rng.randint(0, len(per))
        assert M.merge_metrics(per[:cut]) + M.merge_metrics(per[cut:]) == agg


# ---------------------------------------------------------------- PhaseTimer


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_phase_timer():
    clock = FakeClock()
    t = PhaseTimer(clock)
    with t.phase("draft"):
        clock.t += 1.5
    with t.phase("verify"):
        clock.t += 2.0
    with pytest.raises(RuntimeError):
        with t.phase("draft"):
            clock.t += 0.5
            raise RuntimeError("boom")  # time up to the error still counts
    t.add("sample", 0.25)
    d = json.loads(json.dumps(t.to_dict()))
    assert d["seconds"] == {"draft": 2.0, "verify": 2.0, "other": 0.0, "sample": 0.25}
    assert d["counts"] == {"draft": 2, "verify": 1, "other": 0, "sample": 1}
    assert d["total_s"] == pytest.approx(4.25)
    both = t.merge(t)
    assert both.seconds["draft"] == 4.0 and both.counts["sample"] == 2
    with pytest.raises(ValueError, match="negative"):
        t.add("other", -1.0)


def test_phase_timer_default_clock_is_perf_counter():
    """The default clock is time.perf_counter, in seconds: a phase's measured time lies
    between two perf_counter intervals read inside and around it. Nesting, not
    durations, so it holds on any machine; a different clock (time.time, a _ns
    counter, a wrong unit) or a start/stop taken at the wrong point fails it."""
    import time

    t = PhaseTimer()
    outer0 = time.perf_counter()
    with t.phase("draft"):
        inner0 = time.perf_counter()
        while time.perf_counter() - inner0 < 2e-3:  # advance the clock; no sleep, no wall-time assertion
            pass
        inner1 = time.perf_counter()
    outer1 = time.perf_counter()
    assert inner1 - inner0 <= t.seconds["draft"] <= outer1 - outer0
    assert t.counts["draft"] == 1 and t.seconds["verify"] == 0.0 and t.counts["verify"] == 0


def test_conditional_position_acceptance_hand_computed():
    # Accepted drafts per step: 2, 0, 3, 1, 1 (accept lengths 3, 1, 4, 2, 2).
    # Position 1 reached by all 5 steps, accepted by 4; position 2 reached by those 4,
    # accepted by 2; position 3 reached by 2, accepted by 1; position 4 reached by 1, accepted by 0.
    m = M.request_metrics([3, 1, 4, 2, 2], 3)
    assert m.conditional_position_acceptance() == pytest.approx((4 / 5, 2 / 4, 1 / 2))
    got = M.conditional_position_acceptance(m.accept_length_counts, 5)
    assert got[:4] == pytest.approx((4 / 5, 2 / 4, 1 / 2, 0.0)) and math.isnan(got[4])  # no step reached 5
    # tau is the mean of the accept lengths, bonus included: 12 / 5.
    assert m.tau == pytest.approx(2.4)


def test_conditional_acceptance_times_out_to_the_unconditional():
    # Independent reference: the product of the conditional rates up to d is P(accepted >= d),
    # and the unconditional rates sum to tau - 1 (the bonus is not a draft).
    lens = np.random.default_rng(3).integers(1, 8, 400)
    m = M.request_metrics(lens, 7)
    cond, uncond = m.conditional_position_acceptance(7), m.position_acceptance(7)
    assert np.cumprod(cond) == pytest.approx(uncond)
    naive = [np.mean(lens - 1 >= d) / np.mean(lens - 1 >= d - 1) for d in range(1, 8)]
    assert cond == pytest.approx(naive)
    assert sum(uncond) + 1 == pytest.approx(m.tau)
    # Positive control: a chain that always accepts exactly 2 drafts has conditional (1, 1, 0).
    assert M.conditional_position_acceptance(M.accept_length_counts([3] * 5), 3) == pytest.approx((1, 1, 0))
