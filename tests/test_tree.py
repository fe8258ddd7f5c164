"""Tree construction: kernel == reference == naive Python; draft organisation
against a brute force. Shapes come from small fixed sets so jit caches hit."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxspec.pallas.tree_build import build_tree_pallas
from jaxspec.speculative import tree as T

B = 2
MAX_KV = 96
NODE_COUNTS = (1, 5, 12, 37)  # 37 -> not a power of two, padded to 64 in the kernel
FIELDS = ("depth", "positions", "mask", "retrieve_next_token", "retrieve_next_sibling",
          "valid", "prefix_lens", "full_mask")

ref_jit = jax.jit(T.build_tree_ref, static_argnames="max_kv")
chain_jit = jax.jit(T.build_chain_tree, static_argnames="max_kv")
kernel_jit = functools.partial(build_tree_pallas, interpret=True)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------
# Random trees and a naive Python model
# --------------------------------------------------------------------------


@st.composite
def trees(draw, n=None):
    """(tokens [B,N], parents [B,N], prefix_lens [B]) numpy, in the convention."""
    n = draw(st.sampled_from(NODE_COUNTS)) if n is None else n
    pad_p = draw(st.sampled_from([0.0, 0.2, 0.6]))
    toks, pars = [], []
    for _ in range(B):
        rnd = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        tok, par, real = [int(rnd.integers(0, 1000))], [-1], [0]
        for i in range(1, n):
            if rnd.random() < pad_p:
                tok.append(-1 - int(rnd.integers(0, 3)))
                par.append(0)
            else:
                tok.append(int(rnd.integers(0, 1000)))
                par.append(int(rnd.choice(real)))
                real.append(i)
        toks.append(tok)
        pars.append(par)
    prefix = draw(st.lists(st.integers(0, 50), min_size=B, max_size=B))
    return (np.array(toks, np.int32), np.array(pars, np.int32), np.array(prefix, np.int32))


def naive(tok, par, prefix, max_kv):
    """Per-sequence loops straight from the convention's wording."""
    n = len(tok)
    valid = [i == 0 or tok[i] >= 0 for i in range(n)]
    mask = np.zeros((n, n), bool)
    depth = np.zeros(n, np.int32)
    for i in range(n):
        if not valid[i]:
            mask[i, i], depth[i] = True, 1
            continue
        j = i
        while j >= 0:
            mask[i, j] = True
            depth[i] += j != i
            j = par[j]
    kids = {u: [c for c in range(1, n) if valid[c] and par[c] == u] for u in range(n)}
    nxt = np.array([kids[u][0] if valid[u] and kids[u] else -1 for u in range(n)])
    sib = np.full(n, -1)
    for u in range(n):
        for a, b_ in zip(kids[u], kids[u][1:]):
            sib[a] = b_
    full = np.zeros((n, max_kv), bool)
    full[:, :prefix] = True
    for i in range(n):
        for j in range(n):
            if mask[i, j] and prefix + j < max_kv:
                full[i, prefix + j] = True
    return dict(depth=depth, positions=prefix + depth, mask=mask, next_token=nxt,
                next_sibling=sib, valid=np.array(valid), full_mask=full)


def dfs_order(info, b):
    """Walk retrieve_next_token / retrieve_next_sibling from the root."""
    nt = np.asarray(info.retrieve_next_token[b])
    ns = np.asarray(info.retrieve_next_sibling[b])
    order, stack = [], [(0, -1)]
    while stack:
        node, parent = stack.pop()
        order.append((node, parent))
        kids, c = [], nt[node]
        while c != -1:
            kids.append(c)
            c = ns[c]
            assert len(kids) <= len(nt), "sibling cycle"
        assert kids == sorted(kids), "children not in index order"
        stack.extend((k, node) for k in reversed(kids))
        assert len(order) <= len(nt), "child cycle"
    return order


def chain_parents(n: int, batch: int = 1) -> jax.Array:
    """[batch, n] int32 parents of a chain: -1, 0, 1, ..., n-2."""
    return jnp.broadcast_to(jnp.arange(-1, n - 1, dtype=jnp.int32), (batch, n))


