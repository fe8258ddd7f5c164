"""Attention over the paged KV cache: the jnp reference, and the dispatcher.

One function covers the three cases, because they differ only in the mask:

* prefill: a block of T prompt tokens per sequence, causal, ragged lengths;
* decode: T = 1;
* tree verification: T draft-tree nodes with a custom (qlen-only) mask.

The new block's K/V are already written to the cache at logical slots
`q_start[b] + t`. Key slot `s` is visible to query `t` of sequence `b` iff

    s < kv_len[b]  and  ( s < q_start[b]                          # committed prefix
                          or block_mask[b, t, s - q_start[b]] )   # inside the block

where `block_mask` is causal (`j <= t`) when no tree mask is given. Queries at
padding positions still see slot 0 at least, so every row stays finite.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxspec import pallas as kernels

# Large but finite: a fully masked row (padding) must not produce NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# A causal block longer than this (a prefill chunk) runs `paged_attention_blocked` on CPU: its
# while_loop pays per key block, a price a decode step's few queries do not recoup.
BLOCKED_MIN_QUERIES = 32


def gather_pages(
    pages: jax.Array,  # [P, page_size, kvh, hd] one layer of the cache
    page_table: jax.Array,  # [B, max_pages] int32
) -> jax.Array:  # [B, max_pages * page_size, kvh, hd]
    b, max_pages = page_table.shape
    _, page_size, kvh, hd = pages.shape
    return pages[page_table].reshape(b, max_pages * page_size, kvh, hd)


def visibility_mask(
    q_start: jax.Array,  # [B] int32
    kv_len: jax.Array,  # [B] int32
    num_queries: int,
    num_slots: int,
    tree_mask: jax.Array | None = None,  # [B, T, T] bool, qlen-only
) -> jax.Array:  # [B, T, S] bool
    slots = jnp.arange(num_slots, dtype=jnp.int32)[None, None, :]
    t = jnp.arange(num_queries, dtype=jnp.int32)[None, :, None]
    rel = slots - q_start[:, None, None]  # slot index inside the new block
    if tree_mask is None:
        in_block = rel <= t
    else:
        rel_c = jnp.clip(rel, 0, num_queries - 1)
        in_block = jnp.take_along_axis(
            tree_mask, jnp.broadcast_to(rel_c, (tree_mask.shape[0], num_queries, num_slots)), axis=2
        )
        in_block = in_block & (rel < num_queries)
    visible = (rel < 0) | in_block
    return visible & (slots < kv_len[:, None, None])


def paged_attention_ref(
    q: jax.Array,  # [B, T, H, hd]
    k_pages: jax.Array,  # [P, page_size, kvh, hd]
    v_pages: jax.Array,  # [P, page_size, kvh, hd]
    page_table: jax.Array,  # [B, max_pages] int32
    q_start: jax.Array,  # [B] int32 slot of the block's first query
    kv_len: jax.Array,  # [B] int32 valid slots after the block is written
    tree_mask: jax.Array | None = None,  # [B, T, T] bool
    *,
    scale: float,
) -> jax.Array:  # [B, T, H, hd]
    b, t, h, hd = q.shape
    kvh = k_pages.shape[2]
    group = h // kvh
    k = gather_pages(k_pages, page_table)  # [B, S, kvh, hd]
    v = gather_pages(v_pages, page_table)
    s = k.shape[1]
    qg = q.reshape(b, t, kvh, group, hd)
    # f32 logits and softmax whatever the cache dtype: bf16 softmax loses exactness.
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    visible = visibility_mask(q_start, kv_len, t, s, tree_mask)  # [B, T, S]
    logits = jnp.where(visible[:, None, None], logits, _MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, hd).astype(q.dtype)


def paged_attention_blocked(
    q: jax.Array,  # [B, T, H, hd]
    k_pages: jax.Array,  # [P, page_size, kvh, hd]
    v_pages: jax.Array,  # [P, page_size, kvh, hd]
    page_table: jax.Array,  # [B, max_pages] int32
    q_start: jax.Array,  # [B] int32
    kv_len: jax.Array,  # [B] int32
    *,
    scale: float,
    block_pages: int = 16,
) -> jax.Array:  # [B, T, H, hd]
    """`paged_attention_ref` with a causal block, reading only the key blocks some row needs.

    A prefill call's page table is as wide as its context bucket (2048 slots for a turn late in a
    conversation), and the reference scores every slot of it: a 64-token cache-hit chunk at slot
    900 paid for 2048 keys. Here a `while_loop` runs over blocks of `block_pages` pages, as many as
    the longest row's kv_len needs, with the online softmax (running max, running sum) of flash
    attention. Rows of one call share the trip count; slots past a row's kv_len are masked as in
    the reference. Equal to it up to float summation order (tests/test_paged_attention.py)."""
    b, t, h, hd = q.shape
    _, page_size, kvh, _ = k_pages.shape
    group = h // kvh
    max_pages = page_table.shape[1]
    block_pages = min(block_pages, max_pages)
    # 1. Pad the table to whole blocks; the pad points at page 0 and is masked by kv_len.
    num_blocks = -(-max_pages // block_pages)
    table = jnp.pad(page_table, ((0, 0), (0, num_blocks * block_pages - max_pages)))
    width = block_pages * page_size
    qg = q.reshape(b, t, kvh, group, hd).astype(jnp.float32)
    trips = jnp.clip(-(-jnp.max(kv_len) // width), 1, num_blocks)

    def body(carry):
        # 2. One block: scores, the causal / length mask, then the online-softmax update.
        j, m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(table, j * block_pages, block_pages, axis=1)  # [B, bp]
        k, v = gather_pages(k_pages, pages), gather_pages(v_pages, pages)  # [B, W, kvh, hd]
        logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
        # The reference's mask, with slots counted from this block's first.
        visible = visibility_mask(q_start - j * width, kv_len - j * width, t, width)  # [B, T, W]
        logits = jnp.where(visible[:, None, None], logits, _MASK_VALUE)
        m_new = jnp.maximum(m, logits.max(-1))
        p = jnp.exp(logits - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + jnp.einsum("bkgts,bskd->bkgtd", p, v.astype(jnp.float32),
                                                  preferred_element_type=jnp.float32)
        return j + 1, m_new, l, acc

    init = (jnp.int32(0), jnp.full((b, kvh, group, t), _MASK_VALUE, jnp.float32),
            jnp.zeros((b, kvh, group, t), jnp.float32), jnp.zeros((b, kvh, group, t, hd), jnp.float32))
    _, _, l, acc = jax.lax.while_loop(lambda c: c[0] < trips, body, init)
    # 3. Normalise; [B, kvh, g, T, hd] -> [B, T, H, hd].
    out = acc / l[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, hd).astype(q.dtype)


def attention_with_block_ref(
    q: jax.Array,  # [B, T, H, hd]
    k_pages: jax.Array,  # [P, page_size, kvh, hd] one layer, read only
    v_pages: jax.Array,  # [P, page_size, kvh, hd]
    page_table: jax.Array,  # [B, max_pages] int32
    q_start: jax.Array,  # [B] int32: cache slots < q_start are the visible prefix
    k_block: jax.Array,  # [B, T, kvh, hd] the block's own keys, not in the cache
    v_block: jax.Array,  # [B, T, kvh, hd]
    tree_mask: jax.Array | None = None,  # [B, T, T] bool; None = causal
    *,
    scale: float,
) -> jax.Array:  # [B, T, H, hd]
    """Attention over the cached prefix plus an in-flight block that is not written yet.

    Same result as writing the block at slots q_start.. and calling
    `paged_attention_ref`, but the cache is only read, so a caller can choose the
    block width under `lax.switch` without the cache becoming a branch output
    (which makes XLA copy it).
    """
    b, t, h, hd = q.shape
    kvh = k_pages.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, hd)
    k = gather_pages(k_pages, page_table)
    v = gather_pages(v_pages, page_table)
    s = k.shape[1]
    pre = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    prefix_visible = jnp.arange(s, dtype=jnp.int32)[None, :] < q_start[:, None]  # [B, S]
    pre = jnp.where(prefix_visible[:, None, None, None, :], pre, _MASK_VALUE)
    blk = jnp.einsum("btkgd,bukd->bkgtu", qg, k_block, preferred_element_type=jnp.float32) * scale
    if tree_mask is None:
        tree_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    blk = jnp.where(tree_mask[:, None, None], blk, _MASK_VALUE)
    probs = jax.nn.softmax(jnp.concatenate([pre, blk], axis=-1), axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs[..., :s].astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out + jnp.einsum("bkgtu,bukd->btkgd", probs[..., s:].astype(v_block.dtype), v_block,
                           preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, hd).astype(q.dtype)


def paged_attention(
    q: jax.Array,  # [B, T, H, hd]
    k_pages: jax.Array,  # [P, page_size, kvh, hd]
    v_pages: jax.Array,  # [P, page_size, kvh, hd]
    page_table: jax.Array,  # [B, max_pages] int32
    q_start: jax.Array,  # [B] int32
    kv_len: jax.Array,  # [B] int32
    tree_mask: jax.Array | None = None,  # [B, T, T] bool; None = causal
    *,
    scale: float,
) -> jax.Array:  # [B, T, H, hd]
    """Dispatch: the Mosaic kernel on TPU, the Triton kernel on GPU; on CPU `paged_attention_blocked`
    for a causal block of more than BLOCKED_MIN_QUERIES queries, else the jnp reference.

    Interpret mode (`JAXSPEC_KERNELS=interpret`) runs the Triton kernel, as before;
    the Mosaic kernel's interpret-mode tests call it directly. Under a ("data",
    "model") mesh in context (`sharding.mesh_context`) either kernel runs per shard
    through shard_map (Mosaic calls must); GSPMD partitions the reference by itself."""
    backend = kernels.kernel_backend()
    if backend == "tpu":
        from jaxspec.pallas.paged_attention_tpu import paged_attention_mosaic

        kernel = functools.partial(paged_attention_mosaic, scale=scale)
    elif kernels.use_kernel(platforms=("gpu",)):
        from jaxspec.pallas.paged_attention import paged_attention_pallas

        kernel = functools.partial(paged_attention_pallas, scale=scale, interpret=kernels.interpret_mode())
    elif tree_mask is None and q.shape[1] > BLOCKED_MIN_QUERIES:
        return paged_attention_blocked(q, k_pages, v_pages, page_table, q_start, kv_len, scale=scale)
    else:
        return paged_attention_ref(q, k_pages, v_pages, page_table, q_start, kv_len, tree_mask, scale=scale)
    from jaxspec.pallas.shard import shard_kernel_attention

    return shard_kernel_attention(kernel, q, k_pages, v_pages, page_table, q_start, kv_len, tree_mask)
