"""The Mosaic TPU paged-attention kernel, proven without a TPU.

1. TPU interpret mode on CPU (`pltpu.InterpretParams`: DMAs and semaphores
   simulated, reads done at wait time) equals the jnp reference: causal and tree
   masks, page sizes 1 and 16, GQA, ragged rows, a row with no cached keys,
   several query blocks and key blocks (so the double buffer turns over).
2. The kernel lowers for TPU from this host (Mosaic's block-shape rules run at
   lowering) on SmolLM2's shapes and their TP-padded per-shard shapes.
3. The dispatcher picks it on TPU, and only there.

Each interpret-mode shape costs a compile of several seconds, so one batch per
test carries every kind of row, and shapes repeat wherever they can.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec.pallas as kernels
from jaxspec.cache.attention import paged_attention
from jaxspec.pallas.paged_attention_tpu import paged_attention_mosaic
from tests.test_paged_attention import F32_TOL, make_case, ref_jit, run_both

# Per row: a fresh prompt, a chunk after 13 slots ending in padding rows, a full
# chunk after 31 (neither prefix page aligned), and a row with no keys at all.
ROWS = dict(q_start=[0, 13, 31, 0], n_new=[12, 5, 12, 0])


def _mosaic(**kw):
    def run(*args, scale, **_):
        return paged_attention_mosaic(*args, scale=scale, interpret=True, **kw)
    return run


def _compare(monkeypatch, case, scale, **kernel_kw):
    # run_both calls the Triton wrapper by name; swap in this kernel, same checks.
    import tests.test_paged_attention as tpa

    monkeypatch.setattr(tpa, "paged_attention_pallas", _mosaic(**kernel_kw))
    return run_both(case, scale)


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_interpret_matches_reference(monkeypatch, tree, page_size):
    """GQA 4 q / 2 kv heads; T = 12 -> 24 rows = 2 query blocks of 16 (the last padded);
    key blocks of 4 (page size 1) or 16 slots, so every row walks several of them."""
    rng = np.random.default_rng(10 * page_size + tree)
    max_pages = -(-43 // page_size) + 1  # a spare null entry at the end of every row
    case = make_case(rng, **ROWS, t=12, kvh=2, group=2, hd=16, page_size=page_size,
                     max_pages=max_pages, tree=tree)
    got, want = _compare(monkeypatch, case, 0.25, block_q=16, pages_per_block=4 if page_size == 1 else 1)
    np.testing.assert_allclose(got, want, **F32_TOL)
    # The no-key row (kv_len == 0) comes back as exact zeros, as from the Triton kernel.
    raw = paged_attention_mosaic(case["q"], case["k_pages"], case["v_pages"], case["page_table"],
                                 case["q_start"], case["kv_len"], case["tree_mask"], scale=0.25,
                                 interpret=True, block_q=16, pages_per_block=4 if page_size == 1 else 1)
    assert not np.asarray(raw[3]).any()


def test_interpret_decode_smollm2_heads(monkeypatch):
    """Decode (T = 1) with SmolLM2's grouping (9 q / 3 kv heads, group 3), bf16,
    default block sizes (a key block spans the whole 3-page table)."""
    rng = np.random.default_rng(7)
    case = make_case(rng, q_start=[0, 16, 39, 0], n_new=[1, 1, 1, 0], t=1, kvh=3, group=3, hd=16,
                     page_size=16, max_pages=3, dtype=jnp.bfloat16)
    got, want = _compare(monkeypatch, case, 0.25)
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


S = jax.ShapeDtypeStruct


def _lower_for_tpu(fn, b, t, h, kvh, hd, page_size, max_pages, tree, dtype=jnp.bfloat16) -> str:
    num_pages = b * max_pages + 1
    args = [S((b, t, h, hd), dtype), S((num_pages, page_size, kvh, hd), dtype),
            S((num_pages, page_size, kvh, hd), dtype), S((b, max_pages), jnp.int32),
            S((b,), jnp.int32), S((b,), jnp.int32), S((b, t, t), jnp.bool_) if tree else None]
    f = jax.jit(lambda *a: fn(*a, scale=hd**-0.5))
    with kernels.lowering_for("tpu"):
        return f.trace(*args).lower(lowering_platforms=("tpu",)).as_text()


# (q heads, kv heads): SmolLM2 whole, and its TP-padded shards (12 / 4 heads split
# over TP 2 -> 6 / 2, over TP 4 -> 3 / 1).
HEADS = {"smollm2": (9, 3), "tp2_shard": (6, 2), "tp4_shard": (3, 1)}
# (T, tree): a 32-token prefill chunk, decode, a 16-node verify tree.
BLOCKS = {"prefill": (32, False), "decode": (1, False), "tree": (16, True)}


@pytest.mark.parametrize("block", sorted(BLOCKS))
@pytest.mark.parametrize("heads", sorted(HEADS))
def test_lowers_to_mosaic_for_tpu(heads, block):
    """head_dim 64, page size 16, bf16, 256-slot context: a real Mosaic custom call."""
    (h, kvh), (t, tree) = HEADS[heads], BLOCKS[block]
    text = _lower_for_tpu(paged_attention_mosaic, 4, t, h, kvh, 64, 16, 16, tree)
    assert text.count("tpu_custom_call") == 1
    assert "jaxspec_paged_attention_tpu" in text


def test_lowers_with_page_size_one():
    text = _lower_for_tpu(paged_attention_mosaic, 2, 8, 9, 3, 64, 1, 64, True)
    assert text.count("tpu_custom_call") == 1


def test_dispatch_chooses_mosaic_on_tpu_only():
    """Through the public dispatcher: Mosaic when lowering for TPU, plain HLO for CPU."""
    tpu = _lower_for_tpu(paged_attention, 2, 4, 9, 3, 64, 16, 4, True)
    assert "tpu_custom_call" in tpu and "jaxspec_paged_attention_tpu" in tpu
    args = [S((2, 4, 9, 64), jnp.float32), S((9, 16, 3, 64), jnp.float32), S((9, 16, 3, 64), jnp.float32),
            S((2, 4), jnp.int32), S((2,), jnp.int32), S((2,), jnp.int32), None]
    cpu = jax.jit(lambda *a: paged_attention(*a, scale=0.125)).trace(*args).lower().as_text()
    assert "custom_call" not in cpu


def test_dispatch_runs_mosaic_kernel_on_tpu(monkeypatch):
    """kernel_backend() == "tpu" routes to the Mosaic kernel; "gpu" still to Triton."""
    import jaxspec.pallas.paged_attention as triton_mod
    import jaxspec.pallas.paged_attention_tpu as mosaic_mod

    called = []
    monkeypatch.setattr(mosaic_mod, "paged_attention_mosaic", lambda *a, **k: called.append("tpu") or a[0])
    monkeypatch.setattr(triton_mod, "paged_attention_pallas", lambda *a, **k: called.append("gpu") or a[0])
    q = jnp.zeros((1, 1, 2, 16))
    pages = jnp.zeros((2, 4, 1, 16))
    args = (q, pages, pages, jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32))
    for backend in ("tpu", "gpu"):
        monkeypatch.setattr(kernels, "kernel_backend", lambda b=backend: b)
        paged_attention(*args, scale=0.25)
    assert called == ["tpu", "gpu"]
