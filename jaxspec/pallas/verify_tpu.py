"""Mosaic TPU Pallas kernels for tree verification (greedy, target-only, rejection).

The TPU twins of the Triton kernels in `jaxspec.pallas.verify`: same inputs, same
outputs, same arithmetic (the bonus-token convention and the semantics are those of
`jaxspec.speculative.verify`, whose jnp references these are tested against).

Why a second set of kernels: Mosaic TPU rejects what the Triton ones rely on, i.e.
per-sequence (None, N) blocks (a block's last two dims must be (8k, 128k) or the
full array), masked loads, and dynamic lane indexing into vector memory. So:

* The small tables (tokens, first child, next sibling, target argmax, coins,
  thresholds) and the output are whole-array 1-D SMEM refs, read and written as
  scalars at `b * N + j` (b = program_id). 1-D because SMEM pads 2-D arrays to
  (8, 128) tiles, which would blow up its few KB at serving batch sizes.
* The [B, N, V] probabilities stay in HBM (memory_space=ANY): the walk reads one
  probability by DMA-ing the [T, 128] vocab tile that holds it into VMEM and
  taking a masked reduction (iota == index, then sum: exactly the one element),
  since Mosaic has no dynamic gather. Full rows ([R, 128] = the vocabulary) are
  DMA'd only where the whole vocabulary is needed: a rejection's residual pass
  and the bonus race.
* The vocabulary is laid out as [R, 128] rows (R a multiple of 8) and every
  vector op works on aligned [T, 128] tiles (T | R, T a multiple of 8) sliced
  out of VMEM refs at multiples of T, so Mosaic never sees a ragged shape. The
  wrapper pads V up to R * 128 with zero probability and noise 1 (a copy, only
  when V % 1024 != 0: SmolLM2's 49152 needs none, Llama-3's 128256 and Qwen's
  151936 do); padded lanes are masked out of the race and carry zero mass
  everywhere else.
* The output lives in SMEM as one whole array shared by every grid step, so the
  grid is "arbitrary" (sequential): a "parallel" grid split over megacore would
  let each core write back its own copy of the whole array.
* Rejection keeps the residual max(p' - q, 0) unnormalised in a VMEM scratch row
  with its mass z as a scalar, like the Triton kernel; its reads are ws[t] / z.

Tests run these with interpret=True (`pltpu.InterpretParams`, the TPU
interpreter on CPU) and lower them for TPU from a CPU host; compiling them
needs a TPU. A kernel never imports its callers or its references: the
dispatchers in `jaxspec.speculative.verify` choose between this module, the
Triton kernels and the references (`jaxspec.pallas` has the rule).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxspec.pallas import target_platform
from jaxspec.pallas.types import VerifyResult, in_vocab
from jaxspec.pallas.verify import row_thresholds

LANES = 128
SUBLANES = 8
# Vocab rows per vector tile: 64 x 128 f32 = 8 vregs per operand.
DEFAULT_TILE_ROWS = 64


def vocab_layout(vocab: int, tile_rows: int = DEFAULT_TILE_ROWS) -> tuple[int, int]:
    """(R, T): the vocabulary as R rows of 128 lanes (R a multiple of 8) and the rows per
    tile, the largest multiple of 8 <= tile_rows that divides R."""
    rows = -(-vocab // (LANES * SUBLANES)) * SUBLANES
    tile = max(SUBLANES, min(tile_rows, rows) // SUBLANES * SUBLANES)
    while rows % tile:
        tile -= SUBLANES
    return rows, tile


def _as_rows(x: jax.Array, rows: int, fill: float) -> jax.Array:
    # x: [..., V] -> [..., rows, 128] float32, padded with `fill` past V.
    x = x.astype(jnp.float32)
    pad = rows * LANES - x.shape[-1]
    if pad:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=fill)
    return x.reshape(*x.shape[:-1], rows, LANES)


def _check_runnable(interpret: bool, name: str) -> None:
    if not interpret and target_platform() != "tpu":
        raise NotImplementedError(
            f"{name}: the Mosaic TPU kernel does not run on {target_platform()!r}; call the "
            f"dispatcher in jaxspec.speculative.verify, or pass interpret=True")


def _call_kw(interpret: bool) -> dict:
    # Sequential grid: every step writes the one SMEM output array (module docstring).
    return dict(interpret=pltpu.InterpretParams() if interpret else False,
                compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)))


def _smem():
    return pl.BlockSpec(memory_space=pltpu.SMEM)


def _hbm():
    return pl.BlockSpec(memory_space=pl.ANY)


def _noise_spec(rows: int):
    # bonus_noise [B, R, 128] -> this sequence's [R, 128] (full last two dims: legal).
    return pl.BlockSpec((None, rows, LANES), lambda b: (b, 0, 0))


def _flat(ints: tuple[jax.Array, ...]) -> list[jax.Array]:
    return [x.astype(jnp.int32).reshape(-1) for x in ints]


def _split_out(out: jax.Array, batch: int, max_depth: int) -> VerifyResult:
    # out: [B * (max_depth + 3)] int32 -> accept_index, num_accepted, bonus_token.
    out = out.reshape(batch, max_depth + 3)
    return VerifyResult(out[:, : max_depth + 1], out[:, max_depth + 1], out[:, max_depth + 2])


# --------------------------------------------------------------------------
# In-kernel helpers
# --------------------------------------------------------------------------


def _init_out(out_ref, base, max_depth: int):
    # out_ref: [B * (max_depth + 3)] int32 SMEM; this sequence's accept_index starts [0, -1, ...].
    out_ref[base] = jnp.int32(0)
    for i in range(1, max_depth + 3):
        out_ref[base + i] = jnp.int32(-1)


def _record(out_ref, base, accept, n, j):
    @pl.when(accept)
    def _():
        out_ref[base + n + 1] = j


def _ids(off, tile: int):
    """[tile, 128] int32: the vocab ids of rows off .. off + tile."""
    r = lax.broadcasted_iota(jnp.int32, (tile, LANES), 0)
    c = lax.broadcasted_iota(jnp.int32, (tile, LANES), 1)
    return (off + r) * LANES + c


def _pick(vals, ids, t):
    """vals[t] as a masked reduction (Mosaic has no dynamic gather); exact, one term is nonzero."""
    return jnp.sum(jnp.where(ids == t, vals, 0.0))


def _tile_of(t, tile: int):
    # First row of the tile holding vocab id t (t in [0, R * 128)). lax.div truncates, which
    # is the floor for t >= 0; jnp's // adds sign fix-ups whose Mosaic rule needs a TPU to query.
    return pl.multiple_of(lax.div(t, jnp.int32(LANES * tile)) * tile, tile)


def _dma(src, dst, sem):
    copy = pltpu.make_async_copy(src, dst, sem)
    copy.start()
    copy.wait()


def _read_hbm(hbm, b, row, t, buf, sem, tile: int):
    """hbm[b, row, t] (hbm [B, N, R, 128] f32) via a DMA of its [tile, 128] tile into buf."""
    off = _tile_of(t, tile)
    _dma(hbm.at[b, row, pl.ds(off, tile)], buf, sem)
    return _pick(buf[...], _ids(off, tile), t)


def _read_vmem(ref, t, tile: int):
    """ref[t] for a VMEM [R, 128] row."""
    off = _tile_of(t, tile)
    return _pick(ref[pl.ds(off, tile), :], _ids(off, tile), t)


def _first_max(x, ids):
    # (max, first id reaching it) of a [tile, 128] tile; ids as f32 (exact below 2^24)
    # so both are float reductions.
    m = jnp.max(x)
    i = jnp.min(jnp.where(x == m, ids.astype(jnp.float32), jnp.float32(jnp.inf)))
    return m, i.astype(jnp.int32)


def _race(rows: int, tile: int, vocab: int, residual_tile, fallback_tile, e_ref):
    """Exponential race over the vocab: argmax residual / E, or argmax fallback / E when
    the residual has no mass. `residual_tile(off, ids)` / `fallback_tile(off)` give
    [tile, 128] float32 weights; e_ref is [R, 128]."""

    def body(i, carry):
        best_s, best_i, fb_s, fb_i = carry
        off = pl.multiple_of(i * tile, tile)
        ids = _ids(off, tile)
        live = ids < vocab
        e = e_ref[pl.ds(off, tile), :]
        # -1 on padded lanes so they never win, even against zero mass.
        s_max, s_arg = _first_max(jnp.where(live, residual_tile(off, ids) / e, -1.0), ids)
        f_max, f_arg = _first_max(jnp.where(live, fallback_tile(off) / e, -1.0), ids)
        # Strict > keeps the first index on ties across tiles, like jnp.argmax.
        return (jnp.where(s_max > best_s, s_max, best_s), jnp.where(s_max > best_s, s_arg, best_i),
                jnp.where(f_max > fb_s, f_max, fb_s), jnp.where(f_max > fb_s, f_arg, fb_i))

    neg = jnp.float32(-jnp.inf)
    best_s, best_i, _, fb_i = lax.fori_loop(0, rows // tile, body, (neg, jnp.int32(0), neg, jnp.int32(0)))
    return jnp.where(best_s > 0.0, best_i, fb_i)


# --------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------


def _greedy_kernel(tok_ref, nt_ref, ns_ref, pred_ref, out_ref, *, n_nodes: int, max_depth: int):
    # tok/nt/ns/pred: [B * N] int32 SMEM; out: [B * (max_depth + 3)] int32 SMEM.
    b = pl.program_id(0)
    base, obase = b * n_nodes, b * (max_depth + 3)
    _init_out(out_ref, obase, max_depth)

    def cond(s):
        n, _, j = s
        return (j >= 0) & (n < max_depth)

    def body(s):
        n, cur, j = s
        # pred is an argmax in [0, V): padding and out-of-vocabulary drafts never match.
        accept = tok_ref[base + j] == pred_ref[base + cur]
        _record(out_ref, obase, accept, n, j)
        return (n + accept.astype(jnp.int32), jnp.where(accept, j, cur),
                jnp.where(accept, nt_ref[base + j], ns_ref[base + j]))

    n, cur, _ = lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(0), nt_ref[base]))
    out_ref[obase + max_depth + 1] = n
    out_ref[obase + max_depth + 2] = pred_ref[base + cur]


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret"))
def verify_greedy_tpu(
    tokens: jax.Array,  # [B, N] int32
    retrieve_next_token: jax.Array,  # [B, N] int32
    retrieve_next_sibling: jax.Array,  # [B, N] int32
    target_predict: jax.Array,  # [B, N] int32
    *,
    max_depth: int,
    interpret: bool = False,
) -> VerifyResult:
    """Mosaic TPU version of `jaxspec.speculative.verify.verify_greedy_ref`."""
    _check_runnable(interpret, "verify_greedy_tpu")
    b, n = tokens.shape
    out = pl.pallas_call(
        functools.partial(_greedy_kernel, n_nodes=n, max_depth=max_depth),
        grid=(b,),
        in_specs=[_smem()] * 4,
        out_specs=_smem(),
        out_shape=jax.ShapeDtypeStruct((b * (max_depth + 3),), jnp.int32),
        name="verify_greedy",
        **_call_kw(interpret),
    )(*_flat((tokens, retrieve_next_token, retrieve_next_sibling, target_predict)))
    return _split_out(out, b, max_depth)


# --------------------------------------------------------------------------
# Target-only (SGLang tree_speculative_sampling_target_only)
# --------------------------------------------------------------------------


def _target_only_kernel(tok_ref, nt_ref, ns_ref, u_ref, th_ref, p_hbm, e_ref, out_ref,
                        tile_buf, row_buf, sem, *, n_nodes: int, max_depth: int, vocab: int,
                        rows: int, tile: int):
    # tok/nt/ns: [B * N] int32 SMEM; u: [B * N] f32 SMEM; th: [B * 2] f32 SMEM (single, acc);
    # p: [B, N, R, 128] f32 HBM; e: [R, 128] f32 VMEM; out: [B * (max_depth + 3)] int32 SMEM;
    # scratch: tile_buf [T, 128] f32, row_buf [R, 128] f32 VMEM, one DMA semaphore.
    b = pl.program_id(0)
    base, obase = b * n_nodes, b * (max_depth + 3)
    _init_out(out_ref, obase, max_depth)
    th_single, th_acc = th_ref[2 * b], th_ref[2 * b + 1]

    def seen_before(first, stop, t):
        # Is t among the (all rejected) siblings first .. stop, stop excluded?
        def cond(s):
            sib, found = s
            return (sib >= 0) & (sib != stop) & (found == 0)

        def body(s):
            sib, _ = s
            return ns_ref[base + sib], (tok_ref[base + sib] == t).astype(jnp.int32)

        return lax.while_loop(cond, body, (first, jnp.int32(0)))[1] > 0

    # 1. Walk: one coin per level (the current node's), cumulative target mass
    #    of the children tested so far.
    def cond(s):
        n, _, j, _ = s
        return (j >= 0) & (n < max_depth)

    def body(s):
        n, cur, j, prob_acc = s
        t = tok_ref[base + j]
        # Out-of-vocabulary ids are skipped like padding; tc keeps the DMA in bounds.
        real = in_vocab(t, vocab)
        tc = jnp.where(real, t, 0)
        counted = real & ~seen_before(nt_ref[base + cur], j, t)
        # The DMA only for a probability that counts.
        p_single = lax.cond(counted, lambda: _read_hbm(p_hbm, b, cur, tc, tile_buf, sem, tile),
                            lambda: jnp.float32(0.0))
        prob_acc = prob_acc + p_single
        accept = real & ((u_ref[base + cur] < prob_acc / th_acc) | (p_single >= th_single))
        _record(out_ref, obase, accept, n, j)
        return (n + accept.astype(jnp.int32), jnp.where(accept, j, cur),
                jnp.where(accept, nt_ref[base + j], ns_ref[base + j]), jnp.where(accept, 0.0, prob_acc))

    init = (jnp.int32(0), jnp.int32(0), nt_ref[base], jnp.float32(0.0))
    n, cur, j_end, _ = lax.while_loop(cond, body, init)

    # 2. Bonus: target at cur minus the rejected children's tokens, i.e. the
    #    sibling chain from cur's first child up to where the walk stopped
    #    (empty when it stopped at max_depth, the whole chain when j_end = -1).
    _dma(p_hbm.at[b, cur], row_buf, sem)
    first = nt_ref[base + cur]

    def p_tile(off):
        return row_buf[pl.ds(off, tile), :]

    def residual_tile(off, ids):
        def zcond(s):
            return (s[0] >= 0) & (s[0] != j_end)

        def zbody(s):
            sib, r = s
            return ns_ref[base + sib], jnp.where(ids == tok_ref[base + sib], 0.0, r)

        return lax.while_loop(zcond, zbody, (first, p_tile(off)))[1]

    bonus = _race(rows, tile, vocab, residual_tile, p_tile, e_ref)
    out_ref[obase + max_depth + 1] = n
    out_ref[obase + max_depth + 2] = bonus


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret", "tile_rows"))
def verify_target_only_tpu(
    tokens: jax.Array,  # [B, N] int32
    retrieve_next_token: jax.Array,  # [B, N] int32
    retrieve_next_sibling: jax.Array,  # [B, N] int32
    target_probs: jax.Array,  # [B, N, V] float
    uniforms: jax.Array,  # [B, N] float32
    bonus_noise: jax.Array,  # [B, V] float32
    threshold_single=1.0,  # float or [B]
    threshold_acc=1.0,  # float or [B]
    *,
    max_depth: int,
    interpret: bool = False,
    tile_rows: int = DEFAULT_TILE_ROWS,
) -> VerifyResult:
    """Mosaic TPU version of `jaxspec.speculative.verify.verify_target_only_ref`."""
    _check_runnable(interpret, "verify_target_only_tpu")
    b, n = tokens.shape
    vocab = target_probs.shape[-1]
    rows, tile = vocab_layout(vocab, tile_rows)
    th = row_thresholds(threshold_single, threshold_acc, b).reshape(-1)
    kernel = functools.partial(_target_only_kernel, n_nodes=n, max_depth=max_depth, vocab=vocab,
                               rows=rows, tile=tile)
    out = pl.pallas_call(
        kernel,
        grid=(b,),
        in_specs=[_smem()] * 5 + [_hbm(), _noise_spec(rows)],
        out_specs=_smem(),
        out_shape=jax.ShapeDtypeStruct((b * (max_depth + 3),), jnp.int32),
        scratch_shapes=[pltpu.VMEM((tile, LANES), jnp.float32), pltpu.VMEM((rows, LANES), jnp.float32),
                        pltpu.SemaphoreType.DMA(())],
        name="verify_target_only",
        **_call_kw(interpret),
    )(*_flat((tokens, retrieve_next_token, retrieve_next_sibling)),
      uniforms.astype(jnp.float32).reshape(-1), th,
      _as_rows(target_probs, rows, 0.0), _as_rows(bonus_noise, rows, 1.0))
    return _split_out(out, b, max_depth)


# --------------------------------------------------------------------------
# Rejection sampling (lossless, chain and tree)
# --------------------------------------------------------------------------


def _rejection_kernel(tok_ref, nt_ref, ns_ref, u_ref, p_hbm, *refs, n_nodes: int, max_depth: int,
                      vocab: int, rows: int, tile: int, one_hot: bool):
    # tok/nt/ns: [B * N] int32 SMEM; u: [B * N] f32 SMEM; p (and q unless one_hot):
    # [B, N, R, 128] f32 HBM; e: [R, 128] f32 VMEM; out: [B * (max_depth + 3)] int32 SMEM;
    # scratch (VMEM): p_tile/q_tile [T, 128], p_row/q_row/ws [R, 128] f32; a DMA semaphore.
    if one_hot:
        q_hbm = None
        e_ref, out_ref, p_tile_buf, q_tile_buf, p_row, q_row, ws_ref, sem = refs
    else:
        q_hbm, e_ref, out_ref, p_tile_buf, q_tile_buf, p_row, q_row, ws_ref, sem = refs
    b = pl.program_id(0)
    base, obase = b * n_nodes, b * (max_depth + 3)
    _init_out(out_ref, obase, max_depth)
    num_tiles = rows // tile

    def residual_pass(cur, j, tc, z, from_ws: bool):
        # ws <- max(p' - q_j, 0) over the whole vocab; returns its mass.
        if not from_ws:
            _dma(p_hbm.at[b, cur], p_row, sem)
        if not one_hot:
            _dma(q_hbm.at[b, j], q_row, sem)

        def body(i, mass):
            off = pl.multiple_of(i * tile, tile)
            window = pl.ds(off, tile)
            src = ws_ref[window, :] / z if from_ws else p_row[window, :]
            q = jnp.where(_ids(off, tile) == tc, 1.0, 0.0) if one_hot else q_row[window, :]
            new = jnp.maximum(src - q, 0.0)
            ws_ref[window, :] = new
            return mass + jnp.sum(new)

        return lax.fori_loop(0, num_tiles, body, jnp.float32(0.0))

    # 1. Walk. State: k = 1 when p' lives in ws (some child of cur was
    #    rejected), else p' = p[cur]; z = mass of ws.
    def cond(s):
        n, _, j, _, _ = s
        return (j >= 0) & (n < max_depth)

    def body(s):
        n, cur, j, k, z = s
        t = tok_ref[base + j]
        # Out-of-vocabulary ids are skipped like padding; tc keeps the DMAs in bounds.
        valid = in_vocab(t, vocab)
        tc = jnp.where(valid, t, 0)
        if one_hot:
            q_t = jnp.float32(1.0)
        else:
            q_t = _read_hbm(q_hbm, b, j, tc, q_tile_buf, sem, tile)
        p_t = lax.cond(k > 0, lambda: _read_vmem(ws_ref, tc, tile) / z,
                       lambda: _read_hbm(p_hbm, b, cur, tc, p_tile_buf, sem, tile))
        accept = valid & (u_ref[base + j] * q_t < p_t)
        reject = valid & ~accept
        _record(out_ref, obase, accept, n, j)
        mass = lax.cond(
            reject,
            lambda: lax.cond(k > 0, lambda: residual_pass(cur, j, tc, z, True),
                             lambda: residual_pass(cur, j, tc, z, False)),
            lambda: z,
        )
        # A zero-mass residual (p' == q up to rounding) restarts from p[cur].
        live = reject & (mass > 0.0)
        k = jnp.where(accept | (reject & ~live), 0, jnp.where(live, 1, k))
        z = jnp.where(live, mass, jnp.where(accept, 1.0, z))
        return (n + accept.astype(jnp.int32), jnp.where(accept, j, cur),
                jnp.where(accept, nt_ref[base + j], ns_ref[base + j]), k, z)

    init = (jnp.int32(0), jnp.int32(0), nt_ref[base], jnp.int32(0), jnp.float32(1.0))
    n, cur, _, k, z = lax.while_loop(cond, body, init)

    # 2. Bonus from the final residual; p[cur] is the fallback (and the residual when k = 0).
    _dma(p_hbm.at[b, cur], p_row, sem)

    def p_tile(off):
        return p_row[pl.ds(off, tile), :]

    def race(from_ws: bool):
        if from_ws:
            res = lambda off, ids: ws_ref[pl.ds(off, tile), :] / z  # noqa: E731
        else:
            res = lambda off, ids: p_tile(off)  # noqa: E731
        return _race(rows, tile, vocab, res, p_tile, e_ref)

    bonus = lax.cond(k > 0, lambda: race(True), lambda: race(False))
    out_ref[obase + max_depth + 1] = n
    out_ref[obase + max_depth + 2] = bonus


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret", "tile_rows"))
def verify_rejection_tpu(
    tokens: jax.Array,  # [B, N] int32
    retrieve_next_token: jax.Array,  # [B, N] int32
    retrieve_next_sibling: jax.Array,  # [B, N] int32
    target_probs: jax.Array,  # [B, N, V] float
    draft_probs: jax.Array | None,  # [B, N, V] float, by child node; None = one-hot
    uniforms: jax.Array,  # [B, N] float32
    bonus_noise: jax.Array,  # [B, V] float32
    *,
    max_depth: int,
    interpret: bool = False,
    tile_rows: int = DEFAULT_TILE_ROWS,
) -> VerifyResult:
    """Mosaic TPU version of `jaxspec.speculative.verify.verify_rejection_ref`."""
    _check_runnable(interpret, "verify_rejection_tpu")
    b, n = tokens.shape
    vocab = target_probs.shape[-1]
    rows, tile = vocab_layout(vocab, tile_rows)
    one_hot = draft_probs is None
    probs = [_as_rows(target_probs, rows, 0.0)]
    if not one_hot:
        probs.append(_as_rows(draft_probs, rows, 0.0))
    tile_scratch = pltpu.VMEM((tile, LANES), jnp.float32)
    row_scratch = pltpu.VMEM((rows, LANES), jnp.float32)
    # One-hot drafts never touch the q tile/row, but keeping them keeps one ref layout.
    q_row = pltpu.VMEM((SUBLANES, LANES), jnp.float32) if one_hot else row_scratch
    q_tile = pltpu.VMEM((SUBLANES, LANES), jnp.float32) if one_hot else tile_scratch
    kernel = functools.partial(_rejection_kernel, n_nodes=n, max_depth=max_depth, vocab=vocab,
                               rows=rows, tile=tile, one_hot=one_hot)
    out = pl.pallas_call(
        kernel,
        grid=(b,),
        in_specs=[_smem()] * 4 + [_hbm()] * len(probs) + [_noise_spec(rows)],
        out_specs=_smem(),
        out_shape=jax.ShapeDtypeStruct((b * (max_depth + 3),), jnp.int32),
        scratch_shapes=[tile_scratch, q_tile, row_scratch, q_row, row_scratch,
                        pltpu.SemaphoreType.DMA(())],
        name="verify_rejection",
        **_call_kw(interpret),
    )(*_flat((tokens, retrieve_next_token, retrieve_next_sibling)),
      uniforms.astype(jnp.float32).reshape(-1), *probs, _as_rows(bonus_noise, rows, 1.0))
    return _split_out(out, b, max_depth)
