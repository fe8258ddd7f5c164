"""Tree verification: references vs plain-Python walks, kernels vs references,
sampling-parameter processing, and the bonus-token convention.

Distributional (losslessness) checks live in tests/test_rejection.py. Kernel
cases reuse a few fixed shapes because each new shape costs an interpret-mode
compile; values vary within a batch instead.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jaxspec.pallas.verify import (
    verify_greedy_pallas,
    verify_rejection_pallas,
    verify_target_only_pallas,
)
from jaxspec.speculative.sampling import (
    make_verify_noise,
    sample_token,
    target_probs_from_logits,
)
from jaxspec.speculative.verify import (
    VerifyResult,
    emitted_tokens,
    verify_greedy,
    verify_greedy_ref,
    verify_rejection,
    verify_rejection_ref,
    verify_target_only,
    verify_target_only_ref,
)

# --------------------------------------------------------------------------
# Local tree helpers (the convention of jaxspec.speculative.tree, rebuilt in numpy)
# --------------------------------------------------------------------------


def retrieve_tables(parents: np.ndarray, tokens: np.ndarray):
    """[B, N] parents/tokens -> (next_token, next_sibling) [B, N] int32."""
    b, n = parents.shape
    next_token = -np.ones((b, n), np.int32)
    next_sibling = -np.ones((b, n), np.int32)
    for s in range(b):
        last = {}
        for i in range(1, n):
            if tokens[s, i] < 0:
                continue
            p = parents[s, i]
            if p in last:
                next_sibling[s, last[p]] = i
            else:
                next_token[s, p] = i
            last[p] = i
    return next_token, next_sibling


def random_trees(rng, b: int, n: int, vocab: int, pad_frac: float = 0.15):
    """Random trees with padding nodes (token -1, parent 0)."""
    parents = np.zeros((b, n), np.int32)
    parents[:, 0] = -1
    for i in range(1, n):
        parents[:, i] = rng.integers(0, i, b)
    tokens = rng.integers(0, vocab, (b, n)).astype(np.int32)
    pad = rng.random((b, n)) < pad_frac
    pad[:, 0] = False
    tokens[pad] = -1
    parents[pad] = 0
    nt, ns = retrieve_tables(parents, tokens)
    return parents, tokens, nt, ns


def children(nt, ns, i):
    out, j = [], nt[i]
    while j >= 0:
        out.append(j)
        j = ns[j]
    return out


def peaked_probs(rng, tokens, nt, ns, vocab: int, alpha: float = 0.5):
    """[B, N, V] target probs that put half their mass on one child's token,
    so random walks go deep and every branch of the verifiers is exercised."""
    b, n = tokens.shape
    p = rng.dirichlet(np.full(vocab, alpha), (b, n))
    for s in range(b):
        for i in range(n):
            kids = children(nt[s], ns[s], i)
            if kids and rng.random() < 0.8:
                k = kids[rng.integers(len(kids))]
                p[s, i] = 0.5 * p[s, i] + 0.5 * np.eye(vocab)[tokens[s, k]]
    return p.astype(np.float32)


def steered_predict(rng, tokens, nt, ns, vocab: int):
    """[B, N] target argmax that usually names some child's token (deep paths)."""
    b, n = tokens.shape
    pred = rng.integers(0, vocab, (b, n)).astype(np.int32)
    for s in range(b):
        for i in range(n):
            kids = children(nt[s], ns[s], i)
            if kids and rng.random() < 0.8:
                pred[s, i] = tokens[s, kids[rng.integers(len(kids))]]
    return pred


def draft_like(rng, target, parents, mix: float = 0.5):
    """[B, N, V] draft probs indexed by child: a mix of the parent's target
    row and noise (closer drafts accept more)."""
    b, n, vocab = target.shape
    parent_rows = target[np.arange(b)[:, None], np.maximum(parents, 0)]
    noise = rng.dirichlet(np.ones(vocab), (b, n))
    return (mix * parent_rows + (1 - mix) * noise).astype(np.float32)


