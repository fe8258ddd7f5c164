"""Losslessness of the sampling verifiers, by chi-square tests.

Toy world: V = 6 tokens, a second-order target P[prev2, prev1] -> next token
and a first-order draft Q[prev1]. Each run decodes with speculative steps
(draft a tree from the current root, verify, commit accepted drafts + bonus,
the bonus becomes the next root) until at least K = 3 tokens are out; the
joint distribution of the first K emitted tokens (216 cells) must equal the
target's exact one. RUNS = 100_000 runs per configuration, batched through the
jnp references (jitted). Cells with expected count < 5 are pooled. The verify
noise comes from `make_verify_noise(seed, position)`, the engine's own keying
(one seed per run, the position advancing with the tokens emitted), except in
one baseline case with unkeyed noise (see NOISE_MODES).

Significance: every "must match" test rejects at p < ALPHA = 1e-3 (per test,
no multiplicity correction: 11 such tests, so a false alarm has
probability ~1e-2 per full run; seeds are fixed, so results are reproducible).
Every "must fail" test (deliberately broken samplers, thresholds < 1, noise
keyings that repeat) requires p < ALPHA as well and in practice gets p ~ 0.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from scipy import stats

from jaxspec.speculative.sampling import make_verify_noise, sample_token, target_probs_from_logits
from jaxspec.speculative.verify import (
    emitted_tokens,
    verify_rejection,
    verify_rejection_ref,
    verify_target_only_ref,
)

ALPHA = 1e-3
RUNS = 100_000
V = 6
K = 3
ROOT_CONTEXT = (0, 1)  # (token before the root, root token)

_rng = np.random.default_rng(1234)
P = _rng.dirichlet(np.ones(V), (V, V)).astype(np.float32)  # P[prev2, prev1] -> next
# Draft: related to the target (so drafts get accepted) but clearly different.
Q = (0.5 * P.mean(axis=0) + 0.5 * _rng.dirichlet(np.ones(V), V)).astype(np.float32)

# RANKED[prev1, r]: the r-th most likely draft token (deterministic drafter).
# A table, not an in-graph argsort: XLA would constant-fold a sort of 1e5 rows.
RANKED = np.argsort(-Q, axis=1, kind="stable").astype(np.int32)

# Topologies as parent lists (parents precede children; sibling order = index).
CHAIN3 = (-1, 0, 1, 2)
TREE22 = (-1, 0, 0, 1, 1, 2, 2)  # two children per node, depth 2
ASYM = (-1, 0, 0, 1, 1, 3)  # EAGLE-like: the first branch goes deeper


def retrieve_tables(parents):
    """(next_token, next_sibling) [N] int32 for one topology, no padding."""
    n = len(parents)
    nt, ns, last = -np.ones(n, np.int32), -np.ones(n, np.int32), {}
    for i in range(1, n):
        p = parents[i]
        if p in last:
            ns[last[p]] = i
        else:
            nt[p] = i
        last[p] = i
    return nt, ns


def depth_of(parents):
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return max(d)


def exact_joint() -> np.ndarray:
    """[V]*K exact target probability of the first K tokens."""
    out = np.zeros((V,) * K)
    for xs in itertools.product(range(V), repeat=K):
        ctx, pr = list(ROOT_CONTEXT), 1.0
        for x in xs:
            pr *= P[ctx[-2], ctx[-1], x]
            ctx.append(x)
        out[xs] = pr
    return out


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    counts, probs = counts.ravel().astype(np.float64), probs.ravel().astype(np.float64)
    assert counts[probs == 0].sum() == 0, "a zero-probability outcome was sampled"
    expected = probs / probs.sum() * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp).pvalue)


# --------------------------------------------------------------------------
# Drafting (per run) and a deliberately broken verifier
# --------------------------------------------------------------------------


def draft_tree(key, root, parents, mode):
    """tokens [N] int32 and draft_probs [N, V] (by child) for one run.

    mode: "iid" (children sampled independently from Q[parent]), "wor"
    (siblings sampled without replacement), "onehot" (deterministic: the
    r-th child is the r-th most likely token of Q[parent])."""
    n = len(parents)
    toks, dps, sibs = [root], [jnp.zeros(V)], {}
    for i in range(1, n):
        pa = parents[i]
        q = jnp.asarray(Q)[toks[pa]]
        prior = sibs.setdefault(pa, [])
        if mode == "onehot":
            t = jnp.asarray(RANKED)[toks[pa], len(prior)]
            dist = jax.nn.one_hot(t, V)
        else:
            dist = q
            if mode == "wor":
                for s in prior:
                    dist = jnp.where(jnp.arange(V) == s, 0.0, dist)
                dist = dist / dist.sum()
            t = jax.random.categorical(jax.random.fold_in(key, i), jnp.log(dist)).astype(jnp.int32)
        prior.append(t)
        toks.append(t)
        dps.append(dist)
    return jnp.stack(toks), jnp.stack(dps).astype(jnp.float32)


def _broken_one(tokens, nt, ns, p, q, u, e, max_depth, flaw):
    # Same walk as the reference with one deliberate flaw:
    #   "accept_p":  accept with probability p'(t), not min(1, p'(t)/q(t));
    #   "no_renorm": keep the residual max(p' - q, 0) unnormalised;
    #   "no_update": keep the residual p' unchanged after a rejection.
    def cond(s):
        return (s[3] >= 0) & (s[1] < max_depth)

    def body(s):
        acc, n, cur, j, res = s
        t = tokens[j]
        ratio = res[t] if flaw == "accept_p" else res[t] / q[j, t]
        accept = u[j] < ratio
        new = jnp.maximum(res - q[j], 0.0)
        rejected = {"no_renorm": new, "no_update": res}.get(flaw, new / jnp.sum(new))
        acc = acc.at[jnp.where(accept, n + 1, max_depth + 1)].set(j, mode="drop")
        return (acc, n + accept, jnp.where(accept, j, cur),
                jnp.where(accept, nt[j], ns[j]), jnp.where(accept, p[j], rejected))

    acc0 = jnp.full((max_depth + 1,), -1, jnp.int32).at[0].set(0)
    acc, n, _, _, res = lax.while_loop(cond, body, (acc0, 0, 0, nt[0], p[0]))
    return acc, n, jnp.argmax(res / e).astype(jnp.int32)


def broken_verifier(flaw):
    def verify(tokens, nt, ns, p, q, u, e, *, max_depth):
        fn = functools.partial(_broken_one, max_depth=max_depth, flaw=flaw)
        return jax.vmap(fn)(tokens, nt, ns, p, q, u, e)
    return verify


def _verifier(name):
    if name == "rejection":
        return verify_rejection_ref
    if name == "rejection_onehot":
        return lambda t, a, s, p, q, u, e, **kw: verify_rejection_ref(t, a, s, p, None, u, e, **kw)
    if name.startswith("target_only"):
        th = 1.0 if name == "target_only" else 0.5
        return lambda t, a, s, p, q, u, e, **kw: verify_target_only_ref(t, a, s, p, u, e, th, th,
                                                                       **kw)
    return broken_verifier(name)


# --------------------------------------------------------------------------
# Simulation
# --------------------------------------------------------------------------


# How a simulated run gets its verify noise (uniforms [N], bonus Exp(1) [V]) each step:
#   "fresh":     independent jax.random draws, no request keying at all (the algorithm alone);
#   "seeds":     make_verify_noise(seed, position) as the engine calls it: run r is a request
#                with seed SEED0 + r (consecutive, as the server's n choices get) and a prompt
#                of PROMPT_LEN[r] tokens; position = the index of the first token the step emits;
#   "positions": one seed for every run, each run a disjoint window of positions (one long
#                seeded request cut into pieces);
# and two deliberately broken keyings, which the chi-square must catch:
#   "stuck":     per-run seeds but the position never advances (noise reused every step);
#   "shared":    one (seed, position) per step for every run (all runs share their noise).
NOISE_MODES = ("fresh", "seeds", "positions", "stuck", "shared")
SEED0 = 1000
PROMPT_LEN = 2 + (np.arange(RUNS) * 7919) % 4093  # many distinct start positions
WINDOW = 64  # >= the tokens one run emits (K steps of at most depth + 1): windows never overlap


def step_noise(noise, keys, count, n):
    """uniforms [RUNS, n], bonus noise [RUNS, V] for one step; count [RUNS] = tokens emitted so far."""
    if noise == "fresh":
        u = jax.vmap(lambda k: jax.random.uniform(k, (n,)))(keys[:, 1])
        e = jax.vmap(lambda k: jax.random.exponential(k, (V,)))(keys[:, 2])
        return u, e
    run = jnp.arange(RUNS, dtype=jnp.int32)
    if noise == "seeds":
        seeds, positions = (SEED0 + run).astype(jnp.uint32), jnp.asarray(PROMPT_LEN, jnp.int32) + count
    elif noise == "positions":
        seeds, positions = jnp.full((RUNS,), SEED0, jnp.uint32), 2 + WINDOW * run + count
    elif noise == "stuck":
        seeds, positions = (SEED0 + run).astype(jnp.uint32), jnp.asarray(PROMPT_LEN, jnp.int32)
    elif noise == "shared":
        seeds, positions = jnp.full((RUNS,), SEED0, jnp.uint32), 2 + jnp.max(count) + 0 * count
    else:
        raise ValueError(noise)
    u, e = make_verify_noise(seeds, positions, n, V)
    assert u.shape == (RUNS, n) and e.shape == (RUNS, V)
    return u, e


@functools.partial(jax.jit, static_argnames=("parents", "mode", "verifier", "noise"))
def simulate(key, parents, mode, verifier, noise="fresh"):
    """[RUNS, K] first K tokens emitted by speculative decoding, and the mean
    number of accepted drafts per step (so tests can check drafts do get in)."""
    n, max_depth = len(parents), depth_of(parents)
    nt, ns = (jnp.broadcast_to(jnp.asarray(x), (RUNS, n)) for x in retrieve_tables(parents))
    parent_idx = jnp.asarray([0] + list(parents[1:]))
    verify = _verifier(verifier)
    run_keys = jax.random.split(key, RUNS)
    prev2 = jnp.full((RUNS,), ROOT_CONTEXT[0], jnp.int32)
    prev1 = jnp.full((RUNS,), ROOT_CONTEXT[1], jnp.int32)
    width = K * (max_depth + 1)  # never overflows, so writes are never clamped
    out = jnp.full((RUNS, width), -1, jnp.int32)
    count = jnp.zeros((RUNS,), jnp.int32)
    accepted = jnp.float32(0.0)
    for step in range(K):  # >= 1 token per step, so K steps suffice
        keys = jax.vmap(lambda k: jax.random.split(jax.random.fold_in(k, step), 3))(run_keys)
        toks, dps = jax.vmap(lambda k, r: draft_tree(k, r, parents, mode))(keys[:, 0], prev1)
        # 1. Target at node i conditions on (token of parent(i), token i); the
        #    root on the committed context.
        ctx2 = jnp.where(jnp.arange(n) == 0, prev2[:, None], toks[:, parent_idx])
        tp = jnp.asarray(P)[ctx2, toks]
        u, e = step_noise(noise, keys, count, n)
        acc, num, bonus = verify(toks, nt, ns, tp, dps, u, e, max_depth=max_depth)
        em = emitted_tokens(toks, (acc, num, bonus))
        out = jax.vmap(lambda o, c, x: lax.dynamic_update_slice(o, x, (c,)))(out, count, em)
        # 2. The last two committed tokens are the next context.
        last_draft = jnp.take_along_axis(em, jnp.maximum(num - 1, 0)[:, None], 1)[:, 0]
        prev2 = jnp.where(num > 0, last_draft, prev1)
        prev1 = bonus
        count = count + num + 1
        accepted = accepted + jnp.mean(num.astype(jnp.float32)) / K
    return out[:, :K], accepted


def joint_pvalue(parents, mode, verifier, seed=0, noise="fresh") -> tuple[float, float]:
    """(chi-square p-value of the first-K joint, mean accepted drafts per step)."""
    toks, accepted = simulate(jax.random.key(seed), parents, mode, verifier, noise)
    toks = np.asarray(toks)
    assert (toks >= 0).all()
    counts = np.zeros((V,) * K)
    np.add.at(counts, tuple(toks.T), 1)
    return chi_square_pvalue(counts, exact_joint()), float(accepted)


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------


# Noise "seeds" is the engine's keying: make_verify_noise over 100k consecutive seeds and
# thousands of start positions. "fresh" (no keying) isolates the algorithm, "positions"
# is one seed over 100k disjoint position windows.
@pytest.mark.parametrize("parents,mode,verifier,noise", [
    (CHAIN3, "iid", "rejection", "seeds"),  # Leviathan et al.
    (TREE22, "iid", "rejection", "seeds"),  # i.i.d. siblings (duplicates possible)
    (ASYM, "wor", "rejection", "seeds"),  # siblings without replacement
    (TREE22, "onehot", "rejection_onehot", "seeds"),  # deterministic drafter, draft_probs=None
    (CHAIN3, "iid", "rejection_onehot", "seeds"),  # None with sampled drafts: still exact
    (TREE22, "iid", "target_only", "seeds"),  # SGLang target-only, thresholds 1.0
    (CHAIN3, "iid", "rejection", "fresh"),
    (TREE22, "iid", "rejection", "positions"),
], ids=["chain-iid", "tree-iid", "tree-wor", "tree-onehot", "chain-iid-none", "target-only",
        "chain-iid-fresh-noise", "tree-iid-one-seed"])
def test_emitted_tokens_follow_target(parents, mode, verifier, noise):
    pvalue, accepted = joint_pvalue(parents, mode, verifier, noise=noise)
    assert pvalue > ALPHA, pvalue
    assert accepted > 0.15, accepted  # drafts really are accepted, not just bonuses


@pytest.mark.parametrize("parents,mode,verifier", [
    (CHAIN3, "iid", "accept_p"),  # accept w.p. p instead of min(1, p/q)
    (TREE22, "iid", "no_renorm"),  # residual not renormalised between siblings
    (TREE22, "iid", "target_only_0.5"),  # thresholds < 1: documented lossy
], ids=["accept-p", "no-renorm", "threshold-0.5"])
def test_broken_samplers_fail(parents, mode, verifier):
    pvalue, _ = joint_pvalue(parents, mode, verifier, noise="seeds")
    assert pvalue < ALPHA, pvalue


@pytest.mark.parametrize("parents,mode,verifier,noise", [
    (CHAIN3, "iid", "rejection", "stuck"),  # the position does not advance between steps
    (TREE22, "onehot", "rejection_onehot", "shared"),  # every run draws the same noise
], ids=["position-stuck", "noise-shared-across-runs"])
def test_broken_noise_keying_fails(parents, mode, verifier, noise):
    """Positive controls for the keyed tests above: the same exact verifier, fed
    make_verify_noise at (seed, position) pairs that repeat, is caught."""
    pvalue, _ = joint_pvalue(parents, mode, verifier, noise=noise)
    assert pvalue < ALPHA, pvalue


@pytest.mark.parametrize("one_hot", [False, True])
def test_recovered_token_is_normalised_residual(one_hot):
    """Root with one child t ~ q (or fixed t for one-hot): conditional on
    rejection, the bonus is distributed as normalize(max(p - q, 0))."""
    vocab = 8
    rng = np.random.default_rng(5)
    p = rng.dirichlet(np.ones(vocab)).astype(np.float32)
    q = rng.dirichlet(np.ones(vocab)).astype(np.float32)
    k_t, k_u = jax.random.split(jax.random.key(1))
    if one_hot:
        t0 = int(np.argmax(p))  # often rejected, and leaves a nontrivial residual
        child = jnp.full((RUNS,), t0, jnp.int32)
        q_eff = np.eye(vocab, dtype=np.float32)[t0]
    else:
        child = jax.random.categorical(k_t, jnp.log(q), shape=(RUNS,)).astype(jnp.int32)
        q_eff = q
    tokens = jnp.stack([jnp.zeros_like(child), child], axis=1)
    nt = jnp.broadcast_to(jnp.int32([1, -1]), (RUNS, 2))
    ns = jnp.full((RUNS, 2), -1, jnp.int32)
    probs = jnp.broadcast_to(jnp.asarray(p), (RUNS, 2, vocab))
    u, e = make_verify_noise(jnp.arange(RUNS), jnp.zeros(RUNS, jnp.int32), 2, vocab)
    res = verify_rejection_ref(tokens, nt, ns, probs,
                               None if one_hot else jnp.broadcast_to(jnp.asarray(q), probs.shape),
                               u, e, max_depth=1)
    rejected = np.asarray(res.num_accepted) == 0
    counts = np.bincount(np.asarray(res.bonus_token)[rejected], minlength=vocab)
    residual = np.maximum(p - q_eff, 0.0)
    assert rejected.sum() > 10_000
    assert chi_square_pvalue(counts, residual) > ALPHA
    # And the acceptance rate is sum(min(p, q)) (binomial, 5 sigma).
    rate = 1 - rejected.mean()
    want = np.minimum(p, q_eff).sum()
    assert abs(rate - want) < 5 * np.sqrt(want * (1 - want) / RUNS)


def test_sample_token_follows_filtered_target():
    """Plain decoding: tokens over many positions of one seeded request follow
    the temperature/top-k/top-p distribution (chi-square), zero-prob tokens never."""
    vocab = 10
    logits = np.random.default_rng(6).normal(size=(1, vocab)).astype(np.float32) * 1.5
    params = (np.float32([0.7]), np.int32([6]), np.float32([0.9]))
    want = np.asarray(target_probs_from_logits(logits[:, None], *params))[0, 0]
    assert (want == 0).sum() >= 4  # the filters do remove tokens
    rep = lambda x: np.repeat(x, RUNS, axis=0)  # noqa: E731
    toks = sample_token(rep(logits), *(rep(x) for x in params),
                        jnp.full((RUNS,), 77, jnp.uint32), jnp.arange(RUNS, dtype=jnp.int32))
    counts = np.bincount(np.asarray(toks), minlength=vocab)
    assert chi_square_pvalue(counts, want) > ALPHA


def test_seeded_request_repeats_regardless_of_batch():
    """(seed, position) fixes a request's noise and hence its verify result,
    whatever else is in the batch and where the request sits in it."""
    n, vocab, depth = 7, 6, 2
    nt, ns = retrieve_tables(TREE22)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, vocab, (4, n)).astype(np.int32)
    probs = rng.dirichlet(np.ones(vocab), (4, n)).astype(np.float32)
    draft = rng.dirichlet(np.ones(vocab), (4, n)).astype(np.float32)
    seeds = np.uint32([11, 22, 33, 44])
    positions = np.int32([5, 9, 5, 130])

    def run(rows):
        u, e = make_verify_noise(seeds[rows], positions[rows], n, vocab)
        res = verify_rejection(tokens[rows], np.tile(nt, (len(rows), 1)),
                               np.tile(ns, (len(rows), 1)), probs[rows], draft[rows], u, e,
                               max_depth=depth)
        smp = sample_token(np.log(probs[rows, 0]), np.ones(len(rows), np.float32),
                           np.zeros(len(rows), np.int32), np.ones(len(rows), np.float32),
                           seeds[rows], positions[rows])
        return [np.asarray(x) for x in (*res, smp, u, e)]

    a = run([0, 1, 2])
    b = run([3, 2, 1, 0])
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x[[0, 1, 2]], y[[3, 2, 1]])
    # Different seeds at the same position get different noise.
    assert not np.array_equal(a[-1][0], a[-1][2])
