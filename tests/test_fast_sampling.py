"""The sort-free top-k / top-p filter equals its sorting reference, and samples exactly.

`top_k_top_p_mask` pre-selects the largest values in tiers and falls back to a bisection over the
float order only when a row's kept set does not fit; these tests hold it equal to the full sort
(`top_k_top_p_mask_ref`, the specification) on random rows (ties, every tier, the bisection) and
chi-square the sampler at batch 1 and 8 against numpy.

`race_filtered` (the sampler of plain decoding, the coupled verify and coupled drafts) races only
the pre-selected candidates, with their noise hashed entry by entry (`exp_noise_at`): held equal,
token for token, to the dense race over softmax / noise (the specification), with the fast path
shown to run (a poisoned dense path changes nothing for rows that fit, and does for rows that don't).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec.speculative import sampling
from jaxspec.speculative.sampling import (exp_noise, exp_noise_at, race_filtered, race_key, sample_token,
                                          target_probs_from_logits, top_k_top_p_mask, top_k_top_p_mask_ref)

V = 300


def _rows(rng, b, n, v, ties: bool):
    x = rng.standard_normal((b, n, v)).astype(np.float32) * rng.uniform(0.3, 4.0, (b, 1, 1)).astype(np.float32)
    x[..., : 10] += rng.uniform(0, 8, (b, 1, 1)).astype(np.float32)  # some rows peaked, some flat
    if ties:  # coarse values: many exact ties, at the cutoff too
        x = np.round(x * 2) / 2
    return x


@pytest.mark.parametrize("tiers", [(16, 64), ()], ids=["tiers", "bisection-only"])
@pytest.mark.parametrize("ties", [False, True])
def test_fast_filter_equals_the_sorting_reference(ties, tiers):
    """Every row through the tiers and the bisection past them; and every row through the
    bisection alone (`_cutoff_bisect`), with masked (-inf) entries too."""
    rng = np.random.default_rng(7 + ties)
    fast = jax.jit(lambda x, k, p: top_k_top_p_mask(x, k, p, tiers=tiers))
    ref = jax.jit(top_k_top_p_mask_ref)
    tiers_used = set()
    for trial in range(40):
        x = _rows(rng, 6, 3, V, ties)
        if not tiers:
            x[rng.random(x.shape) < 0.1] = -np.inf
        k = rng.choice([0, 1, 5, 16, 17, 64, 65, 200, V, V + 5], size=6).astype(np.int32)
        p = rng.choice([1.0, 0.95, 0.9, 0.5, 0.0, -1.0], size=6).astype(np.float32)
        got, want = np.asarray(fast(x, k, p)), np.asarray(ref(x, k, p))
        np.testing.assert_array_equal(got, want, err_msg=f"trial {trial}: top_k={k} top_p={p}")
        kept = (want > -np.inf).sum(-1).max()
        tiers_used.add(0 if kept <= 16 else 1 if kept <= 64 else 2)
    assert tiers_used == {0, 1, 2}, f"the rows did not reach every tier and the fallback: {tiers_used}"


def test_the_bisection_finds_the_cutoff_of_flat_rows_without_a_sort():
    """Rows of 49,152 as flat as a verify position after a rejected draft (a nucleus of thousands):
    the bisection's kept set is the sort's."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((2, 4, 49_152)) * 1.5).astype(np.float32)
    k, p = np.array([0, 3000], np.int32), np.array([0.9, 0.95], np.float32)
    got = np.asarray(jax.jit(lambda x: top_k_top_p_mask(x, k, p, tiers=()))(x))
    want = np.asarray(top_k_top_p_mask_ref(jnp.asarray(x), k, p))
    kept = (want > -np.inf).sum(-1)
    assert kept.min() > 1024, kept  # past every tier
    np.testing.assert_array_equal(got, want)


def test_fast_filter_keeps_the_tied_tokens_at_the_cutoff():
    x = np.zeros((1, 1, V), np.float32)
    x[0, 0, [3, 9, 40, 41]] = [5.0, 4.0, 4.0, 4.0]
    got = np.asarray(top_k_top_p_mask(jnp.asarray(x), jnp.array([2]), jnp.array([1.0]), tiers=(16,)))
    assert set(np.flatnonzero(got[0, 0] > -np.inf)) == {3, 9, 40, 41}


