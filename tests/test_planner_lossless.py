"""DSPARK's planner keeps sampled rows exact when it really cuts them (issue 23, item 1).

The planner chooses each row's draft budget from the drafter's confidences, and c_{d+1} reads the
Markov bias of the sampled draft x_d. A budget planned from all of a row's survivals therefore
decides whether x_d is verified from x_d itself, and rejection no longer reproduces p (the audit's
repro: q = (.5, .5), p = (.2, .8), c1 = .6, c2 = 1[x1 = 0], SPS = (1, .5, .5) at batch 1 gives
P(first = 0) = 0.3). The earlier end-to-end test could not see it: at its batch the SPS table was
clamped and every budget was full.

Here the first two tokens' distribution is computed EXACTLY, by enumerating the drafts (x1, x2),
the budgets the real planner (`plan_row_budgets`) gives for each, and the rejection rule, on random
instances planned alone (batch 1, where the bias is largest), and compared with p1(t1) p2(t2 | t1).
The budgets must really vary (a histogram is asserted). Positive control: the old joint rule.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.speculative.drafters.planner import plan_row_budgets

V = 3
G = 3  # drafts: c1 is fixed, c2 reads x1, c3 reads x2


def budgets_for(instance, sequential: bool) -> np.ndarray:
    """[V, V] budget of the row for every (x1, x2), planned alone."""
    c1, c2, c3, t_tok, t_sps = instance
    surv = np.zeros((V, V, G), np.float32)
    for x1, x2 in itertools.product(range(V), range(V)):
        cs = np.array([c1, c2[x1], c3[x2]])
        surv[x1, x2] = np.cumprod(cs)
    fn = jax.jit(jax.vmap(lambda s: plan_row_budgets(s[None], jnp.ones(1, bool), jnp.ones(1, bool),
                                                     t_tok, t_sps, sequential=sequential)[0]))
    return np.asarray(fn(jnp.asarray(surv.reshape(V * V, G)))).reshape(V, V)


def _rng_dist(rng, *shape):
    w = rng.gamma(0.7, size=shape + (V,))
    return w / w.sum(-1, keepdims=True)


def first_two(p1, p2, q1, q2, budgets) -> np.ndarray:
    """Exact P(t1, t2) of one speculative step (then exact steps after it) with these budgets."""
    out = np.zeros((V, V))
    r1 = np.maximum(p1 - q1, 0)
    r1 = r1 / r1.sum() if r1.sum() > 0 else p1
    for x1, x2 in itertools.product(range(V), range(V)):
        w = q1[x1] * q2[x1, x2]
        b = budgets[x1, x2]
        if b == 0:
            out += w * p1[:, None] * p2
            continue
        a1 = min(1.0, p1[x1] / q1[x1])
        out += w * (1 - a1) * r1[:, None] * p2  # x1 rejected: residual, then the next step
        if b == 1:
            out[x1] += w * a1 * p2[x1]  # accepted, bonus from p2(. | x1)
            continue
        a2 = min(1.0, p2[x1, x2] / q2[x1, x2])
        r2 = np.maximum(p2[x1] - q2[x1], 0)
        r2 = r2 / r2.sum() if r2.sum() > 0 else p2[x1]
        out[x1, x2] += w * a1 * a2
        out[x1] += w * a1 * (1 - a2) * r2
    return out


def instances(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        p1, q1 = _rng_dist(rng), _rng_dist(rng)
        p2, q2 = _rng_dist(rng, V), _rng_dist(rng, V)
        c1 = rng.uniform(0.3, 0.9)
        c2, c3 = rng.uniform(0, 1, V), rng.uniform(0, 1, V)
        sps = np.concatenate([[1.0], np.cumprod(rng.uniform(0.55, 0.95, G))]).astype(np.float32)
        yield (p1, p2, q1, q2), (c1, c2, c3, jnp.arange(1, G + 2, dtype=jnp.int32), jnp.asarray(sps))


def test_the_audit_repro_is_exact_with_the_sequential_rule():
    p1, q1 = np.array([0.2, 0.8]), np.array([0.5, 0.5])
    t_tok, t_sps = jnp.array([1, 2, 3]), jnp.array([1.0, 0.5, 0.5])

    def p_first_zero(sequential):
        total = 0.0
        for x1 in range(2):
            surv = jnp.array([[0.6, 0.6 * (x1 == 0)]], jnp.float32)
            b = int(plan_row_budgets(surv, jnp.ones(1, bool), jnp.ones(1, bool), t_tok, t_sps,
                                     sequential=sequential)[0])
            if b == 0:
                total += q1[x1] * p1[0]
            else:
                a = min(1.0, p1[x1] / q1[x1])
                r = np.maximum(p1 - q1, 0) / np.maximum(p1 - q1, 0).sum()
                total += q1[x1] * (a * (x1 == 0) + (1 - a) * r[0])
        return total

    assert p_first_zero(True) == pytest.approx(0.2, abs=1e-9)
    assert p_first_zero(False) == pytest.approx(0.3, abs=1e-9)  # the audit's figure, the old rule


def test_planner_cut_sampled_rows_are_exact_and_the_joint_plan_is_not():
    hist = np.zeros(G + 1, int)
    worst_seq, worst_joint = 0.0, 0.0
    for (p1, p2, q1, q2), inst in instances(40):
        exact = p1[:, None] * p2
        b_seq = budgets_for(inst, True)
        hist += np.bincount(b_seq.ravel(), minlength=G + 1)
        worst_seq = max(worst_seq, np.abs(first_two(p1, p2, q1, q2, b_seq) - exact).max())
        worst_joint = max(worst_joint, np.abs(first_two(p1, p2, q1, q2, budgets_for(inst, False)) - exact).max())
    assert (hist[:G] > 0).sum() >= 2 and hist[1:].sum() > 0, f"the planner did not cut rows: budgets {hist}"
    assert worst_seq < 1e-6, f"the sequential rule is off by {worst_seq:.2e} (budgets {hist})"
    assert worst_joint > 1e-2, f"positive control: the joint rule should be biased, off by only {worst_joint:.2e}"


def test_greedy_rows_keep_the_joint_plan():
    """Deterministic drafts: the joint plan is exact for them and verifies more."""
    surv = jnp.array([[0.6, 0.6], [0.6, 0.0]], jnp.float32)
    t_tok, t_sps = jnp.array([1, 2, 3, 4, 5]), jnp.array([1.0, 0.9, 0.55, 0.5, 0.45])
    live = jnp.ones(2, bool)
    joint = plan_row_budgets(surv, live, jnp.zeros(2, bool), t_tok, t_sps)
    ref = plan_row_budgets(surv, live, jnp.zeros(2, bool), t_tok, t_sps, sequential=False)
    np.testing.assert_array_equal(np.asarray(joint), np.asarray(ref))