def assert_infos_equal(a, b):
    for f in FIELDS:
        x, y = np.asarray(getattr(a, f)), np.asarray(getattr(b, f))
        assert x.dtype == y.dtype and x.shape == y.shape, f
        np.testing.assert_array_equal(x, y, err_msg=f)


# --------------------------------------------------------------------------
# build_tree
# --------------------------------------------------------------------------


@settings(max_examples=30, **SETTINGS)
@given(trees())
def test_reference_matches_naive(tree):
    tok, par, prefix = tree
    n = tok.shape[1]
    info = ref_jit(tok, par, prefix, max_kv=MAX_KV)
    assert info.mask.dtype == jnp.bool_
    for b in range(B):
        want = naive(tok[b], par[b], int(prefix[b]), MAX_KV)
        np.testing.assert_array_equal(info.depth[b], want["depth"])
        np.testing.assert_array_equal(info.positions[b], want["positions"])
        np.testing.assert_array_equal(info.mask[b], want["mask"])
        np.testing.assert_array_equal(info.retrieve_next_token[b], want["next_token"])
        np.testing.assert_array_equal(info.retrieve_next_sibling[b], want["next_sibling"])
        np.testing.assert_array_equal(info.valid[b], want["valid"])
        np.testing.assert_array_equal(info.full_mask[b], want["full_mask"])

        # DFS over the retrieve tables: every real node once, parent first.
        order = dfs_order(info, b)
        nodes = [v for v, _ in order]
        assert sorted(nodes) == [i for i in range(n) if want["valid"][i]]
        seen = set()
        for v, p in order:
            assert v == 0 or (p == par[b, v] and p in seen)
            seen.add(v)


@settings(max_examples=16, **SETTINGS)
@given(trees())
def test_kernel_matches_reference(tree):
    tok, par, prefix = tree
    assert_infos_equal(kernel_jit(tok, par, prefix, max_kv=MAX_KV),
                       ref_jit(tok, par, prefix, max_kv=MAX_KV))


def test_kernel_extremes():
    # Deep chain (longest closure), star (widest sibling list), all padding.
    n = 37
    tok = np.arange(1, 2 * n + 1, dtype=np.int32).reshape(2, n)
    chain = np.asarray(chain_parents(n, 1))[0]
    star = np.r_[-1, np.zeros(n - 1, np.int32)].astype(np.int32)
    prefix = np.array([0, 60], np.int32)
    cases = [(tok, np.stack([chain, star])),
             (np.where(np.arange(n) == 0, tok, -1).astype(np.int32), np.stack([star, star]))]
    for t, p in cases:
        assert_infos_equal(kernel_jit(t, p, prefix, max_kv=MAX_KV),
                           ref_jit(t, p, prefix, max_kv=MAX_KV))


@pytest.mark.parametrize("platform,backend", [("cuda", "gpu"), ("tpu", "tpu")])
def test_kernel_cross_lowers(monkeypatch, platform, backend):
    # No accelerator needed: lowering runs Pallas' Triton / Mosaic lowering
    # rules, which reject unsupported ops and shapes (N=37: non-pow2).
    # It does not run the Triton/Mosaic compilers, so it is not a device test.
    import jaxspec.pallas.tree_build as tb

    monkeypatch.setattr(tb, "_target_platform", lambda: backend)
    tok = jnp.zeros((B, 37), jnp.int32)
    fn = functools.partial(tb.build_tree_pallas.__wrapped__, max_kv=None, interpret=False)
    lowered = jax.jit(fn).trace(tok, tok, jnp.zeros((B,), jnp.int32)).lower(
        lowering_platforms=(platform,))
    target = {"cuda": "xla.gpu.triton", "tpu": "tpu_custom_call"}[platform]
    assert target in lowered.as_text()


@settings(max_examples=20, **SETTINGS)
@given(n=st.sampled_from(NODE_COUNTS), data=st.data())
def test_chain_fast_path_equals_general(n, data):
    # Chain drafters that stop early leave a padding suffix.
    real = data.draw(st.lists(st.integers(1, n), min_size=B, max_size=B))
    prefix = np.array(data.draw(st.lists(st.integers(0, 50), min_size=B, max_size=B)), np.int32)
    idx = np.arange(n)
    tok = np.stack([np.where(idx < r, 7 + idx, -1) for r in real]).astype(np.int32)
    par = np.stack([np.where(idx < r, idx - 1, 0) for r in real]).astype(np.int32)
    assert_infos_equal(chain_jit(tok, prefix, max_kv=MAX_KV),
                       ref_jit(tok, par, prefix, max_kv=MAX_KV))


