"""Attention over the cached prefix + an unwritten block == writing the block, then attending."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache.attention import attention_with_block_ref, paged_attention_ref
from jaxspec.cache.paged import slot_to_page


@pytest.mark.parametrize("page_size, tree", [(1, False), (4, True), (16, True)])
def test_block_attention_equals_write_then_attend(page_size, tree):
    rng = np.random.default_rng(page_size)
    b, t, h, kvh, hd, maxp = 3, 5, 6, 2, 8, 64 // page_size
    pages = 1 + b * maxp
    k_pages = jnp.asarray(rng.normal(size=(pages, page_size, kvh, hd)), jnp.float32)
    v_pages = jnp.asarray(rng.normal(size=(pages, page_size, kvh, hd)), jnp.float32)
    page_table = jnp.asarray(1 + rng.permutation(b * maxp).reshape(b, maxp), jnp.int32)
    q_start = jnp.array([0, 7, 40], jnp.int32)
    q = jnp.asarray(rng.normal(size=(b, t, h, hd)), jnp.float32)
    k_blk = jnp.asarray(rng.normal(size=(b, t, kvh, hd)), jnp.float32)
    v_blk = jnp.asarray(rng.normal(size=(b, t, kvh, hd)), jnp.float32)
    mask = None
    if tree:
        parents = [-1, 0, 0, 1, 2]
        m = np.zeros((t, t), bool)
        for i in range(t):
            j = i
            while j >= 0:
                m[i, j] = True
                j = parents[j]
        mask = jnp.broadcast_to(jnp.asarray(m), (b, t, t))
    got = attention_with_block_ref(q, k_pages, v_pages, page_table, q_start, k_blk, v_blk, mask, scale=0.3)
    slots = q_start[:, None] + jnp.arange(t)[None]
    pg, off = slot_to_page(page_table, slots, page_size)
    kw, vw = k_pages.at[pg, off].set(k_blk), v_pages.at[pg, off].set(v_blk)
    want = paged_attention_ref(q, kw, vw, page_table, q_start, q_start + t, mask, scale=0.3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
