"""Paged attention as a Mosaic TPU Pallas kernel: prefill chunks, decode and tree verify.

Semantics are those of `jaxspec.cache.attention.paged_attention_ref` (and of the
Triton kernel in `jaxspec.pallas.paged_attention`): key slot `s` is visible to
query `t` of sequence `b` iff

    s < kv_len[b]  and  ( s < q_start[b]  or  block_mask[b, t, s - q_start[b]] )

with `block_mask` causal when `tree_mask` is None. As in the Triton kernel, a row
that sees no slot at all (kv_len == 0) returns zeros where the reference returns
a finite average; nothing downstream reads such rows.

This one kernel runs every case on TPU. JAX's `ragged_paged_attention` covers
causal ragged prefill/decode, but not tree masks, and it wants K and V
interleaved in one `[P, page_size, 2 * kvh, hd]` pool with a head count XLA
tiles fully (SmolLM2's 3 KV heads are refused); converting this cache to that
layout would copy it every step. So it is not used for any case.

Kernel design
-------------
* Grid `(B, query_blocks)`, both "parallel": a program owns one sequence and
  `block_q` query *rows* of every KV head. Rows of a KV head are its
  `T * group` (token, query head) pairs token-major (row `r` is token
  `r // group`), so the GQA group rides one `[block_q, hd] x [hd, block_k]`
  matmul per KV head and each page is read once per program, not per q head.
* `q_start`, `kv_len` and the page table are scalar-prefetched into SMEM
  (`PrefetchScalarGridSpec`); K/V stay in HBM (`memory_space=pl.ANY`). A key block
  is `pages_per_block` whole pages, each DMA'd `k_hbm[page] -> vmem[slot, i]`
  (whole `[page_size, kvh, hd]` pages: the window spans the full minor dims, so
  it is legal for any head count and needs no tile-aligned head slicing).
  Two VMEM slots double-buffer: block j+1's copies are started before block j
  is waited on and used. Copies of one slot signal one DMA semaphore per K / V.
* The key loop stops at the last slot the block can see: `min(kv_len, q_start +
  last token + 1)` causal, `min(kv_len, q_start + T)` for trees. Online softmax
  keeps max / sum (lane-replicated `[block_q, 128]`) and the f32 accumulator in
  VMEM scratch per KV head; the output is written once at the end.
* The tree mask never needs a dynamic lane slice (Mosaic has none): the
  wrapper expands it to rows `[B, rows, T]` (padded to 128 lanes), and the
  kernel maps block positions to the key block's slots with a one-hot matmul,
  `mask[rows, T] @ onehot[T, block_k]`, so the result has the KV axis on lanes.
  0/1 values in bf16 with f32 accumulation are exact.
* V of slots past `kv_len` is zeroed before `p @ v`: those slots hold whatever
  the page (often the null page) holds, and 0 * NaN would poison the row.

Mosaic block rules: the q / out blocks are `(kvh, block_q, hd)` with block_q a
multiple of 16 (bf16 sublane packing) and `hd` the full dim; the tree-mask
block is `(block_q, T_pad)` with T_pad a multiple of 128; K/V are not blocked.

On CPU the kernel runs with `interpret=True` (TPU interpret mode,
`pltpu.InterpretParams`, which simulates the DMAs and semaphores); the dispatcher
(`jaxspec.cache.attention.paged_attention`) chooses it on TPU only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxspec.pallas.paged_attention import _MASK_VALUE, _round_up, check_shapes

_LANES = 128
# Sublane multiple for every blocked second-minor dim: 8 rows of f32, 16 of bf16.
_SUBLANES = 16


def default_pages_per_block(page_size: int) -> int:
    """Pages per key block: 128 slots (one lane tile of logits), at least one page."""
    return max(1, _LANES // page_size)


def _kernel(
    # scalar prefetch (SMEM)
    q_start_ref,  # [B] int32 slot of each block's first query
    kv_len_ref,  # [B] int32 valid slots
    table_ref,  # [B, table_len] int32 page table, null-padded to whole key blocks
    # inputs
    q_ref,  # [kvh, block_q, hd] query rows of this (sequence, query block)
    k_hbm,  # [P, page_size, kvh, hd] in HBM
    v_hbm,  # [P, page_size, kvh, hd] in HBM
    *rest,  # (tree_ref [block_q, T_pad] bf16,)? o_ref [kvh, block_q, hd], then scratch
    scale: float,
    group: int,
    num_queries: int,
    num_rows: int,
    pages_per_block: int,
    has_tree: bool,
):
    if has_tree:
        tree_ref, o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref = rest
    else:
        tree_ref = None
        o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref = rest
    kvh, block_q, hd = q_ref.shape
    page_size = k_buf.shape[2]
    block_k = pages_per_block * page_size
    b, q_block = pl.program_id(0), pl.program_id(1)
    q_start = q_start_ref[b]
    kv_len = kv_len_ref[b]

    # 1. The last slot any row of this block may see, and so the key blocks to visit.
    if has_tree:
        # Tree masks are qlen-only: nothing past the block's own slots is visible.
        hi = jnp.minimum(kv_len, q_start + num_queries)
    else:
        last_row = jnp.minimum((q_block + 1) * block_q - 1, num_rows - 1)
        hi = jnp.minimum(kv_len, q_start + lax.div(last_row, jnp.int32(group)) + 1)
    num_iters = lax.div(jnp.maximum(hi, 0) + (block_k - 1), jnp.int32(block_k))

    def copies(j, slot):
        # One descriptor per page and K/V; waits rebuild the same ones (same bytes).
        out = []
        for i in range(pages_per_block):
            page = table_ref[b, j * pages_per_block + i]
            out.append(pltpu.make_async_copy(k_hbm.at[page], k_buf.at[slot, i], sems.at[slot, 0]))
            out.append(pltpu.make_async_copy(v_hbm.at[page], v_buf.at[slot, i], sems.at[slot, 1]))
        return out

    # 2. Fresh softmax state; below _MASK_VALUE so the first correction is exp(-huge) = 0.
    m_ref[...] = jnp.full(m_ref.shape, jnp.finfo(jnp.float32).min, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(num_iters > 0)
    def _prefetch_first():
        for c in copies(0, 0):
            c.start()

    # 3. Online softmax over the visible key blocks, the next block's DMA in flight.
    def body(j, carry):
        slot = lax.rem(j, 2)

        @pl.when(j + 1 < num_iters)
        def _prefetch_next():
            for c in copies(j + 1, 1 - slot):
                c.start()

        for c in copies(j, slot):
            c.wait()

        # Visibility of the block's slots, shared by every KV head.
        slots = j * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
        rel = slots - q_start  # slot index inside the new block
        if has_tree:
            t_pad = tree_ref.shape[1]
            pos = lax.broadcasted_iota(jnp.int32, (t_pad, block_k), 0)
            col_rel = j * block_k + lax.broadcasted_iota(jnp.int32, (t_pad, block_k), 1) - q_start
            onehot = jnp.where(pos == col_rel, 1.0, 0.0).astype(jnp.bfloat16)  # [T_pad, block_k]
            hit = jnp.dot(tree_ref[...], onehot, preferred_element_type=jnp.float32) > 0.5
            visible = (rel < 0) | hit
        else:
            # rel <= row // group, in integers: rel * group <= row (no vector division).
            rows = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
            visible = rel * group <= rows
        visible = visible & (slots < kv_len)
        v_live = (j * block_k + lax.broadcasted_iota(jnp.int32, (block_k, hd), 0)) < kv_len

        for h in range(kvh):
            q = q_ref[h]  # [block_q, hd]
            k = k_buf[slot, :, :, h, :].reshape(block_k, hd)
            v = v_buf[slot, :, :, h, :].reshape(block_k, hd)
            v = jnp.where(v_live, v, jnp.zeros_like(v))
            # f32 logits, scaled after the dot as the reference does.
            logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            logits = jnp.where(visible, logits * scale, _MASK_VALUE)  # [block_q, block_k]
            m_prev = m_ref[h]  # [block_q, 128] lane-replicated
            m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
            correction = jnp.exp(m_prev - m_next)
            p = jnp.exp(logits - m_next[:, :1])
            l_ref[h] = correction * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
            m_ref[h] = m_next
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            acc_ref[h] = correction[:, :1] * acc_ref[h] + pv
        return carry

    lax.fori_loop(0, num_iters, body, 0)

    # 4. Normalise. l == 0 only when no block ran (kv_len == 0): output zeros.
    for h in range(kvh):
        l = l_ref[h][:, :1]
        l = jnp.where(l == 0.0, 1.0, l)
        o_ref[h] = (acc_ref[h] / l).astype(o_ref.dtype)


def _interpret_params(interpret):
    # True means TPU interpret mode: plain interpret mode has no DMA semaphores.
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret or False


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_q", "pages_per_block"))
def paged_attention_mosaic(
    q: jax.Array,  # [B, T, H, hd]
    k_pages: jax.Array,  # [P, page_size, kvh, hd] one layer of the cache
    v_pages: jax.Array,  # [P, page_size, kvh, hd]
    page_table: jax.Array,  # [B, max_pages] int32, null page (0) past each sequence
    q_start: jax.Array,  # [B] int32 slot of the block's first query
    kv_len: jax.Array,  # [B] int32 valid slots after the block is written
    tree_mask: jax.Array | None = None,  # [B, T, T] bool, qlen-only; None = causal
    *,
    scale: float,
    interpret: bool | pltpu.InterpretParams = False,
    block_q: int = 128,
    pages_per_block: int | None = None,
) -> jax.Array:  # [B, T, H, hd]
    """Mosaic TPU paged attention (module doc). `interpret=True` runs TPU interpret mode on CPU."""
    b, t, h, hd = q.shape
    num_pages, page_size, kvh, hd_k = k_pages.shape
    max_pages = page_table.shape[1]
    check_shapes(q, k_pages, v_pages, page_table, q_start, kv_len, tree_mask)
    group = h // kvh

    # 1. Static block sizes: rows padded to a sublane multiple, whole pages per key block.
    rows = t * group
    bq = min(_round_up(block_q, _SUBLANES), _round_up(rows, _SUBLANES))
    rows_p = _round_up(rows, bq)
    npb = min(pages_per_block or default_pages_per_block(page_size), max_pages)
    num_key_blocks = -(-max_pages // npb)
    # Every page index a key block reads must exist: pad the table with the null page.
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, num_key_blocks * npb - max_pages)))

    # 2. q to [B, kvh, rows, hd]: a group's query heads become rows of one matmul.
    qg = q.reshape(b, t, kvh, group, hd).transpose(0, 2, 1, 3, 4).reshape(b, kvh, rows, hd)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows_p - rows), (0, 0)))

    # 3. Block specs; index maps get the grid indices, then the prefetched scalars.
    qo_spec = pl.BlockSpec((pl.squeezed, kvh, bq, hd), lambda bi, qi, *_: (bi, 0, qi, 0))
    in_specs = [qo_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
    args = [qg, k_pages, v_pages]
    if tree_mask is not None:
        # Rows r = token * group + head share their token's mask row; lanes padded to 128.
        t_pad = _round_up(t, _LANES)
        tm = jnp.repeat(tree_mask.astype(jnp.bfloat16), group, axis=1)  # [B, rows, T]
        tm = jnp.pad(tm, ((0, 0), (0, rows_p - rows), (0, t_pad - t)))  # [B, rows_p, T_pad]
        in_specs.append(pl.BlockSpec((pl.squeezed, bq, t_pad), lambda bi, qi, *_: (bi, qi, 0)))
        args.append(tm)

    buf = pltpu.VMEM((2, npb, page_size, kvh, hd), k_pages.dtype)
    state = pltpu.VMEM((kvh, bq, _LANES), jnp.float32)
    kernel = functools.partial(
        _kernel, scale=float(scale), group=group, num_queries=t, num_rows=rows,
        pages_per_block=npb, has_tree=tree_mask is not None,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(b, rows_p // bq),
            in_specs=in_specs,
            out_specs=qo_spec,
            scratch_shapes=[
                buf, buf,  # K, V double buffers
                pltpu.SemaphoreType.DMA((2, 2)),  # [slot, K/V]
                state, state,  # running max, running sum
                pltpu.VMEM((kvh, bq, hd), jnp.float32),  # accumulator
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((b, kvh, rows_p, hd), q.dtype),
        # Programs share no state (each fetches its own first block), so both axes
        # may be split across TensorCores.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=_interpret_params(interpret),
        name="jaxspec_paged_attention_tpu",
    )(q_start.astype(jnp.int32), kv_len.astype(jnp.int32), table, *args)

    # 4. Back to [B, T, H, hd].
    out = out[:, :, :rows].reshape(b, kvh, t, group, hd).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, h, hd)