def assert_same(got: VerifyResult, want: VerifyResult):
    for name, g, w in zip(VerifyResult._fields, got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


# --------------------------------------------------------------------------
# Plain-Python walks (independent of the jnp code)
# --------------------------------------------------------------------------


def py_greedy(tokens, nt, ns, pred, max_depth):
    acc, cur, j = [0], 0, nt[0]
    while j >= 0 and len(acc) - 1 < max_depth:
        if tokens[j] == pred[cur]:
            acc.append(j)
            cur, j = j, nt[j]
        else:
            j = ns[j]
    return acc, len(acc) - 1, int(pred[cur])


def py_race(w, e):
    w = np.asarray(w, np.float32)
    return int(np.argmax(w / e))


def py_target_only(tokens, nt, ns, p, u, e, th_single, th_acc, max_depth):
    acc, cur, j = [0], 0, nt[0]
    prob_acc, rejected = 0.0, set()
    while j >= 0 and len(acc) - 1 < max_depth:
        t = tokens[j]
        ps = 0.0 if (t < 0 or t in rejected) else float(p[cur, t])
        prob_acc = np.float32(prob_acc + ps)
        if t >= 0 and (u[cur] < prob_acc / np.float32(th_acc) or ps >= th_single):
            acc.append(j)
            cur, j, prob_acc, rejected = j, nt[j], 0.0, set()
        else:
            rejected.add(t)
            j = ns[j]
    res = p[cur].copy()
    for t in rejected:
        res[t] = 0.0
    if res.max() <= 0:
        res = p[cur]
    return acc, len(acc) - 1, py_race(res, e)


def py_rejection(tokens, nt, ns, p, q, u, e, max_depth):
    vocab = p.shape[-1]
    acc, cur, j = [0], 0, nt[0]
    res = p[0].astype(np.float32)
    while j >= 0 and len(acc) - 1 < max_depth:
        t = tokens[j]
        qj = np.eye(vocab, dtype=np.float32)[t] if q is None else q[j]
        if u[j] * qj[t] < res[t]:
            acc.append(j)
            cur, j, res = j, nt[j], p[j].astype(np.float32)
        else:
            new = np.maximum(res - qj, 0.0)
            z = new.sum()
            res = new / z if z > 0 else p[cur].astype(np.float32)
            j = ns[j]
    fb = res if res.max() > 0 else p[cur]
    return acc, len(acc) - 1, py_race(fb, e)


def check_against_python(result: VerifyResult, walks):
    acc, n, bonus = (np.asarray(x) for x in result)
    for s, (want_acc, want_n, want_bonus) in enumerate(walks):
        assert list(acc[s, : want_n + 1]) == want_acc, s
        assert (acc[s, want_n + 1:] == -1).all(), s
        assert n[s] == want_n, s
        assert bonus[s] == want_bonus, s


# --------------------------------------------------------------------------
# References vs Python
# --------------------------------------------------------------------------

B, N = 16, 10


def _case(seed: int, vocab: int):
    rng = np.random.default_rng(seed)
    parents, tokens, nt, ns = random_trees(rng, B, N, vocab)
    p = peaked_probs(rng, tokens, nt, ns, vocab)
    q = draft_like(rng, p, parents)
    u, e = make_verify_noise(jnp.arange(B) + 100 * seed, jnp.arange(B), N, vocab)
    return parents, tokens, nt, ns, p, q, np.asarray(u), np.asarray(e)


@pytest.mark.parametrize("max_depth", [1, 3, N - 1])
def test_greedy_ref_matches_python_walk(max_depth):
    rng = np.random.default_rng(max_depth)
    _, tokens, nt, ns = random_trees(rng, 64, N, 5)
    pred = steered_predict(rng, tokens, nt, ns, 5)
    got = verify_greedy_ref(tokens, nt, ns, pred, max_depth=max_depth)
    check_against_python(got, [py_greedy(tokens[s], nt[s], ns[s], pred[s], max_depth)
                               for s in range(64)])
    assert int(np.max(got.num_accepted)) >= min(max_depth, 3)


@pytest.mark.parametrize("thresholds", [(1.0, 1.0), (0.4, 0.7)])
def test_target_only_ref_matches_python_walk(thresholds):
    _, tokens, nt, ns, p, _, u, e = _case(1, 12)
    got = verify_target_only_ref(tokens, nt, ns, p, u, e, *thresholds, max_depth=5)
    check_against_python(got, [
        py_target_only(tokens[s], nt[s], ns[s], p[s], u[s], e[s], *thresholds, 5)
        for s in range(B)])
    n = np.asarray(got.num_accepted)
    assert n.max() >= 2 and (n == 0).any()  # deep accepts and rejections both compared


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_ref_matches_python_walk(one_hot):
    _, tokens, nt, ns, p, q, u, e = _case(2, 12)
    got = verify_rejection_ref(tokens, nt, ns, p, None if one_hot else q, u, e, max_depth=5)
    check_against_python(got, [
        py_rejection(tokens[s], nt[s], ns[s], p[s], None if one_hot else q[s], u[s], e[s], 5)
        for s in range(B)])
    assert np.asarray(got.num_accepted).max() >= 2  # the cases do go deep


# --------------------------------------------------------------------------
# Kernels (interpret mode) vs references
# --------------------------------------------------------------------------


def test_greedy_kernel_matches_ref():
    rng = np.random.default_rng(3)
    _, tokens, nt, ns = random_trees(rng, B, N, 4)
    for _ in range(3):  # same shapes: one compile, three value sets
        pred = steered_predict(rng, tokens, nt, ns, 4)
        want = verify_greedy_ref(tokens, nt, ns, pred, max_depth=4)
        assert_same(verify_greedy_pallas(tokens, nt, ns, pred, max_depth=4, interpret=True),
                    want)
        check_against_python(want, [py_greedy(tokens[s], nt[s], ns[s], pred[s], 4) for s in range(B)])
        assert np.asarray(want.num_accepted).max() >= 2


# (vocab, vocab_tile, max_depth): one whole tile, and several tiles with a
# ragged last one; max_depth 2 truncates walks that could go deeper.
VOCAB_CASES = [(8, 2048, 5), (300, 64, 2)]


@pytest.mark.parametrize("vocab,tile,max_depth", VOCAB_CASES)
def test_target_only_kernel_matches_ref(vocab, tile, max_depth):
    _, tokens, nt, ns, p, _, u, e = _case(4, vocab)
    # Per-request thresholds: lossless, aggressive, and single-only rows.
    th_single = np.tile(np.float32([1.0, 0.3, 0.6, 1.0]), B // 4)
    th_acc = np.tile(np.float32([1.0, 0.5, 1.0, 0.8]), B // 4)
    got = verify_target_only_pallas(tokens, nt, ns, p, u, e, th_single, th_acc,
                                    max_depth=max_depth, interpret=True, vocab_tile=tile)
    want = verify_target_only_ref(tokens, nt, ns, p, u, e, th_single, th_acc,
                                  max_depth=max_depth)
    assert_same(got, want)
    assert np.asarray(want.num_accepted).max() >= min(max_depth, 3)


@pytest.mark.parametrize("vocab,tile,max_depth,one_hot", [
    (8, 2048, 5, False), (300, 64, 2, False), (300, 64, 5, True)])
def test_rejection_kernel_matches_ref(vocab, tile, max_depth, one_hot):
    _, tokens, nt, ns, p, q, u, e = _case(5, vocab)
    draft = None if one_hot else q
    got = verify_rejection_pallas(tokens, nt, ns, p, draft, u, e, max_depth=max_depth,
                                  interpret=True, vocab_tile=tile)
    want = verify_rejection_ref(tokens, nt, ns, p, draft, u, e, max_depth=max_depth)
    assert_same(got, want)
    assert np.asarray(want.num_accepted).max() >= 2


def test_rejection_degenerate_residual_restarts():
    """A child whose token has zero probability under both p' and q = p' is
    rejected with a zero-mass residual max(p' - q, 0): the walk restarts from
    target_probs[cur], so the next sibling (same q) is accepted with ratio 1."""
    vocab, b = 8, 4
    rng = np.random.default_rng(6)
    parents = np.tile(np.int32([-1, 0, 0, 1]), (b, 1))
    tokens = np.tile(np.int32([3, 0, 5, 2]), (b, 1))
    nt, ns = retrieve_tables(parents, tokens)
    p = rng.dirichlet(np.ones(vocab), (b, 4)).astype(np.float32)
    p[:, 0, 0] = 0.0
    p[:, 0] /= p[:, 0].sum(-1, keepdims=True)
    q = np.repeat(p[:, :1], 4, axis=1)  # both root children "drawn" from p[0]
    u = np.full((b, 4), 0.999, np.float32)
    e = np.asarray(make_verify_noise(jnp.arange(b), jnp.zeros(b, jnp.int32), 4, vocab)[1])
    want = verify_rejection_ref(tokens, nt, ns, p, q, u, e, max_depth=2)
    check_against_python(want, [py_rejection(tokens[s], nt[s], ns[s], p[s], q[s], u[s], e[s], 2)
                                for s in range(b)])
    assert (np.asarray(want.accept_index)[:, 1] == 2).all()
    assert_same(verify_rejection_pallas(tokens, nt, ns, p, q, u, e, max_depth=2,
                                        interpret=True), want)


def test_dispatch_uses_kernel_in_interpret_mode(monkeypatch):
    _, tokens, nt, ns, p, q, u, e = _case(7, 8)
    pred = p.argmax(-1).astype(np.int32)
    want = (verify_greedy_ref(tokens, nt, ns, pred, max_depth=5),
            verify_target_only_ref(tokens, nt, ns, p, u, e, max_depth=5),
            verify_rejection_ref(tokens, nt, ns, p, q, u, e, max_depth=5))
    monkeypatch.setenv("JAXSPEC_KERNELS", "interpret")
    got = (verify_greedy(tokens, nt, ns, pred, max_depth=5),
           verify_target_only(tokens, nt, ns, p, u, e, max_depth=5),
           verify_rejection(tokens, nt, ns, p, q, u, e, max_depth=5))
    for g, w in zip(got, want):
        assert_same(g, w)
        assert np.asarray(w.num_accepted).max() >= 2  # the dispatched kernels do accept drafts


def test_kernels_lower_to_triton():
    """Cross-platform lowering to CUDA runs the Pallas->Triton-IR stage on this
    CPU host: power-of-two tensor sizes, supported primitives, no scratch."""
    import jaxspec.pallas.verify as pv

    b, n, v, d = 2, 7, 1000, 4
    i32 = jax.ShapeDtypeStruct((b, n), jnp.int32)
    probs = jax.ShapeDtypeStruct((b, n, v), jnp.float32)
    u = jax.ShapeDtypeStruct((b, n), jnp.float32)
    e = jax.ShapeDtypeStruct((b, v), jnp.float32)
    fns = [
        (lambda *a: pv.verify_greedy_pallas(*a, max_depth=d), (i32,) * 4),
        (lambda *a: pv.verify_target_only_pallas(*a, max_depth=d, vocab_tile=256),
         (i32, i32, i32, probs, u, e)),
        (lambda t, a, s, p, uu, ee: pv.verify_rejection_pallas(
            t, a, s, p, None, uu, ee, max_depth=d, vocab_tile=256), (i32, i32, i32, probs, u, e)),
        (lambda *a: pv.verify_rejection_pallas(*a, max_depth=d, vocab_tile=256),
         (i32, i32, i32, probs, probs, u, e)),
    ]
    orig = pv._use_reference
    pv._use_reference = lambda interpret: False  # lower the kernel even on a CPU host
    try:
        for fn, args in fns:
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert "triton" in text
    finally:
        pv._use_reference = orig


# --------------------------------------------------------------------------
# Convention helpers and sampling parameters
# --------------------------------------------------------------------------


def test_emitted_tokens_layout():
    tokens = np.array([[5, 6, 7, 8], [5, 6, 7, 8]], np.int32)
    res = VerifyResult(jnp.array([[0, 2, 3], [0, -1, -1]], jnp.int32),
                       jnp.array([2, 0], jnp.int32), jnp.array([9, 4], jnp.int32))
    np.testing.assert_array_equal(np.asarray(emitted_tokens(tokens, res)),
                                  [[7, 8, 9], [4, -1, -1]])


def np_filtered_probs(logits, temperature, top_k, top_p):
    """Plain numpy temperature -> top-k -> top-p for one row."""
    if temperature <= 0:
        return np.eye(len(logits))[np.argmax(logits)]
    x = logits / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(len(x), bool)
    k = top_k if 0 < top_k < len(x) else len(x)
    keep[order[:k]] = True
    pk = np.where(keep, np.exp(x - x.max()), 0.0)
    pk /= pk.sum()
    if top_p < 1.0:
        cum = 0.0
        keep = np.zeros(len(x), bool)
        for i in order[:k]:
            keep[i] = True
            cum += pk[i]
            if cum >= top_p:
                break
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    return p / p.sum()


def test_target_probs_from_logits_matches_numpy():
    rng = np.random.default_rng(8)
    b, n, v = 6, 3, 20
    logits = rng.normal(size=(b, n, v)).astype(np.float32) * 2
    temperature = np.float32([0.0, 1.0, 0.7, 1.3, 1.0, 2.0])
    top_k = np.int32([0, 0, 5, 0, 1, 30])
    top_p = np.float32([1.0, 1.0, 1.0, 0.8, 0.5, 0.3])
    got = np.asarray(target_probs_from_logits(logits, temperature, top_k, top_p))
    for s in range(b):
        for i in range(n):
            want = np_filtered_probs(logits[s, i], temperature[s], top_k[s], top_p[s])
            np.testing.assert_allclose(got[s, i], want, atol=1e-6, err_msg=f"{s},{i}")
    # No filtering at all takes the sort-free branch.
    plain = target_probs_from_logits(logits, np.ones(b, np.float32), np.zeros(b, np.int32),
                                     np.ones(b, np.float32))
    np.testing.assert_allclose(np.asarray(plain), np.asarray(jax.nn.softmax(logits)), atol=1e-6)


def test_sample_token_greedy_and_bonus_agreement():
    rng = np.random.default_rng(9)
    b, v = 8, 50
    logits = rng.normal(size=(b, v)).astype(np.float32)
    seeds, pos = jnp.arange(b, dtype=jnp.uint32), jnp.arange(b, dtype=jnp.int32) * 3
    zeros = np.zeros(b, np.float32)
    greedy = sample_token(logits, zeros, np.zeros(b, np.int32), np.ones(b, np.float32),
                          seeds, pos)
    np.testing.assert_array_equal(np.asarray(greedy), logits.argmax(-1))
    # A verify step with no drafts emits exactly what plain decoding samples.
    temperature = np.full(b, 0.8, np.float32)
    top_k, top_p = np.full(b, 10, np.int32), np.full(b, 0.9, np.float32)
    plain = sample_token(logits, temperature, top_k, top_p, seeds, pos)
    n_nodes = 3
    probs = target_probs_from_logits(np.repeat(logits[:, None], n_nodes, 1), temperature,
                                     top_k, top_p)
    u, e = make_verify_noise(seeds, pos, n_nodes, v)
    tokens = np.full((b, n_nodes), 1, np.int32)
    none = -np.ones((b, n_nodes), np.int32)  # root without children
    for res in (verify_rejection_ref(tokens, none, none, probs, None, u, e, max_depth=2),
                verify_target_only_ref(tokens, none, none, probs, u, e, max_depth=2)):
        np.testing.assert_array_equal(np.asarray(res.bonus_token), np.asarray(plain))
        np.testing.assert_array_equal(np.asarray(res.num_accepted), 0)


def test_greedy_requests_agree_across_verifiers():
    """Temperature 0 makes target probs one-hot; both sampling verifiers then
    reproduce greedy verification exactly, whatever the drafts and coins."""
    _, tokens, nt, ns, p, q, u, e = _case(10, 8)
    logits = np.log(p + 1e-6)
    probs = target_probs_from_logits(logits, np.zeros(B, np.float32), np.zeros(B, np.int32),
                                     np.ones(B, np.float32))
    pred = logits.argmax(-1).astype(np.int32)
    want = verify_greedy_ref(tokens, nt, ns, pred, max_depth=5)
    # The shared answer is the plain-Python greedy walk, and it accepts drafts (on
    # all-rejecting trees every verifier would agree on the argmax bonus alone).
    check_against_python(want, [py_greedy(tokens[s], nt[s], ns[s], pred[s], 5) for s in range(B)])
    n = np.asarray(want.num_accepted)
    assert n.max() >= 2 and (n > 0).sum() >= B // 2 and (n == 0).any()
    assert_same(verify_rejection_ref(tokens, nt, ns, probs, q, u, e, max_depth=5), want)
    assert_same(verify_rejection_ref(tokens, nt, ns, probs, None, u, e, max_depth=5), want)
    assert_same(verify_target_only_ref(tokens, nt, ns, probs, u, e, max_depth=5), want)


def test_argmax_last_equals_jnp_argmax_with_ties():
    from jaxspec.speculative.sampling import argmax_last

    rng = np.random.default_rng(7)
    x = rng.integers(-3, 4, size=(5, 4, 300)).astype(np.float32)  # many ties
    np.testing.assert_array_equal(np.asarray(argmax_last(jnp.asarray(x))), np.argmax(x, axis=-1))
    y = np.full((2, 9), -np.inf, np.float32)
    y[1, 4] = 0.0
    np.testing.assert_array_equal(np.asarray(argmax_last(jnp.asarray(y))), [0, 4])
