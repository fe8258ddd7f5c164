"""The sort-free top-k / top-p filter equals its sorting reference, and samples exactly.

`top_k_top_p_mask` pre-selects the largest values in tiers and falls back to the full sort
(`top_k_top_p_mask_ref`, the specification) only when a row's kept set does not fit; these tests
hold the two equal on random rows (ties, every tier, the fallback) and chi-square the sampler at
batch 1 and 8 against numpy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec.speculative import sampling
from jaxspec.speculative.sampling import sample_token, top_k_top_p_mask, top_k_top_p_mask_ref

V = 300


def _rows(rng, b, n, v, ties: bool):
    x = rng.standard_normal((b, n, v)).astype(np.float32) * rng.uniform(0.3, 4.0, (b, 1, 1)).astype(np.float32)
    x[..., : 10] += rng.uniform(0, 8, (b, 1, 1)).astype(np.float32)  # some rows peaked, some flat
    if ties:  # coarse values: many exact ties, at the cutoff too
        x = np.round(x * 2) / 2
    return x


@pytest.mark.parametrize("ties", [False, True])
def test_fast_filter_equals_the_sorting_reference(ties):
    rng = np.random.default_rng(7 + ties)
    fast = jax.jit(lambda x, k, p: top_k_top_p_mask(x, k, p, tiers=(16, 64)))
    ref = jax.jit(top_k_top_p_mask_ref)
    tiers_used = set()
    for trial in range(40):
        x = _rows(rng, 6, 3, V, ties)
        k = rng.choice([0, 1, 5, 16, 17, 64, 65, 200, V, V + 5], size=6).astype(np.int32)
        p = rng.choice([1.0, 0.95, 0.9, 0.5, 0.0, -1.0], size=6).astype(np.float32)
        got, want = np.asarray(fast(x, k, p)), np.asarray(ref(x, k, p))
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}: top_k={k} top_p={p}")
        kept = (want > -np.inf).sum(-1).max()
        tiers_used.add(0 if kept <= 16 else 1 if kept <= 64 else 2)
    assert tiers_used == {0, 1, 2}, f"the rows did not reach every tier and the fallback: {tiers_used}"


def test_fast_filter_keeps_the_tied_tokens_at_the_cutoff():
    x = np.zeros((1, 1, V), np.float32)
    x[0, 0, [3, 9, 40, 41]] = [5.0, 4.0, 4.0, 4.0]
    got = np.asarray(top_k_top_p_mask(jnp.asarray(x), jnp.array([2]), jnp.array([1.0]), tiers=(16,)))
    assert set(np.flatnonzero(got[0, 0] > -np.inf)) == {3, 9, 40, 41}


def _np_filtered(logits, t, k, p):
    from tests.test_loop_distribution import _filtered  # the numpy reference the loop tests use

    return _filtered(logits, t, p, k)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("t,k,p", [(0.8, 20, 1.0), (0.8, 0, 0.9), (1.0, 40, 0.8)], ids=["top-k", "top-p", "both"])
def test_sampler_draws_the_filtered_distribution(monkeypatch, batch, t, k, p):
    monkeypatch.setattr(sampling, "SELECT_TIERS", (16, 64))
    rng = np.random.default_rng(batch * 100 + k)
    logits = (rng.standard_normal((batch, V)) * 2.0).astype(np.float32)
    fn = jax.jit(lambda seeds: sample_token(jnp.asarray(logits), jnp.full((batch,), t), jnp.full((batch,), k, jnp.int32),
                                            jnp.full((batch,), p), seeds, jnp.full((batch,), 7, jnp.int32)))
    draws = 24_000 // batch
    toks = np.stack([np.asarray(fn(jnp.arange(i * batch, (i + 1) * batch, dtype=jnp.uint32))) for i in range(draws)])
    for row in range(batch):
        w = _np_filtered(logits[row], t, k, p)
        counts = np.bincount(toks[:, row], minlength=V)
        assert counts[w == 0].sum() == 0, "drew a token outside the kept set"
        big = w * draws >= 5
        e = np.append(w[big] * draws, w[~big].sum() * draws)
        o = np.append(counts[big], counts[~big & (w > 0)].sum())
        if e[-1] < 5:
            e, o = e[:-1], o[:-1]
        if len(e) < 2:  # one kept token: every draw is it (checked above)
            continue
        pv = stats.chisquare(o, e * o.sum() / e.sum()).pvalue
        assert pv > 1e-4, f"row {row}: chi-square p={pv:.2e}"


def test_chi_square_detects_a_wrong_cutoff():
    """Positive control: sampling top-k 21 where 20 was asked fails the same test."""
    rng = np.random.default_rng(120)
    logits = (rng.standard_normal((1, V)) * 2.0).astype(np.float32)
    fn = jax.jit(lambda seeds: sample_token(jnp.asarray(logits), jnp.full((1,), 0.8), jnp.full((1,), 21, jnp.int32),
                                            jnp.ones((1,)), seeds, jnp.full((1,), 7, jnp.int32)))
    toks = np.concatenate([np.asarray(fn(jnp.arange(i * 8, i * 8 + 1, dtype=jnp.uint32))) for i in range(24_000)])
    w = _np_filtered(logits[0], 0.8, 20, 1.0)
    assert np.bincount(toks, minlength=V)[w == 0].sum() > 0
