"""Sampled multi-draft trees (drafters/sampled_tree.py): the topology, the draws, the kernels.

The whole loop's losslessness with sampled trees is chi-square tested end to end in
test_feature_distribution.py (EAGLE, EAGLE-3, Medusa) and test_loop_distribution.py (standalone).
Here the pieces: the rank tree, the children of one node as draws without replacement (their
joint against the exact sequential formula, with a with-replacement control that must fail),
their proposal rows, q's support, greedy rows and the draft vocabulary, and the verify kernels
(Triton and Mosaic, interpreted) on a sampled tree's real inputs against the jnp reference.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.speculative.drafters.sampled_tree import (
    RankTree, TreeDraws, default_choices, parse_choices, rank_tree, sample_children,
)
from jaxspec.speculative.sampling import draft_noise, race_sample
from tests.test_loop_distribution import chi_square_p

VD = 6


def loop_state(b: int, temperature=1.0, top_p=1.0, top_k=0):
    sampling = SimpleNamespace(temperature=jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (b,)),
                               top_k=jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (b,)),
                               top_p=jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (b,)),
                               seed=jnp.arange(b, dtype=jnp.int32))
    return SimpleNamespace(sampling=sampling, hist_len=jnp.full((b,), 7, jnp.int32))


def test_rank_tree_shape_and_checks():
    paths = default_choices(3, 3, 9)
    assert len(paths) == 9 and len(set(paths)) == 9
    tree = RankTree.from_choices(paths)
    tree.check_sampling()  # default shapes are prefix-closed with ranks 0..w-1 under each node
    for i in range(1, tree.size):
        assert tree.parents[i] < i and tree.depths[i] == tree.depths[tree.parents[i]] + 1
        sibs = [c for c in tree.children(tree.parents[i]) if c < i]
        assert [tree.ranks[c] for c in sibs] == list(range(tree.ranks[i]))  # siblings in rank order
    fed = [0] + tree.fed()
    anc = tree.ancestors(fed)
    for i, n in enumerate(fed):  # brute force: walk the parents
        up = {n}
        while n > 0:
            n = tree.parents[n]
            up.add(n)
        assert {fed[j] for j in np.flatnonzero(anc[i])} == up & set(fed)
    with pytest.raises(ValueError, match=r"ranks \[0, 2\]"):
        RankTree.from_choices([(0,), (2,)]).check_sampling()
    with pytest.raises(ValueError, match="num_draft_tokens - 1 = 4"):
        rank_tree([(0,), (1,)], 2, 3, 5)
    with pytest.raises(ValueError, match="ranks < topk = 2"):
        rank_tree([(0,), (1,), (2,)], 2, 3, 4)
    with pytest.raises(ValueError, match="orphan"):
        parse_choices("[[0], [1, 0]]")


def _exact_triples(q: np.ndarray) -> np.ndarray:
    """P(first three draws without replacement = a, b, c) [V, V, V]."""
    out = np.zeros((len(q),) * 3)
    for a, b, c in itertools.permutations(range(len(q)), 3):
        out[a, b, c] = q[a] * q[b] / (1 - q[a]) * q[c] / (1 - q[a] - q[b])
    return out


def test_children_are_draws_without_replacement():
    """Three children of one node over 200,000 seeds: their joint is sequential sampling without
    replacement from q, each row is q without the earlier siblings, renormalised; the same test
    rejects children drawn with replacement (the SpecInfer rule's bug to avoid)."""
    rows = 200_000
    logits = jnp.asarray(np.log([0.35, 0.25, 0.15, 0.12, 0.08, 0.05]), jnp.float32)
    q = np.asarray(jax.nn.softmax(logits), np.float64)
    s = loop_state(rows)
    tok, prop = jax.jit(lambda lg: sample_children(lg, [0], 3, s, None, VD))(
        jnp.broadcast_to(logits, (rows, 1, VD)))
    tok, prop = np.asarray(tok)[:, 0], np.asarray(prop)[:, 0]
    assert (tok >= 0).all() and (tok[:, 0] != tok[:, 1]).all() and (tok[:, 1] != tok[:, 2]).all()
    counts = np.zeros((VD,) * 3)
    np.add.at(counts, (tok[:, 0], tok[:, 1], tok[:, 2]), 1)
    assert chi_square_p(counts, _exact_triples(q)) > 1e-3
    for r in range(3):  # the row each child was drawn from
        want = np.broadcast_to(q, (rows, VD)).copy()
        for e in range(r):
            want[np.arange(rows), tok[:, e]] = 0
        np.testing.assert_allclose(prop[:, r], want / want.sum(-1, keepdims=True), atol=1e-6)
    # Positive control: three independent draws from q (with replacement) fail.
    iid = np.stack([np.asarray(race_sample(jnp.asarray(q, jnp.float32)[None], draft_noise(s.sampling.seed, s.hist_len,
                                                                                          100 + r, VD)))
                    for r in range(3)], axis=1)
    counts = np.zeros((VD,) * 3)
    np.add.at(counts, (iid[:, 0], iid[:, 1], iid[:, 2]), 1)
    assert chi_square_p(counts, _exact_triples(q)) < 1e-6


def test_support_greedy_rows_and_the_draft_vocabulary():
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0, -2.0, -3.0]] * 3)[:, None]  # [B = 3, P = 1, VD]
    # top_p 0.7 keeps the two most likely: the third child is padding on sampled rows.
    s = loop_state(3, temperature=jnp.asarray([1.0, 0.0, 1.0]), top_p=0.7)
    d2t = jnp.asarray([10, 3, 7, 0, 1, 2])  # draft id -> target id, target vocabulary 12
    tok, prop = sample_children(logits, [0], 3, s, d2t, 12)
    tok, prop = np.asarray(tok)[:, 0], np.asarray(prop)[:, 0]
    assert sorted(tok[0, :2]) == [3, 10] and tok[0, 2] == -1
    np.testing.assert_array_equal(tok[1], [10, 3, 7])  # greedy row: the top 3 by logits, all kept
    np.testing.assert_array_equal(prop[1], np.eye(12)[[10, 3, 7]])  # with one-hot rows
    outside = np.setdiff1d(np.arange(12), np.asarray(d2t))
    assert (prop[:, :, outside] == 0).all()  # q lives on the draft vocabulary's target ids
    np.testing.assert_allclose(prop[0, 0].sum(), 1.0, rtol=1e-6)


