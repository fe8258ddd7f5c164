"""The Mosaic TPU verify kernels (jaxspec.pallas.verify_tpu) without a TPU.

1. TPU interpret mode (`pltpu.InterpretParams`: the TPU interpreter, SMEM/VMEM/HBM
   and DMAs simulated on CPU): each kernel equals its jnp reference on one batch
   that mixes chains and trees, padding (-1) nodes, out-of-vocabulary draft ids,
   greedy (one-hot target) and sampled rows and a zero-mass residual, at a vocab
   (2500) that is not a multiple of 128 and spans several tiles.
2. Lowering for TPU from this CPU host at SmolLM2's shapes (V = 49152, 16 nodes,
   batch 8): the Pallas -> Mosaic rules accept the kernels (`tpu_custom_call`),
   and the public dispatchers pick them under `lowering_for("tpu")`.
3. The tree-build kernel, in TPU interpret mode, equals its reference.

Interpret-mode compiles dominate, so each kernel is compiled for one shape and fed
several value sets. On a TPU host the same tests compile the kernels for real
(interpret off) and hold them to the references.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import jaxspec.pallas.verify_tpu as vt
from jaxspec.pallas import lowering_for
from jaxspec.speculative import verify as V
from jaxspec.speculative.sampling import make_verify_noise
from tests.test_verify import assert_same, draft_like, peaked_probs, random_trees, retrieve_tables, steered_predict

# The TPU interpreter here; the compiled kernels on a TPU host.
INTERPRET = jax.default_backend() != "tpu"
B, N, VOCAB, MAX_DEPTH = 8, 10, 2500, 5
TILE_ROWS = 8  # 2500 -> 24 rows of 128 lanes -> 3 tiles of 8 rows
CHAIN_ROWS = (0, 1)  # rows whose draft is a chain
GREEDY_ROWS = (1, 2)  # rows with one-hot target probs (a greedy request in a sampled batch)
OOV_ROW = 4  # node 1 carries an id >= V, still linked
DEGENERATE_ROW = 5  # two root children drawn from p[0], the first with p = q = 0


def make_batch(seed: int):
    """(tokens, nt, ns, pred, p, q, u, e) for one [B, N] batch; the rows are described above."""
    rng = np.random.default_rng(seed)
    parents, tokens, _, _ = random_trees(rng, B, N, VOCAB)
    for r in CHAIN_ROWS:
        parents[r] = np.arange(-1, N - 1)
        tokens[r, 1:] = rng.integers(0, VOCAB, N - 1)
        tokens[r, N - 2:] = -1  # a shorter chain: trailing padding
    tokens[OOV_ROW, 1] = VOCAB + 7 if seed % 2 else 99_999_999
    parents[DEGENERATE_ROW] = [-1, 0, 0, 1] + [0] * (N - 4)
    tokens[DEGENERATE_ROW] = [3, 0, 5, 2] + [-1] * (N - 4)
    # Tables from the linked tokens (the out-of-vocabulary node stays linked).
    nt, ns = retrieve_tables(parents, np.where(tokens >= VOCAB, 0, tokens))
    p = peaked_probs(rng, np.where(tokens >= VOCAB, 0, tokens), nt, ns, VOCAB)
    q = draft_like(rng, p, parents)
    pred = steered_predict(rng, np.where(tokens >= VOCAB, 0, tokens), nt, ns, VOCAB)
    # Greedy chain row 1: the target agrees with its first 3 drafts, so every rule goes deep.
    pred[1, :3] = tokens[1, 1:4]
    pred[1, 3] = (tokens[1, 4] + 1) % VOCAB
    for r in GREEDY_ROWS:
        p[r] = np.eye(VOCAB, dtype=np.float32)[pred[r]]
    d = DEGENERATE_ROW
    p[d, 0, 0] = 0.0
    p[d, 0] /= p[d, 0].sum()
    q[d] = p[d, :1]
    u, e = make_verify_noise(jnp.arange(B) + 100 * seed, jnp.arange(B), N, VOCAB)
    u = np.asarray(u).copy()
    u[d] = 0.999
    return tokens, nt, ns, pred, p, q, u, np.asarray(e)


@pytest.fixture(scope="module")
def batches():
    return [make_batch(s) for s in (1, 2)]


def test_greedy_matches_reference(batches):
    for tokens, nt, ns, pred, *_ in batches:
        want = V.verify_greedy_ref(tokens, nt, ns, pred, max_depth=MAX_DEPTH)
        assert_same(vt.verify_greedy_tpu(tokens, nt, ns, pred, max_depth=MAX_DEPTH, interpret=INTERPRET), want)
        assert np.asarray(want.num_accepted).max() >= 2


def test_target_only_matches_reference(batches):
    # Per-request thresholds: lossless, aggressive and single-only rows.
    th_single = np.tile(np.float32([1.0, 0.3, 0.6, 1.0]), B // 4)
    th_acc = np.tile(np.float32([1.0, 0.5, 1.0, 0.8]), B // 4)
    for tokens, nt, ns, _, p, _, u, e in batches:
        want = V.verify_target_only_ref(tokens, nt, ns, p, u, e, th_single, th_acc, max_depth=MAX_DEPTH)
        got = vt.verify_target_only_tpu(tokens, nt, ns, p, u, e, th_single, th_acc, max_depth=MAX_DEPTH,
                                        interpret=INTERPRET, tile_rows=TILE_ROWS)
        assert_same(got, want)
        n = np.asarray(want.num_accepted)
        assert n.max() >= 2 and (n == 0).any()


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_matches_reference(batches, one_hot):
    for tokens, nt, ns, _, p, q, u, e in batches[: 1 if one_hot else 2]:
        draft = None if one_hot else q
        want = V.verify_rejection_ref(tokens, nt, ns, p, draft, u, e, max_depth=MAX_DEPTH)
        got = vt.verify_rejection_tpu(tokens, nt, ns, p, draft, u, e, max_depth=MAX_DEPTH,
                                      interpret=INTERPRET, tile_rows=TILE_ROWS)
        assert_same(got, want)
        acc = np.asarray(want.accept_index)
        assert np.asarray(want.num_accepted).max() >= 2
        assert (acc[OOV_ROW] != 1).all()  # the out-of-vocabulary node is never accepted
        if not one_hot:
            # The zero-mass residual restarts from p[0]: the second child is accepted.
            assert acc[DEGENERATE_ROW, 1] == 2


def test_vocab_layout():
    assert vt.vocab_layout(49152) == (384, 64)  # SmolLM2: no padding, 6 tiles
    assert vt.vocab_layout(2500, 8) == (24, 8)
    assert vt.vocab_layout(300) == (8, 8)
    assert vt.vocab_layout(128256) == (1008, 56)  # Llama-3: padded to 129024, 18 tiles
    for v in (1, 127, 1000, 151936):
        rows, tile = vt.vocab_layout(v)
        assert rows * 128 >= v and rows % 8 == 0 and rows % tile == 0 and tile % 8 == 0


# --------------------------------------------------------------------------
# Lowering for TPU from this host at realistic shapes
# --------------------------------------------------------------------------

LB, LN, LV, LD = 8, 16, 49152, 15  # SmolLM2 vocab, 16 draft nodes, batch 8
I32 = jax.ShapeDtypeStruct((LB, LN), jnp.int32)
PROBS = jax.ShapeDtypeStruct((LB, LN, LV), jnp.float32)
U = jax.ShapeDtypeStruct((LB, LN), jnp.float32)
E = jax.ShapeDtypeStruct((LB, LV), jnp.float32)


def _lower(fn, args, platform="tpu") -> str:
    with lowering_for(platform):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


LOWER_CASES = {
    "greedy": ("verify_greedy", (I32,) * 4,
               lambda k: lambda *a: k["greedy"](*a, max_depth=LD)),
    "target_only": ("verify_target_only", (I32, I32, I32, PROBS, U, E),
                    lambda k: lambda *a: k["target_only"](*a, max_depth=LD)),
    "rejection_one_hot": ("verify_rejection", (I32, I32, I32, PROBS, U, E),
                          lambda k: lambda t, a, s, p, u, e: k["rejection"](t, a, s, p, None, u, e, max_depth=LD)),
    "rejection": ("verify_rejection", (I32, I32, I32, PROBS, PROBS, U, E),
                  lambda k: lambda *a: k["rejection"](*a, max_depth=LD)),
}
KERNELS = {"greedy": vt.verify_greedy_tpu, "target_only": vt.verify_target_only_tpu,
           "rejection": vt.verify_rejection_tpu}
DISPATCHERS = {"greedy": V.verify_greedy, "target_only": V.verify_target_only, "rejection": V.verify_rejection}


@pytest.mark.parametrize("case", sorted(LOWER_CASES))
def test_kernels_lower_for_tpu_at_smollm2_shapes(case):
    name, args, make = LOWER_CASES[case]
    text = _lower(make(KERNELS), args)
    assert text.count("stablehlo.custom_call @tpu_custom_call") == 1
    assert f'kernel_name = "{name}"' in text


def _small(args):
    # The same arguments at a small vocab: routing does not depend on shapes.
    return tuple(jax.ShapeDtypeStruct(a.shape[:-1] + (300,), a.dtype) if a.shape[-1] == LV else a for a in args)


@pytest.mark.parametrize("case", sorted(LOWER_CASES))
def test_dispatchers_pick_mosaic_on_tpu_triton_on_cuda(case):
    """The public dispatchers, traced for TPU, call the Mosaic kernel (no jnp walk left); for
    CUDA the Triton one; on this CPU host the reference (no custom call at all)."""
    name, args, make = LOWER_CASES[case]
    args = _small(args)
    tpu = _lower(make(DISPATCHERS), args, "tpu")
    assert "tpu_custom_call" in tpu and f'kernel_name = "{name}"' in tpu and "triton" not in tpu
    assert "stablehlo.while" not in tpu  # the walk is inside the kernel, not left in HLO
    assert "__gpu$xla.gpu.triton" in _lower(make(DISPATCHERS), args, "cuda")
    cpu = _lower(make(DISPATCHERS), args, "cpu")
    assert "custom_call" not in cpu and "stablehlo.while" in cpu


# --------------------------------------------------------------------------
# Tree build (jaxspec.pallas.tree_build) in TPU interpret mode
# --------------------------------------------------------------------------


def test_tree_build_in_tpu_interpret_mode_matches_reference():
    from jaxspec.pallas.tree_build import build_tree_pallas
    from jaxspec.speculative.tree import build_tree_ref

    rng = np.random.default_rng(4)
    parents, tokens, _, _ = random_trees(rng, 3, 7, 50)
    parents[0], tokens[0, 5:] = np.arange(-1, 6), -1  # a chain with trailing padding
    prefix = np.int32([0, 5, 17])
    interpret = pltpu.InterpretParams() if INTERPRET else False
    got = build_tree_pallas(tokens, parents, prefix, max_kv=40, interpret=interpret, platform="tpu")
    want = build_tree_ref(tokens, parents, prefix, max_kv=40)
    for f in dataclasses.fields(want):
        g, w = getattr(got, f.name), getattr(want, f.name)
        assert (g is None) == (w is None), f.name
        if w is not None:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f.name)
