"""The DSPARK verify-budget planner (jaxspec.speculative.drafters.planner) against a brute force in numpy,
and the SPS table it reads."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.speculative.drafters.planner import (
    SPSTable,
    SPSTableError,
    calibrate,
    fit_temperature,
    plan_budgets,
    plan_verify,
    sps_at,
    survival,
)

REL = 1e-4  # float32 planner vs float64 brute force: objectives closer than this count as tied


def brute_force(surv: np.ndarray, live: np.ndarray, tt: np.ndarray, ts: np.ndarray):
    """(objective per k [N*G + 1], k* preferring the larger k on exact ties, the top-k ranking):
    the rule spelled out with Python loops in float64."""
    b, g = surv.shape
    entries = sorted(((-float(surv[r, i]), r, i) for r in range(b) if live[r] for i in range(g)))
    n = int(live.sum())
    obj = []
    for k in range(n * g + 1):
        gain = sum(-e[0] for e in entries[:k])
        obj.append((n + gain) * float(np.interp(n + k, tt.astype(np.float64), ts.astype(np.float64))))
    obj = np.array(obj)
    k_star = max(k for k in range(len(obj)) if obj[k] == obj.max())
    return obj, k_star, [(r, i) for _, r, i in entries]


def budgets_for(k: int, ranking, b: int) -> np.ndarray:
    out = np.zeros(b, np.int32)
    for r, _ in ranking[:k]:
        out[r] += 1
    return out


def random_table(rng, max_tokens: int, monotone: bool, k: int = 5):
    tokens = np.sort(rng.choice(np.arange(1, max_tokens + 6), size=min(k, max_tokens + 5), replace=False))
    rates = rng.uniform(0.5, 100.0, size=tokens.size)
    if monotone:
        rates = np.sort(rates)[::-1]
    return tokens.astype(np.int32), rates.astype(np.float32)


def random_conf(rng, b, g, ties: bool):
    if ties:  # few distinct values: equal survival across rows and along rows (conf 1.0)
        return rng.choice(np.array([0.25, 0.5, 0.8, 1.0], np.float32), size=(b, g))
    return rng.uniform(0.02, 0.999, size=(b, g)).astype(np.float32)


plan_jit = jax.jit(plan_verify)
budgets_jit = jax.jit(plan_budgets)


@pytest.mark.parametrize("b,g", [(1, 1), (1, 7), (3, 4), (5, 7), (8, 3)])
def test_k_star_and_budgets_match_brute_force(b, g):
    rng = np.random.default_rng(100 * b + g)
    for trial in range(12):
        surv = np.asarray(survival(random_conf(rng, b, g, ties=trial % 3 == 2)))
        live = rng.random(b) < 0.75
        if trial == 0:
            live[:] = True
        # One table length per test (a new length would recompile): 1 point (flat) for the last trial.
        tt, ts = random_table(rng, b * (g + 1), monotone=trial % 2 == 0, k=1 if trial == 11 else 5)
        budgets, k_star, obj = (np.asarray(x) for x in plan_jit(surv, live, tt, ts))
        bf_obj, bf_k, ranking = brute_force(surv, live, tt, ts)
        n = int(live.sum())
        k_star = int(k_star)
        assert 0 <= k_star <= n * g
        # The planner's objective is the rule's, and -inf past N*G.
        np.testing.assert_allclose(obj[: n * g + 1], bf_obj, rtol=1e-5)
        assert np.all(np.isneginf(obj[n * g + 1:]))
        # k* is optimal; where the best is clear of the rest it is the brute force's k*.
        top = bf_obj.max()
        assert bf_obj[k_star] >= top - REL * abs(top)
        if np.sum(bf_obj >= top - REL * abs(top)) == 1:
            assert k_star == bf_k
        # Budgets: how many of each row's positions rank in the top k*.
        np.testing.assert_array_equal(budgets, budgets_for(k_star, ranking, b))
        assert budgets.sum() == k_star
        assert budgets.dtype == np.int32 and np.all((budgets >= 0) & (budgets <= g))
        assert np.all(budgets[~live] == 0)
        # The chosen positions are a prefix of each row, ties included.
        chosen = {p for p in ranking[:k_star]}
        for r in range(b):
            assert chosen >= {(r, i) for i in range(budgets[r])}


def test_jit_equals_eager():
    rng = np.random.default_rng(7)
    surv = survival(rng.uniform(0.1, 1.0, (3, 7)).astype(np.float32))
    live = jnp.array([True, False, True])
    tt, ts = random_table(rng, 24, monotone=True)
    eager = plan_budgets(surv, live, tt, ts)
    jitted = jax.jit(plan_budgets)(surv, live, jnp.asarray(tt), jnp.asarray(ts))
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))
    assert jitted.shape == (3,) and jitted.dtype == jnp.int32


def test_flat_table_verifies_everything():
    rng = np.random.default_rng(1)
    for b, g in [(1, 7), (4, 7), (8, 5)]:
        # Survival values down to ~0 included: each still adds >= 0 expected tokens at no cost.
        surv = survival(rng.uniform(0.0, 0.3, (b, g)).astype(np.float32))
        live = rng.random(b) < 0.7
        for table in (SPSTable.flat(b * (g + 1)), SPSTable.flat(1, 37.5)):
            budgets = np.asarray(budgets_jit(surv, live, *table.as_arrays()))
            np.testing.assert_array_equal(budgets, np.where(live, g, 0))


def test_zero_survival_with_flat_table_still_verifies_everything():
    budgets = budgets_jit(jnp.zeros((3, 7)), jnp.array([True, True, False]), *SPSTable.flat(64).as_arrays())
    np.testing.assert_array_equal(np.asarray(budgets), [7, 7, 0])


def test_steep_table_gives_small_budgets():
    # Rate falling like 1/t^2: each extra token costs more than any draft can earn.
    t = np.arange(1, 65, dtype=np.int32)
    steep = SPSTable(tuple(t.tolist()), tuple((1000.0 / t**2).tolist()))
    surv = survival(jnp.full((8, 7), 0.9))
    budgets = np.asarray(budgets_jit(surv, jnp.ones(8, bool), *steep.as_arrays()))
    np.testing.assert_array_equal(budgets, 0)
    # A milder cost (rate 1 / (8 + t)) verifies some drafts, more for the confident rows.
    mild = SPSTable(tuple(t.tolist()), tuple((1.0 / (8.0 + t)).tolist()))
    conf = jnp.concatenate([jnp.full((4, 7), 0.95), jnp.full((4, 7), 0.3)])
    budgets = np.asarray(budgets_jit(survival(conf), jnp.ones(8, bool), *mild.as_arrays()))
    assert 0 < budgets.sum() < 8 * 7
    assert budgets[:4].min() >= budgets[4:].max()


def test_no_live_rows_gives_zero():
    budgets, k, _ = plan_jit(jnp.full((4, 7), 0.9), jnp.zeros(4, bool), *SPSTable.flat(32).as_arrays())
    assert int(k) == 0 and not np.asarray(budgets).any()


def test_non_monotone_rows_are_clamped_to_prefixes():
    # Not a survival matrix (grows along the row): the planner takes the running minimum.
    surv = jnp.array([[0.2, 0.9, 0.9], [0.8, 0.7, 0.6]])
    tt, ts = jnp.array([1, 2, 3, 8]), jnp.array([10.0, 9.0, 8.0, 1.0])
    budgets, k, _ = plan_jit(surv, jnp.ones(2, bool), tt, ts)
    want = budgets_jit(jax.lax.cummin(surv, axis=1), jnp.ones(2, bool), tt, ts)
    np.testing.assert_array_equal(np.asarray(budgets), np.asarray(want))
    assert int(np.asarray(budgets).sum()) == int(k)


def test_survival_is_a_prefix_product():
    conf = np.random.default_rng(3).uniform(0, 1, (5, 7)).astype(np.float32)
    s = np.asarray(survival(conf))
    assert s.shape == (5, 7) and s.dtype == np.float32
    np.testing.assert_allclose(s, np.cumprod(conf, axis=1), rtol=1e-6)
    np.testing.assert_allclose(s[:, 0], conf[:, 0])
    assert np.all(np.diff(s, axis=1) <= 0)


def test_sps_at_interpolates_and_clamps():
    tt, ts = jnp.array([2, 4, 8], jnp.int32), jnp.array([10.0, 6.0, 2.0], jnp.float32)
    got = np.asarray(sps_at(jnp.array([0, 1, 2, 3, 4, 6, 8, 100]), tt, ts))
    np.testing.assert_allclose(got, [10, 10, 10, 8, 6, 4, 2, 2])
    assert got.dtype == np.float32
    assert np.asarray(sps_at(jnp.array([[1, 5]]), jnp.array([3]), jnp.array([7.0]))).tolist() == [[7.0, 7.0]]


# ---- SPSTable ---------------------------------------------------------------------------------------

def test_table_round_trip(tmp_path):
    t = SPSTable((1, 2, 4, 8), (50.0, 48.5, 40.0, 21.25), device="cpu", date="2025-01-01", model="m",
                 source="test", context=256, measurements=((1, 1, 50.0), (2, 4, 21.25)))
    path = t.save(tmp_path / "sub" / "t.json")
    back = SPSTable.load(path)
    assert back == t
    tokens, sps = back.as_arrays()
    assert tokens.dtype == jnp.int32 and sps.dtype == jnp.float32
    assert tokens.tolist() == [1, 2, 4, 8] and np.allclose(sps, t.steps_per_s)
    # Only the two lists are required.
    (tmp_path / "min.json").write_text(json.dumps({"tokens": [1, 9], "steps_per_s": [3, 2]}))
    assert SPSTable.load(tmp_path / "min.json").tokens == (1, 9)


def test_flat_table():
    t = SPSTable.flat(64)
    assert t.tokens == (1, 64) and t.steps_per_s == (1.0, 1.0)
    assert SPSTable.flat(1).tokens == (1,)
    with pytest.raises(SPSTableError, match="max_tokens >= 1"):
        SPSTable.flat(0)


@pytest.mark.parametrize("tokens,rates,match", [
    ((1, 4, 2), (3.0, 2.0, 1.0), "strictly ascending, got 4 then 2"),
    ((1, 2, 2), (3.0, 2.0, 1.0), "strictly ascending"),
    ((1, 2), (3.0, 0.0), "positive and finite, got 0.0 at 2 tokens"),
    ((1, 2), (-1.0, 2.0), "positive and finite"),
    ((1, 2), (float("nan"), 2.0), "positive and finite"),
    ((1, 2, 3), (3.0, 2.0), "length mismatch, 3 token counts but 2"),
    ((), (), "empty"),
    ((0, 2), (1.0, 1.0), ">= 1"),
    ((1.5, 2), (1.0, 1.0), "whole numbers"),
])
def test_table_validation(tokens, rates, match):
    with pytest.raises(SPSTableError, match=match):
        SPSTable(tokens, rates)


def test_table_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json: no such file"):
        SPSTable.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SPSTableError, match="not valid JSON"):
        SPSTable.load(bad)
    bad.write_text(json.dumps({"tokens": [1, 2]}))
    with pytest.raises(SPSTableError, match="missing key.*steps_per_s"):
        SPSTable.load(bad)
    bad.write_text(json.dumps({"tokens": [2, 1], "steps_per_s": [1, 1]}))
    with pytest.raises(SPSTableError, match=r"bad\.json: tokens must be strictly ascending"):
        SPSTable.load(bad)


# ---- calibration ----------------------------------------------------------------------------------------

def test_calibrate_and_fit_temperature():
    rng = np.random.default_rng(5)
    true_t = np.array([0.5, 1.0, 2.0, 4.0], np.float32)
    logits = rng.normal(0, 3, (6000, 4)).astype(np.float32)
    correct = rng.random((6000, 4)) < 1 / (1 + np.exp(-logits / true_t))
    mask = np.ones_like(correct)
    mask[:, 3] = False  # never observed: T = 1
    fit = np.asarray(fit_temperature(logits, correct, mask))
    np.testing.assert_allclose(fit[:3], true_t[:3], rtol=0.15)
    assert fit[3] == 1.0
    c = np.asarray(calibrate(logits[:3], fit))
    np.testing.assert_allclose(c, 1 / (1 + np.exp(-logits[:3] / fit)), rtol=1e-5)
    assert np.all((c > 0) & (c < 1))