def _sampled_tree_inputs(b=64, vocab=300):
    """A real sampled tree (topk 3, 3 deep, 9 drafts) with padding from a top-k support, as the
    verify kernels see it: (tokens, next_token, next_sibling, p, q, uniforms, bonus noise)."""
    from jaxspec.speculative.sampling import make_verify_noise
    from jaxspec.speculative.tree import build_tree_ref

    rng = np.random.default_rng(0)
    tree = rank_tree((), 3, 3, 10)
    s = loop_state(b, top_k=jnp.where(jnp.arange(b) % 4 == 0, 1, 0))  # top-1 rows: rank-1 children pad
    logits = jnp.asarray(rng.normal(size=(b, tree.size, vocab)) * 2, jnp.float32)
    draws = TreeDraws.start(tree, jnp.zeros((b,), jnp.int32))
    for depth in range(1, tree.depth + 1):
        draws.draw_level(depth, logits[:, tree.expanded(depth - 1)], s, None, vocab)
    tokens, parents, q = draws.proposal()
    assert (np.asarray(tokens) < 0).any()  # padding is in play
    info = build_tree_ref(tokens, parents, jnp.zeros((b,), jnp.int32))
    # Target probs near q at each node's own position, so deep paths get accepted.
    p = jax.nn.softmax(logits + jnp.asarray(rng.normal(size=logits.shape) * 0.3, jnp.float32), axis=-1)
    u, e = make_verify_noise(jnp.arange(b), jnp.full((b,), 9), tree.size, vocab)
    return tokens, info.retrieve_next_token, info.retrieve_next_sibling, p, q, u, e, tree.depth


@pytest.mark.parametrize("kernels", ["triton", "mosaic"])
def test_verify_kernels_on_a_sampled_tree(kernels):
    from jaxspec.speculative.verify import verify_rejection_ref
    from tests.test_verify import assert_same

    *args, depth = _sampled_tree_inputs()
    want = verify_rejection_ref(*args, max_depth=depth)
    if kernels == "triton":
        from jaxspec.pallas.verify import verify_rejection_pallas

        got = verify_rejection_pallas(*args, max_depth=depth, interpret=True, vocab_tile=128)
    else:
        from jaxspec.pallas.verify_tpu import verify_rejection_tpu

        got = verify_rejection_tpu(*args, max_depth=depth, interpret=True, tile_rows=8)
    assert_same(got, want)
    assert np.asarray(want.num_accepted).max() >= 2  # deep accept paths are compared, not only roots