def _np_filtered(logits, t, k, p):
    from tests.test_loop_distribution import _filtered  # the numpy reference the loop tests use

    return _filtered(logits, t, p, k)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("t,k,p,peak", [(0.8, 20, 1.0, 0), (0.8, 0, 0.9, 0), (1.0, 40, 0.8, 0), (1.0, 0, 1.0, 30)],
                         ids=["top-k", "top-p", "both", "T-only-peaked"])
def test_sampler_draws_the_filtered_distribution(monkeypatch, batch, t, k, p, peak):
    monkeypatch.setattr(sampling, "SELECT_TIERS", (16, 64))
    rng = np.random.default_rng(batch * 100 + k)
    logits = (rng.standard_normal((batch, V)) * 2.0).astype(np.float32)
    # peak: ten tokens far above the rest, so a temperature-only row races its candidates alone
    logits[:, :10] += peak
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


def _keys(b, n, salt):
    return jax.vmap(jax.vmap(race_key, in_axes=(None, 0)))(jnp.arange(b, dtype=jnp.uint32) + 1000 * salt,
                                                          jnp.arange(b * n, dtype=jnp.int32).reshape(b, n) + salt)


def test_noise_at_equals_the_dense_draw():
    keys = _keys(3, 2, 5)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 49_152, (3, 2, 40)), jnp.int32)
    dense = jax.vmap(jax.vmap(lambda k: exp_noise(k, (49_152,))))(keys)
    np.testing.assert_array_equal(np.asarray(exp_noise_at(keys, ids)),
                                  np.asarray(jnp.take_along_axis(dense, ids, axis=-1)))


def _race_case(rng, b=4, n=3, v=V):
    logits = (rng.standard_normal((b, n, v)) * rng.uniform(0.5, 4.0, (b, 1, 1))).astype(np.float32)
    logits[:, :, :8] += rng.choice([0.0, 6.0, 40.0], (b, 1, 1)).astype(np.float32)  # flat, peaked, decided rows
    t = rng.choice([0.0, 0.7, 1.0, 1.5], b).astype(np.float32)
    k = rng.choice([0, 1, 5, 16, 40, 100], b).astype(np.int32)
    p = rng.choice([1.0, 1.0, 0.9, 0.5], b).astype(np.float32)
    return logits, t, k, p


def _dense_race(logits, t, k, p, keys, token_ids=None, noise_size=None):
    """The specification: softmax of the filtered logits over the dense noise, argmax of the ratio."""
    probs = target_probs_from_logits(logits, t, k, p)
    size = logits.shape[-1] if token_ids is None else noise_size
    noise = jax.vmap(jax.vmap(lambda key: exp_noise(key, (size,))))(keys)
    if token_ids is not None:
        noise = noise[..., token_ids]
    return np.asarray(sampling.argmax_last(probs / noise))


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
def test_race_filtered_equals_the_dense_race(reduced):
    rng = np.random.default_rng(11 + reduced)
    token_ids = jnp.asarray(rng.permutation(2 * V)[:V], jnp.int32) if reduced else None
    race = jax.jit(lambda *a: race_filtered(*a, token_ids=token_ids, tiers=(16, 64)))
    for trial in range(30):
        logits, t, k, p = _race_case(rng)
        keys = _keys(4, 3, trial)
        want = _dense_race(logits, t, k, p, keys, token_ids, 2 * V)
        np.testing.assert_array_equal(np.asarray(race(logits, t, k, p, keys)), want,
                                      err_msg=f"trial {trial}: T={t} top_k={k} top_p={p}")


def test_race_filtered_races_only_the_candidates_where_they_decide(monkeypatch):
    """With the dense race poisoned (noise 1: the race becomes an argmax), rows whose kept set
    fits the candidates still draw the reference token, so the fast path ran; a flat
    temperature-only row cannot fit, and there the poison shows (the positive control)."""
    poisoned = lambda keys, vocab, token_ids: jnp.ones((*keys.shape, vocab), jnp.float32)  # noqa: E731
    monkeypatch.setattr(sampling, "_dense_noise", poisoned)
    rng = np.random.default_rng(5)
    fits = jax.jit(lambda *a: race_filtered(*a, tiers=(16, 64)))
    differs = 0
    for trial in range(20):
        logits = (rng.standard_normal((2, 1, V)) * 2.0).astype(np.float32)
        keys = _keys(2, 1, trial)
        t = np.full(2, 1.0, np.float32)
        filtered = (t, np.array([5, 0], np.int32), np.array([1.0, 0.8], np.float32))  # top-k 5; top-p 0.8
        peaked = logits.copy()
        peaked[..., :20] += 5.0  # the top-p row's nucleus then lies inside 64 candidates
        np.testing.assert_array_equal(np.asarray(fits(peaked, *filtered, keys)), _dense_race(peaked, *filtered, keys))
        flat = (t, np.zeros(2, np.int32), np.ones(2, np.float32))  # temperature only, flat: the dense race
        got = np.asarray(fits(logits, *flat, keys))
        np.testing.assert_array_equal(got, logits.argmax(-1))  # the poisoned race is an argmax
        differs += int((got != _dense_race(logits, *flat, keys)).any())
    assert differs > 10