def test_build_tree_dispatch(monkeypatch):
    tok = np.array([[3, 4, 5, -1, 6]] * B, np.int32)
    par = np.array([[-1, 0, 0, 0, 1]] * B, np.int32)
    prefix = np.array([4, 9], np.int32)
    want = ref_jit(tok, par, prefix)
    assert want.full_mask is None
    for mode in ("ref", "interpret"):
        monkeypatch.setenv("JAXSPEC_KERNELS", mode)
        # A fresh jit per mode: the env var is read at trace time.
        got = jax.jit(T.build_tree, static_argnames=("chain", "max_kv"))(tok, par, prefix)
        assert_infos_equal(got, want)
    chain = jax.jit(T.build_tree, static_argnames=("chain", "max_kv"))(
        tok[:, :3], None, prefix, chain=True)
    assert_infos_equal(chain, ref_jit(tok[:, :3], chain_parents(3, B), prefix))
    np.testing.assert_array_equal(jax.jit(want.full_layout_mask, static_argnums=0)(16),
                                  ref_jit(tok, par, prefix, max_kv=16).full_mask)
    with pytest.raises(ValueError, match="parents"):
        T.build_tree(tok, None, prefix)
    # TreeInfo is a pytree: it crosses jit boundaries and tree_map.
    leaves = jax.tree_util.tree_leaves(want)
    assert len(leaves) == len(FIELDS) - 1  # full_mask is None


# --------------------------------------------------------------------------
# Draft organisation
# --------------------------------------------------------------------------


