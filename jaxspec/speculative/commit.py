"""KV commit after verification (SGLang `move_accept_tokens_to_target_kvcache`).

During verification node i of the tree is written at slot `seq_len + i`. The
accepted path (accept_index, see the convention in `jaxspec.speculative.verify`) must
end up contiguous: node accept_index[d] moves to slot `seq_len + d`. Slots past
the new length keep stale values; they are never visible (attention masks by
length) and the next verify overwrites them, so no page is lost or leaked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.cache.paged import NULL_PAGE, KVCache, slot_to_page


def commit_accepted_kv(
    cache: KVCache,
    page_table: jax.Array,  # [B, max_pages] int32
    seq_lens: jax.Array,  # [B] int32 committed length before this verify (root slot)
    accept_index: jax.Array,  # [B, D + 1] int32 accepted path, -1 padded
    num_accepted: jax.Array,  # [B] int32 accepted drafts
) -> KVCache:
    """Move the accepted nodes' K/V (all layers) to the next contiguous slots."""
    b, width = accept_index.shape
    depth = jnp.arange(width, dtype=jnp.int32)[None, :]
    keep = depth <= num_accepted[:, None]
    src_pages, src_off = slot_to_page(page_table, seq_lens[:, None] + jnp.maximum(accept_index, 0), cache.page_size)
    dst_pages, dst_off = slot_to_page(page_table, seq_lens[:, None] + depth, cache.page_size)
    # Nodes already in place (and the padding) write to the null page instead:
    # a no-op for chains, where accept_index[d] == d.
    moved = keep & (accept_index != depth)
    dst_pages = jnp.where(moved, dst_pages, NULL_PAGE)
    # Gather everything before scattering: a destination may be another node's source.
    k_src = cache.k[:, src_pages, src_off]  # [L, B, D+1, kvh, hd]
    v_src = cache.v[:, src_pages, src_off]
    return KVCache(
        k=cache.k.at[:, dst_pages, dst_off].set(k_src),
        v=cache.v.at[:, dst_pages, dst_off].set(v_src),
    )
