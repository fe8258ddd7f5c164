"""Paged attention for query blocks of up to MAX_QUERIES on XLA:CPU: the FFI kernel (paged_attention.cc).

Its references are `jaxspec.cache.attention.paged_attention_ref` (same
arguments, with the layer's pages sliced out of the whole cache) and, with an
in-flight block, `attention_with_block_ref`. Built and registered by
`jaxspec.native.build`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.native.build import ensure_registered

TARGET = "jaxspec_paged_attention"
# Longer blocks go to `cache.attention.paged_attention_blocked`. Up to here the kernel's two
# register-blocked GEMMs beat it (SmolLM2 prefill forwards on 2 cores, context ~460 unless noted,
# blocked -> native: 1 x 64 tokens 171 -> 121 ms, 8 x 64 1049 -> 760, 1 x 128 317 -> 234,
# 1 x 256 727 -> 724, 2 x 256 at ~1,460 1552 -> 1118 ms); its scratch holds a row's whole
# [T x group, context] logits, which bounds T.
MAX_QUERIES = 256


def paged_attention_native(
    q: jax.Array,  # [B, T, H, hd] float32
    cache_k: jax.Array,  # [L, P, page_size, kvh, hd] float32, the whole cache
    cache_v: jax.Array,  # [L, P, page_size, kvh, hd]
    layer: jax.Array | int,  # scalar: which layer's pages to read
    page_table: jax.Array,  # [B, max_pages] int32
    q_start: jax.Array,  # [B] int32 slot of the block's first query
    kv_len: jax.Array,  # [B] int32 valid slots after the block is written
    tree_mask: jax.Array | None = None,  # [B, T, T] bool; None = causal
    k_block: jax.Array | None = None,  # [B, T, kvh, hd]: the block's K/V, not in the cache (read-only use)
    v_block: jax.Array | None = None,  # [B, T, kvh, hd]
    *,
    scale: float,
) -> jax.Array:  # [B, T, H, hd]
    """With k_block/v_block: `attention_with_block_ref` semantics (kv_len = q_start + T);
    without: `paged_attention_ref` on the layer's pages."""
    ensure_registered()
    causal = tree_mask is None
    mask = jnp.zeros((1, 1, 1), bool) if causal else tree_mask.astype(bool)
    with_block = k_block is not None
    if with_block != (v_block is not None):
        raise ValueError("give both k_block and v_block, or neither")
    none = jnp.zeros((1,), jnp.float32)
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(
        q.astype(jnp.float32), cache_k, cache_v, jnp.asarray(layer, jnp.int32),
        page_table.astype(jnp.int32), q_start.astype(jnp.int32), kv_len.astype(jnp.int32), mask,
        k_block.astype(jnp.float32) if with_block else none, v_block.astype(jnp.float32) if with_block else none,
        scale=np.float32(scale), causal=causal, with_block=with_block,
    )