def organize_brute_force(root, tok, sc, fr, n):
    """One sequence; tok/sc [S, K, K], fr [S, K]. Restates the docstring rule."""
    s_steps, k, _ = tok.shape
    eff, parent = {}, {}
    for s in range(s_steps):
        for f in range(k if s else 1):
            par = None if s == 0 else (s - 1, fr[s, f] // k, fr[s, f] % k)
            for c in range(k):
                e = float(sc[s, f, c])
                if par is not None:
                    e = min(e, eff[par])
                eff[(s, f, c)] = -math.inf if tok[s, f, c] < 0 else e
                parent[(s, f, c)] = par
    flat = lambda key: key[1] * k + key[2]  # noqa: E731
    top = sorted(eff, key=lambda key: (-eff[key], key[0], flat(key)))[: n - 1]
    real = [key for key in top if eff[key] > -math.inf]
    pads = sorted((key for key in top if eff[key] == -math.inf),
                  key=lambda key: (key[0], flat(key)))
    pos, nodes = {None: 0}, []
    for s in range(s_steps):
        level = sorted((key for key in real if key[0] == s),
                       key=lambda key: (pos[parent[key]], -eff[key], flat(key)))
        for key in level:
            pos[key] = 1 + len(nodes)
            nodes.append((int(tok[key]), pos[parent[key]], eff[key]))
    nodes += [(-1, 0, -math.inf)] * len(pads)
    tokens = [int(root)] + [t for t, _, _ in nodes]
    parents = [-1] + [p for _, p, _ in nodes]
    scores = [0.0] + [e for _, _, e in nodes]
    return tokens, parents, scores


# (num_steps, topk, num_draft_tokens): few shapes, since each one compiles.
DRAFT_CONFIGS = ((1, 1, 2), (1, 3, 4), (2, 2, 7), (2, 3, 1), (3, 2, 9), (3, 3, 12), (4, 1, 5))
organize_jit = jax.jit(T.organize_draft_tree, static_argnums=4)


@st.composite
def drafts(draw):
    s_steps, k, n = draw(st.sampled_from(DRAFT_CONFIGS))
    rnd = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    pad_p = draw(st.sampled_from([0.0, 0.15]))
    # Coarse log-probs make ties common; sometimes non-monotone raw scores.
    local = rnd.choice([0.0, -0.5, -1.0, -2.0], size=(B, s_steps, k, k)).astype(np.float32)
    tok = rnd.integers(0, 500, size=(B, s_steps, k, k)).astype(np.int32)
    tok[rnd.random(tok.shape) < pad_p] = -1
    fr = np.zeros((B, s_steps, k), np.int32)
    sc = np.zeros_like(local)
    sc[:, 0] = local[:, 0]
    for b in range(B):
        for s in range(1, s_steps):
            fr[b, s] = rnd.permutation(k if s == 1 else k * k)[:k]
            prev = sc[b, s - 1].reshape(-1)[fr[b, s]]
            sc[b, s] = prev[:, None] + local[b, s]
    if draw(st.booleans()):
        sc = rnd.choice([0.0, -1.0, -3.0], size=sc.shape).astype(np.float32)
    root = rnd.integers(0, 500, size=B).astype(np.int32)
    return root, tok, sc, fr, n


@settings(max_examples=60, **SETTINGS)
@given(drafts())
def test_organize_matches_brute_force(draft):
    root, tok, sc, fr, n = draft
    tokens, parents, scores = organize_jit(root, tok, sc, fr, n)
    assert tokens.shape == parents.shape == scores.shape == (B, n)
    for b in range(B):
        want = organize_brute_force(root[b], tok[b], sc[b], fr[b], n)
        np.testing.assert_array_equal(tokens[b], want[0])
        np.testing.assert_array_equal(parents[b], want[1])
        np.testing.assert_array_equal(scores[b], np.array(want[2], np.float32))
        # Convention: parents precede children, padding hangs off the root,
        # siblings by non-increasing score.
        p = np.asarray(parents[b])
        assert p[0] == -1 and all(0 <= p[i] < i for i in range(1, n))
        assert all(p[i] == 0 for i in range(n) if tokens[b, i] < 0 and i)
        for u in range(n):
            kid_scores = [float(scores[b, c]) for c in range(1, n)
                          if p[c] == u and tokens[b, c] >= 0]
            assert kid_scores == sorted(kid_scores, reverse=True)


def test_organize_with_select_frontier():
    # A drafter loop as the tree drafters run it, end to end.
    k, s_steps, n = 2, 3, 9
    rnd = np.random.default_rng(0)
    logp = jnp.asarray(np.log(rnd.dirichlet(np.ones(k), size=(B, s_steps, k))), jnp.float32)

    @jax.jit
    def draft(logp):  # [B, S, K, K] local log-probs
        tok0, sc0 = T.root_step(jnp.array([[10, 11]] * B), logp[:, 0, 0])
        toks, scs, frs = [tok0], [sc0], [jnp.zeros((B, k), jnp.int32)]
        for s in range(1, s_steps):
            front = T.select_frontier(scs[-1])
            front_sc = jnp.take_along_axis(scs[-1].reshape(B, -1), front, axis=1)
            scs.append(front_sc[:, :, None] + logp[:, s])
            toks.append(jnp.broadcast_to(100 * s + jnp.arange(k * k).reshape(k, k), (B, k, k)))
            frs.append(front)
        return jnp.stack(toks, 1), jnp.stack(scs, 1), jnp.stack(frs, 1)

    args = (np.array([1, 2], np.int32), *draft(logp))
    tokens, parents, _ = organize_jit(*args, n)
    for b in range(B):
        want = organize_brute_force(*(np.asarray(a[b]) for a in args), n)
        np.testing.assert_array_equal(tokens[b], want[0])
        np.testing.assert_array_equal(parents[b], want[1])


def test_draft_config_validation():
    assert T.max_draft_tokens(5, 4) == 1 + 4 + 4 * 16
    assert T.max_draft_tokens(4, 1) == 5  # chain: steps + root
    T.check_draft_config(5, 4, 69)
    with pytest.raises(ValueError, match="at most"):
        T.check_draft_config(5, 4, 70)
    with pytest.raises(ValueError, match="num_steps >= 1"):
        T.check_draft_config(0, 4, 2)
    tok = jnp.zeros((1, 1, 2, 2), jnp.int32)
    with pytest.raises(ValueError, match="exceeds"):
        T.organize_draft_tree(jnp.zeros((1,), jnp.int32), tok, tok.astype(jnp.float32),
                              jnp.zeros((1, 1, 2), jnp.int32), 4)
