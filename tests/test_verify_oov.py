"""Issue 10 defect 7: a draft id outside [0, V) is never accepted nor emitted.

Every verifier (greedy, target-only, rejection with one-hot and with explicit
draft probs), as jnp reference and as Pallas kernel in interpret mode, on a
chain and on a branching tree. One batch per call, one row per draft id:

  row 0: the in-range id V-1 (positive control: it is accepted);
  rows 1-3: V, 99999999 and -3 in the same node, still linked into the
           retrieve tables (so -3 is not padding, just a bad id).

The bad ids are chosen so the old code accepted them: a clamped gather reads
p[V-1] for V and 99999999, the very probability that gets the control
accepted. The independent reference for a bad row is the same verifier on the
tree in which that node is padding (token -1, tables rebuilt): the walk must
skip the node exactly as it skips padding, so later siblings can still be
accepted and the residual and bonus are unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.pallas.verify import (
    verify_greedy_pallas,
    verify_rejection_pallas,
    verify_target_only_pallas,
)
from jaxspec.speculative.tree import build_tree_ref
from jaxspec.speculative.verify import (
    emitted_tokens,
    verify_greedy_ref,
    verify_rejection_ref,
    verify_target_only_ref,
)

V = 16
GOOD = V - 1  # what a clamped gather reads for any id >= V
BAD_IDS = (V, 99_999_999, -3)
BAD_NODE = 1
MAX_DEPTH = 3

# Shapes: node 1 (the tested node) is the root's first child; in the tree it
# has a sibling (node 2) that the walk reaches once node 1 is skipped.
SHAPES = {
    # parents, tokens (node 1 filled in per row)
    "chain": ([-1, 0, 1, 2], [3, GOOD, 9, 11]),
    "tree": ([-1, 0, 0, 1, 2], [3, GOOD, 7, 9, 11]),
}


def _probs(n: int, rng: np.random.Generator) -> np.ndarray:  # [n, V] float32
    """Target rows that favour the drafted children: p[0] puts 0.6 on GOOD and
    0.3 on 7 (node 2), p[1] 0.8 on 9, p[2] 0.8 on 11; the rest is spread."""
    p = rng.random((n, V)).astype(np.float32) + 0.05
    favour = {0: {GOOD: 0.6, 7: 0.3}, 1: {9: 0.8}, 2: {11: 0.8}}
    for row in range(n):
        want = favour.get(row, {})
        p[row, list(want)] = 0.0
        p[row] *= (1.0 - sum(want.values())) / p[row].sum()
        for tok, mass in want.items():
            p[row, tok] = mass
    return p


def _tables(tokens: np.ndarray, parents: np.ndarray):
    info = build_tree_ref(tokens, parents, np.zeros(tokens.shape[0], np.int32))
    return np.asarray(info.retrieve_next_token), np.asarray(info.retrieve_next_sibling)


def make_case(shape: str, seed: int = 0):
    """(tokens, nt, ns, padded_tokens, padded_nt, padded_ns, p, q, u, e), batch
    rows = [control] + BAD_IDS."""
    parents1, tokens1 = SHAPES[shape]
    n = len(tokens1)
    b = 1 + len(BAD_IDS)
    parents = np.tile(np.array(parents1, np.int32), (b, 1))
    tokens = np.tile(np.array(tokens1, np.int32), (b, 1))
    # Tables from the in-range tokens, so every row's node 1 stays linked (a
    # negative id there is a bad id, not padding).
    nt, ns = _tables(tokens, parents)
    tokens[1:, BAD_NODE] = BAD_IDS
    # The reference rows: node 1 made padding, tables rebuilt.
    padded = tokens.copy()
    padded[1:, BAD_NODE] = -1
    pnt, pns = _tables(padded, parents)  # row 0, the control, is unchanged

    rng = np.random.default_rng(seed)
    p = np.tile(_probs(n, rng)[None], (b, 1, 1))
    q = rng.dirichlet(np.ones(V), size=(b, n)).astype(np.float32)
    q[:, :, GOOD] += 1.0  # drafts drawn from q: GOOD likely, so still accepted
    q /= q.sum(-1, keepdims=True)
    u = np.full((b, n), 0.1, np.float32)
    e = rng.exponential(size=(b, V)).astype(np.float32) + 1e-6
    return tokens, nt, ns, padded, pnt, pns, p, q, u, e


def _predict(p: np.ndarray) -> np.ndarray:  # [B, N, V] -> [B, N] int32 argmax
    return p.argmax(-1).astype(np.int32)


RULES = {
    # name: (ref, kernel) taking (tokens, nt, ns, p, q, u, e)
    "greedy": (
        lambda t, a, s, p, q, u, e: verify_greedy_ref(t, a, s, _predict(p), max_depth=MAX_DEPTH),
        lambda t, a, s, p, q, u, e: verify_greedy_pallas(t, a, s, _predict(p), max_depth=MAX_DEPTH,
                                                         interpret=True),
    ),
    "target_only": (
        lambda t, a, s, p, q, u, e: verify_target_only_ref(t, a, s, p, u, e, max_depth=MAX_DEPTH),
        lambda t, a, s, p, q, u, e: verify_target_only_pallas(t, a, s, p, u, e, max_depth=MAX_DEPTH,
                                                              interpret=True),
    ),
    "rejection_one_hot": (
        lambda t, a, s, p, q, u, e: verify_rejection_ref(t, a, s, p, None, u, e, max_depth=MAX_DEPTH),
        lambda t, a, s, p, q, u, e: verify_rejection_pallas(t, a, s, p, None, u, e,
                                                            max_depth=MAX_DEPTH, interpret=True),
    ),
    "rejection_q": (
        lambda t, a, s, p, q, u, e: verify_rejection_ref(t, a, s, p, q, u, e, max_depth=MAX_DEPTH),
        lambda t, a, s, p, q, u, e: verify_rejection_pallas(t, a, s, p, q, u, e,
                                                            max_depth=MAX_DEPTH, interpret=True),
    ),
}


def _np(result):
    return tuple(np.asarray(x) for x in result)


@pytest.mark.parametrize("impl", ["ref", "kernel"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_out_of_vocab_draft_is_never_accepted(rule, shape, impl):
    tokens, nt, ns, padded, pnt, pns, p, q, u, e = make_case(shape)
    fn = RULES[rule][impl == "kernel"]
    got = _np(fn(tokens, nt, ns, p, q, u, e))
    acc, num, bonus = got
    emitted = np.asarray(emitted_tokens(tokens, got))

    # Positive control: the in-range id in the same node is accepted (for
    # greedy because argmax p[0] is GOOD, for the samplers because coin 0.1
    # is below p[0](GOOD) = 0.6).
    assert acc[0, 1] == BAD_NODE and num[0] >= 1, (rule, shape, got)
    assert GOOD in emitted[0]

    for row, bad in enumerate(BAD_IDS, start=1):
        assert BAD_NODE not in acc[row], (bad, acc[row])
        out = emitted[row][emitted[row] >= 0]
        assert len(out) == num[row] + 1 and bad not in out
        assert ((out >= 0) & (out < V)).all(), out
        assert 0 <= bonus[row] < V

    # Skipped exactly like padding: same paths and bonus as the padded tree.
    want = _np(RULES[rule][0](padded, pnt, pns, p, q, u, e))
    for g, w, name in zip(got, want, ("accept_index", "num_accepted", "bonus_token")):
        np.testing.assert_array_equal(g[1:], w[1:], err_msg=f"{name}: {rule} {shape} {impl}")


@pytest.mark.parametrize("rule", sorted(set(RULES) - {"greedy"}))
def test_sibling_after_out_of_vocab_draft_is_still_tested(rule):
    # In the tree, once node 1 is skipped the walk must go on to its sibling
    # node 2 (p[0] puts 0.3 on its token, coin 0.1), and accept it, as it
    # would after padding. Greedy stops instead: argmax p[0] is GOOD, not 7.
    tokens, nt, ns, _, _, _, p, q, u, e = make_case("tree")
    for fn in RULES[rule]:
        acc = np.asarray(fn(tokens, nt, ns, p, q, u, e).accept_index)
        assert (acc[1:, 1] == 2).all(), acc
