"""Paged attention as a Pallas kernel (Triton-lowered on GPU), one path for prefill,
decode and tree verification.

Semantics are those of `jaxspec.cache.attention.paged_attention_ref`: key slot `s`
is visible to query `t` of sequence `b` iff

    s < kv_len[b]  and  ( s < q_start[b]  or  block_mask[b, t, s - q_start[b]] )

with `block_mask` causal when `tree_mask` is None. One difference, by design: a row
that sees *no* slot (kv_len == 0, a padded batch row) is garbage in both; the
reference averages V over every gathered slot, the kernel returns zeros. Both are
finite, and nothing downstream reads such rows.

Kernel design
-------------
* Grid `(B, kv_heads, query_blocks)`. A program owns one sequence, one KV head and
  `block_q` query *rows*, where the rows of a KV group are its `T * group` (token,
  query head) pairs flattened token-major: row `r` is token `r // group`, head
  `r % group` of the group. So all query heads sharing a KV head ride one matmul,
  and K/V are read once per group, not once per query head.
* K/V stay where they are in HBM (`[P, page_size, kvh, hd]`, a squeezed BlockSpec
  picks the KV head); the page table row, `q_start` and `kv_len` come in as small
  blocks. The loop runs over key blocks of `block_k` *slots*, gathering each slot
  through the page table (`page = table[s // page_size]`, `offset = s % page_size`).
  Slot-granular gathers make every page size work the same way, page size 1
  included, and Triton lowers them to one pointer tensor just as it does for whole
  pages.
* The loop stops at the last key the block can see: `min(kv_len, q_start + last
  token + 1)` for causal blocks, `min(kv_len, q_start + T)` for trees, never at
  `max_pages`. Online softmax keeps a running max / sum / accumulator in f32.
* The tree mask is pre-expanded in the wrapper to rows and padded by `block_k`
  columns on both sides, so the kernel reads it with a `pl.ds` of static size at a
  clamped dynamic start, never with a data-dependent gather.

Padding rules (Triton needs power-of-two tensor dims, and tl.dot needs >= 16):
* rows `T * group` are padded to a multiple of `block_q`, a power of two >= 16;
* `block_k` is a power of two >= 16; the page table is padded with the null page
  so every loop block stays inside it;
* `head_dim` is padded to a power of two >= 16 with zeros. For q that is cheap; for
  the cache it is a full copy, so models whose head_dim is already a power of two
  (64, 128, 256) never pay it.

On CPU the kernel runs only with `interpret=True` (tests). On TPU the Triton path
cannot lower (vector gathers from refs), so `interpret=False` there raises and the
dispatcher (`jaxspec.cache.attention.paged_attention`) runs the Mosaic kernel with
DMA'd pages instead (`jaxspec.pallas.paged_attention_tpu`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas import target_platform

# Same value as the reference: finite, so fully masked key blocks never make NaN.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _attention_kernel(
    # inputs
    q_start_ref,  # [1] int32, this sequence's first query slot
    kv_len_ref,  # [1] int32, this sequence's valid slots
    page_table_ref,  # [max_pages_padded] int32, this sequence's table row
    q_ref,  # [block_q, hd] query rows of this (sequence, KV head, query block)
    k_ref,  # [P, page_size, hd] this KV head's pages
    v_ref,  # [P, page_size, hd]
    *rest,  # (tree_ref [block_q, T + 2 * block_k] int8,)? then o_ref [block_q, hd]
    scale: float,
    group: int,
    num_queries: int,
    block_k: int,
    num_key_blocks: int,
    has_tree: bool,
):
    if has_tree:
        tree_ref, o_ref = rest
    else:
        (o_ref,) = rest
    block_q, _ = q_ref.shape
    page_size = k_ref.shape[1]
    q_block = pl.program_id(2)
    q_start = q_start_ref[0]
    kv_len = kv_len_ref[0]

    # 1. Which token each row is, and the last key any row of this block may see.
    rows = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q, 1), 0)
    row_token = lax.div(rows, jnp.int32(group))  # [block_q, 1]
    if has_tree:
        # Tree masks are qlen-only: nothing past the block's own slots is visible.
        hi = jnp.minimum(kv_len, q_start + num_queries)
    else:
        last_row = jnp.minimum((q_block + 1) * block_q - 1, num_queries * group - 1)
        last_token = lax.div(last_row, jnp.int32(group))
        hi = jnp.minimum(kv_len, q_start + last_token + 1)
    num_iters = jnp.clip(pl.cdiv(hi, block_k), 0, num_key_blocks)

    q = q_ref[...]  # [block_q, hd]

    # 2. Online softmax over the key blocks the rows can see.
    def body(j, carry):
        acc, m_prev, l_prev = carry
        slots = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)  # [block_k]
        pages = page_table_ref[lax.div(slots, jnp.int32(page_size))]  # [block_k]
        offsets = lax.rem(slots, jnp.int32(page_size))
        k = k_ref[pages, offsets, :]  # [block_k, hd] gathered through the table
        v = v_ref[pages, offsets, :]

        # f32 logits, scaled after the dot as the reference does.
        logits = plgpu.dot(q, k, trans_b=True) * scale  # [block_q, block_k]

        rel = slots[None, :] - q_start  # [1, block_k] slot index inside the new block
        if has_tree:
            # Column c of the padded mask is rel = c - block_k; the clamp only moves
            # the window where every column is decided by `rel < 0` or is False.
            start = jnp.clip(j * block_k - q_start + block_k, 0, num_queries + block_k)
            in_block = tree_ref[:, pl.ds(start, block_k)] != 0  # [block_q, block_k]
            visible = (rel < 0) | in_block
        else:
            visible = rel <= row_token
        visible = visible & (slots[None, :] < kv_len)
        logits = jnp.where(visible, logits, _MASK_VALUE)

        m_next = jnp.maximum(m_prev, logits.max(axis=-1))  # [block_q]
        correction = jnp.exp(m_prev - m_next)
        p = jnp.exp(logits - m_next[:, None])  # [block_q, block_k]
        l_next = correction * l_prev + p.sum(axis=-1)
        acc = correction[:, None] * acc + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_next, l_next

    acc = jnp.zeros(o_ref.shape, jnp.float32)
    # Below _MASK_VALUE, so the first block's correction is exp(-huge) = 0, not NaN.
    m = jnp.full((block_q,), jnp.finfo(jnp.float32).min, jnp.float32)
    l = jnp.zeros((block_q,), jnp.float32)
    acc, m, l = lax.fori_loop(0, num_iters, body, (acc, m, l))

    # 3. Normalise. l == 0 only when the loop never ran (kv_len == 0): output zeros.
    l = jnp.where(l == 0.0, 1.0, l)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def check_shapes(q, k_pages, v_pages, page_table, q_start, kv_len, tree_mask) -> None:
    """ValueError naming the first argument whose shape disagrees with q [B, T, H, hd] (shared by the
    Triton and Mosaic kernels)."""
    b, t, h, hd = q.shape
    kvh, hd_k = k_pages.shape[2:]
    if hd_k != hd or v_pages.shape != k_pages.shape:
        raise ValueError(f"q {q.shape}, k_pages {k_pages.shape}, v_pages {v_pages.shape} disagree")
    if h % kvh:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} KV heads")
    if page_table.shape[0] != b or q_start.shape != (b,) or kv_len.shape != (b,):
        raise ValueError("page_table, q_start and kv_len must have the batch size of q")
    if tree_mask is not None and tree_mask.shape != (b, t, t):
        raise ValueError(f"tree_mask must be {(b, t, t)}, got {tree_mask.shape}")


@functools.partial(
    jax.jit,
    static_argnames=("scale", "interpret", "block_q", "block_k", "num_warps", "num_stages"),
)
def paged_attention_pallas(
    q: jax.Array,  # [B, T, H, hd]
    k_pages: jax.Array,  # [P, page_size, kvh, hd] one layer of the cache
    v_pages: jax.Array,  # [P, page_size, kvh, hd]
    page_table: jax.Array,  # [B, max_pages] int32, null page (0) past each sequence
    q_start: jax.Array,  # [B] int32 slot of the block's first query
    kv_len: jax.Array,  # [B] int32 valid slots after the block is written
    tree_mask: jax.Array | None = None,  # [B, T, T] bool, qlen-only; None = causal
    *,
    scale: float,
    interpret: bool = False,
    block_q: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> jax.Array:  # [B, T, H, hd]
    b, t, h, hd = q.shape
    num_pages, page_size, kvh, hd_k = k_pages.shape
    max_pages = page_table.shape[1]
    check_shapes(q, k_pages, v_pages, page_table, q_start, kv_len, tree_mask)
    if not interpret and target_platform() == "tpu":
        # The Triton path's ref gathers do not lower on Mosaic TPU (module doc). The
        # fallback is the dispatcher's (jaxspec.cache.attention.paged_attention), so
        # this kernel never imports its reference.
        raise NotImplementedError(
            "paged_attention_pallas does not run on TPU; call "
            "jaxspec.cache.attention.paged_attention, which runs the Mosaic kernel there"
        )
    group = h // kvh

    # 1. Static block sizes: powers of two, >= 16 (tl.dot), rows padded to block_q.
    rows = t * group
    bq = max(16, min(_next_pow2(block_q), _next_pow2(rows)))
    rows_p = _round_up(rows, bq)
    bk = max(16, _next_pow2(block_k))
    hd_p = max(16, _next_pow2(hd))
    num_key_blocks = -(-max_pages * page_size // bk)
    # Every slot of the last loop block must index inside the table: pad with page 0.
    table_len = -(-num_key_blocks * bk // page_size)

    # 2. q to [B, kvh, rows, hd]: a group's query heads become rows of one matmul.
    qg = q.reshape(b, t, kvh, group, hd).transpose(0, 2, 1, 3, 4).reshape(b, kvh, rows, hd)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows_p - rows), (0, hd_p - hd)))
    if hd_p != hd:  # A full cache copy; only non-power-of-two head dims pay it.
        pad = ((0, 0), (0, 0), (0, 0), (0, hd_p - hd))
        k_pages, v_pages = jnp.pad(k_pages, pad), jnp.pad(v_pages, pad)
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, table_len - max_pages)))

    # 3. Block specs. Index maps take the grid indices (b, kv head, query block).
    in_specs = [
        pl.BlockSpec((1,), lambda bi, hi, qi: (bi,)),  # q_start
        pl.BlockSpec((1,), lambda bi, hi, qi: (bi,)),  # kv_len
        pl.BlockSpec((pl.squeezed, table_len), lambda bi, hi, qi: (bi, 0)),  # page table
        pl.BlockSpec((pl.squeezed, pl.squeezed, bq, hd_p), lambda bi, hi, qi: (bi, hi, qi, 0)),
        # The whole page pool of one KV head; the kernel gathers the pages it needs.
        pl.BlockSpec((num_pages, page_size, pl.squeezed, hd_p), lambda bi, hi, qi: (0, 0, hi, 0)),
        pl.BlockSpec((num_pages, page_size, pl.squeezed, hd_p), lambda bi, hi, qi: (0, 0, hi, 0)),
    ]
    args = [q_start.astype(jnp.int32), kv_len.astype(jnp.int32), table, qg, k_pages, v_pages]
    if tree_mask is not None:
        # Rows r = token * group + head share their token's mask row; bk zero columns
        # each side make every clamped window of width bk land inside the array.
        tm = jnp.repeat(tree_mask.astype(jnp.int8), group, axis=1)  # [B, rows, T]
        tm = jnp.pad(tm, ((0, 0), (0, rows_p - rows), (bk, bk)))  # [B, rows_p, T + 2 bk]
        in_specs.append(
            pl.BlockSpec((pl.squeezed, bq, t + 2 * bk), lambda bi, hi, qi: (bi, qi, 0))
        )
        args.append(tm)

    kernel = functools.partial(
        _attention_kernel,
        scale=float(scale),
        group=group,
        num_queries=t,
        block_k=bk,
        num_key_blocks=num_key_blocks,
        has_tree=tree_mask is not None,
    )
    out = pl.pallas_call(
        kernel,
        grid=(b, kvh, rows_p // bq),
        in_specs=in_specs,
        out_specs=pl.BlockSpec(
            (pl.squeezed, pl.squeezed, bq, hd_p), lambda bi, hi, qi: (bi, hi, qi, 0)
        ),
        out_shape=jax.ShapeDtypeStruct((b, kvh, rows_p, hd_p), q.dtype),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="jaxspec_paged_attention",
    )(*args)

    # 4. Back to [B, T, H, hd].
    out = out[:, :, :rows, :hd].reshape(b, kvh, t, group, hd).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, h, hd)