def test_the_lazy_coupled_walk_equals_racing_every_node(monkeypatch):
    """`verify_coupled` races only the positions its walk reads; it equals the specification, the
    greedy walk over `coupled_predict` (every node raced in full), on chains and a tree whose
    drafts follow the target's races part of the way, over flat and peaked rows, greedy, top-k,
    top-p and temperature-only rows. The open nodes are both on the walk (raced in full) and off
    it (never raced) in these trials."""
    import types

    from jaxspec.speculative.sampling import UNDECIDED, coupled_predict, race_first_tier
    from jaxspec.speculative.verify import verify_coupled, verify_greedy

    monkeypatch.setattr(sampling, "SELECT_TIERS", (16, 64))
    rng = np.random.default_rng(5)
    b, n = 4, 6
    chain = (np.array([1, 2, 3, 4, 5, -1]), np.full(n, -1), np.arange(n))
    tree = (np.array([1, 3, -1, 5, -1, -1]), np.array([-1, 2, -1, 4, -1, -1]), np.array([0, 1, 1, 2, 2, 3]))
    sp = types.SimpleNamespace(temperature=jnp.array([0.0, 0.8, 1.0, 0.7]), top_k=jnp.array([0, 0, 0, 12], jnp.int32),
                               top_p=jnp.array([1.0, 0.9, 1.0, 1.0]), seed=jnp.arange(b, dtype=jnp.uint32) + 3)
    max_depth = n - 1

    @jax.jit
    def both(tokens, nt, ns, logits, depth, hist):
        spec = verify_greedy(tokens, nt, ns, coupled_predict(logits, depth, sp, hist, max_depth), max_depth=max_depth)
        return spec, verify_coupled(tokens, nt, ns, logits, depth, sp, hist, max_depth=max_depth)

    predict = jax.jit(lambda logits, depth, hist: coupled_predict(logits, depth, sp, hist, max_depth))

    @jax.jit
    def first_tier(logits, depth, hist):
        keys = jax.vmap(jax.vmap(race_key, in_axes=(None, 0)))(sp.seed, hist[:, None] + jnp.clip(depth, 0, max_depth))
        return race_first_tier(logits, sp.temperature, sp.top_k, sp.top_p, keys)

    on_walk = off_walk = 0
    for trial in range(30):
        nt, ns, depth = (jnp.asarray(np.broadcast_to(a, (b, n)), jnp.int32) for a in (chain if trial % 2 else tree))
        scale = rng.choice([0.3, 1.0, 4.0], size=(b, n, 1))  # flat rows (open at tier 16) beside peaked ones
        logits = jnp.asarray(rng.standard_normal((b, n, V)) * scale, jnp.float32)
        hist = jnp.asarray(rng.integers(10, 50, b), jnp.int32)
        pred = np.asarray(predict(logits, depth, hist))
        # Drafts: each node's token is its parent's race winner (accepted) with probability 0.7.
        parent = np.zeros((b, n), int)
        nt0, ns0 = np.asarray(nt)[0], np.asarray(ns)[0]
        for i in range(n):
            c = nt0[i]
            while c >= 0:
                parent[:, c] = i
                c = ns0[c]
        tokens = np.where(rng.random((b, n)) < 0.7, np.take_along_axis(pred, parent, 1), rng.integers(0, V, (b, n)))
        tokens[:, 0] = 1
        spec, got = both(jnp.asarray(tokens, jnp.int32), nt, ns, logits, depth, hist)
        for a, w in zip(got, spec):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(w), err_msg=f"trial {trial}")
        first = np.asarray(first_tier(logits, depth, hist))
        walked = np.zeros((b, n), bool)
        acc, num = np.asarray(spec.accept_index), np.asarray(spec.num_accepted)
        for r in range(b):
            walked[r, acc[r, : num[r] + 1]] = True
        on_walk += int((walked & (first == UNDECIDED)).sum())
        off_walk += int((~walked & (first == UNDECIDED)).sum())
    assert on_walk > 0 and off_walk > 0, (on_walk, off_walk)
