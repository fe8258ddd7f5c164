"""Pallas kernels for tree verification (greedy, target-only, rejection).

Semantics, inputs and the returned bonus-token convention are those of
`jaxspec.speculative.verify` (its module docstring); the jnp references there are the
specification these kernels are tested against.

Design:
* One program per sequence (grid = (B,)). The walk down the tree is a scalar
  while-loop over candidate children, reading the child/sibling tables and
  single probabilities with dynamic scalar loads; vocabulary-sized work (the
  rejection residual, the bonus race) loops over vocab tiles of a static
  power-of-two size with masked loads/stores for the ragged last tile, so V
  need not be a power of two and target_probs is never padded or copied.
* All outputs of a sequence go in one int32 row [max_depth + 3]:
  accept_index (max_depth + 1), num_accepted, bonus_token.
* Rejection sampling keeps the current residual p' in a [B, V] float32
  workspace that is a kernel OUTPUT (the Triton backend has no scratch
  buffers); it holds max(p' - q, 0) unnormalised plus its sum z as a scalar,
  and is only read after the first rejection at a node. Between a pass that
  writes it and scalar reads of it, a CTA barrier makes the writes visible.
  One-hot drafts (draft_probs=None) build q on the fly from the token id.
* Target-only sampling needs no workspace: the residual is target_probs[cur]
  minus the tokens of the rejected children, recovered by walking the sibling
  chain again.

Backends: written for the Triton lowering (explicit Triton CompilerParams:
JAX 0.10 otherwise lowers pallas_call on GPU through Mosaic GPU). Triton
constraints honoured: every loaded/stored tensor has a power-of-two size, no
scratch, no multi-indexer refs, no closed-over array constants. On CPU the
kernels run with interpret=True (tests). On TPU (and CPU without interpret)
the wrappers refuse to run: Mosaic TPU rejects the per-sequence (None, N)
blocks (last two block dims must be (8k, 128k) or the full array), has no
masked loads and no dynamic lane indexing into vector memory. The TPU twins of
these kernels are in `jaxspec.pallas.verify_tpu` (whole-array SMEM tables,
probability tiles DMA'd from HBM, element reads as masked reductions); the
dispatchers in `jaxspec.speculative.verify` pick that module on TPU, this one
on GPU and the jnp references on CPU (a kernel never imports its callers, so
the choice lives there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxspec.pallas import target_platform
from jaxspec.pallas.paged_attention import _next_pow2
from jaxspec.pallas.types import VerifyResult, in_vocab

DEFAULT_VOCAB_TILE = 2048


def _tile_size(vocab: int, vocab_tile: int) -> int:
    return min(_next_pow2(vocab), _next_pow2(vocab_tile))


def _use_reference(interpret: bool) -> bool:
    """True where these kernels cannot run (not interpreting, not on GPU): the
    caller must use the jnp reference. Tests patch it to lower for CUDA from a
    CPU host."""
    return not interpret and target_platform() != "gpu"


def _check_runnable(interpret: bool, name: str) -> None:
    if _use_reference(interpret):
        raise NotImplementedError(
            f"{name}: the Triton kernel does not run on {target_platform()!r}; call the "
            f"dispatcher in jaxspec.speculative.verify, which runs the Mosaic kernel on TPU "
            f"and the jnp reference on CPU, or pass interpret=True")


def _compiler_params(interpret: bool):
    if interpret:
        return None
    # Explicit Triton params: without them JAX 0.10 lowers through Mosaic GPU.
    return plgpu.CompilerParams(num_warps=4, num_stages=1)


def _row_spec(*shape):
    """BlockSpec giving each program its own sequence's slice, batch squeezed."""
    return pl.BlockSpec((None, *shape), lambda b: (b,) + (0,) * len(shape))


def _split_out(out: jax.Array, max_depth: int) -> VerifyResult:
    return VerifyResult(out[:, : max_depth + 1], out[:, max_depth + 1], out[:, max_depth + 2])


# --------------------------------------------------------------------------
# In-kernel helpers (refs have the batch dim squeezed)
# --------------------------------------------------------------------------


def _init_out(out_ref, max_depth: int):
    # out_ref: [max_depth + 3] int32; accept_index starts as [0, -1, ...].
    out_ref[0] = jnp.int32(0)
    for i in range(1, max_depth + 3):
        out_ref[i] = jnp.int32(-1)


def _record(out_ref, accept, n, j):
    @pl.when(accept)
    def _():
        out_ref[n + 1] = j


def _tile(i, tile: int, vocab: int):
    off = pl.multiple_of(i * tile, tile)
    idx = off + lax.broadcasted_iota(jnp.int32, (tile,), 0)
    return off, idx, idx < vocab


def _load_tile(ref, row, off, mask, tile: int, other: float = 0.0):
    view = ref.at[pl.ds(off, tile)] if row is None else ref.at[row, pl.ds(off, tile)]
    return plgpu.load(view, mask=mask, other=other).astype(jnp.float32)


def _race_tiles(vocab: int, tile: int, residual_tile, fallback_tile, e_ref):
    """Exponential race over the vocab: argmax residual / E, or argmax
    fallback / E when the residual has no mass. `residual_tile(off, idx, m)`
    and `fallback_tile(off, m)` return [tile] float32 weights."""

    def body(i, carry):
        best_s, best_i, fb_s, fb_i = carry
        off, idx, m = _tile(i, tile, vocab)
        e = _load_tile(e_ref, None, off, m, tile, other=1.0)
        # -1 on out-of-range lanes so they never win, even against zero mass.
        s = jnp.where(m, residual_tile(off, idx, m) / e, -1.0)
        f = jnp.where(m, fallback_tile(off, m) / e, -1.0)
        s_max, f_max = jnp.max(s), jnp.max(f)
        s_arg = off + jnp.argmax(s).astype(jnp.int32)
        f_arg = off + jnp.argmax(f).astype(jnp.int32)
        # Strict > keeps the first index on ties, like jnp.argmax.
        return (jnp.where(s_max > best_s, s_max, best_s),
                jnp.where(s_max > best_s, s_arg, best_i),
                jnp.where(f_max > fb_s, f_max, fb_s),
                jnp.where(f_max > fb_s, f_arg, fb_i))

    neg = jnp.float32(-jnp.inf)
    init = (neg, jnp.int32(0), neg, jnp.int32(0))
    best_s, best_i, _, fb_i = lax.fori_loop(0, pl.cdiv(vocab, tile), body, init)
    return jnp.where(best_s > 0.0, best_i, fb_i)


# --------------------------------------------------------------------------
# Greedy
# --------------------------------------------------------------------------


def _greedy_kernel(tok_ref, nt_ref, ns_ref, pred_ref, out_ref, *, max_depth: int):
    # tok/nt/ns/pred: [N] int32; out: [max_depth + 3] int32.
    _init_out(out_ref, max_depth)

    def cond(s):
        n, _, j = s
        return (j >= 0) & (n < max_depth)

    def body(s):
        n, cur, j = s
        # pred is an argmax in [0, V): padding and out-of-vocabulary drafts never match.
        accept = tok_ref[j] == pred_ref[cur]
        _record(out_ref, accept, n, j)
        return (n + accept.astype(jnp.int32), jnp.where(accept, j, cur),
                jnp.where(accept, nt_ref[j], ns_ref[j]))

    n, cur, _ = lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(0), nt_ref[0]))
    out_ref[max_depth + 1] = n
    out_ref[max_depth + 2] = pred_ref[cur]


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret"))
def verify_greedy_pallas(
    tokens: jax.Array,  # [B, N] int32
    retrieve_next_token: jax.Array,  # [B, N] int32
    retrieve_next_sibling: jax.Array,  # [B, N] int32
    target_predict: jax.Array,  # [B, N] int32
    *,
    max_depth: int,
    interpret: bool = False,
) -> VerifyResult:
    """Kernel version of `jaxspec.speculative.verify.verify_greedy_ref`."""
    _check_runnable(interpret, "verify_greedy_pallas")
    b, n = tokens.shape
    ints = [x.astype(jnp.int32) for x in
            (tokens, retrieve_next_token, retrieve_next_sibling, target_predict)]
    out = pl.pallas_call(
        functools.partial(_greedy_kernel, max_depth=max_depth),
        grid=(b,),
        in_specs=[_row_spec(n)] * 4,
        out_specs=_row_spec(max_depth + 3),
        out_shape=jax.ShapeDtypeStruct((b, max_depth + 3), jnp.int32),
        interpret=interpret,
        compiler_params=_compiler_params(interpret),
        name="verify_greedy",
    )(*ints)
    return _split_out(out, max_depth)


# --------------------------------------------------------------------------
# Target-only (SGLang tree_speculative_sampling_target_only)
# --------------------------------------------------------------------------


def _target_only_kernel(tok_ref, nt_ref, ns_ref, u_ref, th_ref, p_ref, e_ref, out_ref, *,
                        max_depth: int, vocab: int, tile: int):
    # tok/nt/ns: [N] int32; u: [N] f32; th: [2] f32 (single, acc);
    # p: [N, V]; e: [V] f32; out: [max_depth + 3] int32.
    _init_out(out_ref, max_depth)
    th_single, th_acc = th_ref[0], th_ref[1]

    def seen_before(first, stop, t):
        # Is t among the (all rejected) siblings first .. stop, stop excluded?
        def cond(s):
            sib, found = s
            return (sib >= 0) & (sib != stop) & (found == 0)

        def body(s):
            sib, found = s
            return ns_ref[sib], (tok_ref[sib] == t).astype(jnp.int32)

        return lax.while_loop(cond, body, (first, jnp.int32(0)))[1] > 0

    # 1. Walk: one coin per level (the current node's), cumulative target mass
    #    of the children tested so far.
    def cond(s):
        n, _, j, _ = s
        return (j >= 0) & (n < max_depth)

    def body(s):
        n, cur, j, prob_acc = s
        t = tok_ref[j]
        # Out-of-vocabulary ids are skipped like padding; tc keeps the load in bounds.
        real = in_vocab(t, vocab)
        tc = jnp.where(real, t, 0)
        counted = real & ~seen_before(nt_ref[cur], j, t)
        p_single = jnp.where(counted, p_ref[cur, tc].astype(jnp.float32), 0.0)
        prob_acc = prob_acc + p_single
        accept = real & ((u_ref[cur] < prob_acc / th_acc) | (p_single >= th_single))
        _record(out_ref, accept, n, j)
        return (n + accept.astype(jnp.int32), jnp.where(accept, j, cur),
                jnp.where(accept, nt_ref[j], ns_ref[j]), jnp.where(accept, 0.0, prob_acc))

    init = (jnp.int32(0), jnp.int32(0), nt_ref[0], jnp.float32(0.0))
    n, cur, j_end, _ = lax.while_loop(cond, body, init)

    # 2. Bonus: target at cur minus the rejected children's tokens, i.e. the
    #    sibling chain from cur's first child up to where the walk stopped
    #    (empty when it stopped at max_depth, the whole chain when j_end = -1).
    first = nt_ref[cur]

    def residual_tile(off, idx, m):
        p = _load_tile(p_ref, cur, off, m, tile)

        def zcond(s):
            return (s[0] >= 0) & (s[0] != j_end)

        def zbody(s):
            sib, r = s
            return ns_ref[sib], jnp.where(idx == tok_ref[sib], 0.0, r)

        return lax.while_loop(zcond, zbody, (first, p))[1]

    bonus = _race_tiles(vocab, tile, residual_tile,
                        lambda off, m: _load_tile(p_ref, cur, off, m, tile), e_ref)
    out_ref[max_depth + 1] = n
    out_ref[max_depth + 2] = bonus


def row_thresholds(threshold_single, threshold_acc, b: int) -> jax.Array:  # [B, 2] float32
    """Target-only thresholds (floats or [B]) as per-row (single, acc) pairs, acc kept above 0
    (the kernels divide by it); shared by the Triton and Mosaic kernels."""
    return jnp.stack([
        jnp.broadcast_to(jnp.asarray(threshold_single, jnp.float32), (b,)),
        jnp.maximum(jnp.broadcast_to(jnp.asarray(threshold_acc, jnp.float32), (b,)), 1e-9),
    ], axis=1)


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret", "vocab_tile"))
def verify_target_only_pallas(
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
    vocab_tile: int = DEFAULT_VOCAB_TILE,
) -> VerifyResult:
    """Kernel version of `jaxspec.speculative.verify.verify_target_only_ref`."""
    _check_runnable(interpret, "verify_target_only_pallas")
    b, n = tokens.shape
    vocab = target_probs.shape[-1]
    tile = _tile_size(vocab, vocab_tile)
    ints = [x.astype(jnp.int32) for x in (tokens, retrieve_next_token, retrieve_next_sibling)]
    th = row_thresholds(threshold_single, threshold_acc, b)
    out = pl.pallas_call(
        functools.partial(_target_only_kernel, max_depth=max_depth, vocab=vocab, tile=tile),
        grid=(b,),
        in_specs=[_row_spec(n)] * 4 + [_row_spec(2), _row_spec(n, vocab), _row_spec(vocab)],
        out_specs=_row_spec(max_depth + 3),
        out_shape=jax.ShapeDtypeStruct((b, max_depth + 3), jnp.int32),
        interpret=interpret,
        compiler_params=_compiler_params(interpret),
        name="verify_target_only",
    )(*ints, uniforms.astype(jnp.float32), th, target_probs, bonus_noise.astype(jnp.float32))
    return _split_out(out, max_depth)


# --------------------------------------------------------------------------
# Rejection sampling (lossless, chain and tree)
# --------------------------------------------------------------------------


def _rejection_kernel(tok_ref, nt_ref, ns_ref, u_ref, p_ref, *refs, max_depth: int,
                      vocab: int, tile: int, one_hot: bool, barrier: bool):
    # tok/nt/ns: [N] int32; u: [N] f32; p: [N, V]; q (unless one_hot): [N, V];
    # e: [V] f32; out: [max_depth + 3] int32; ws: [V] f32 residual workspace.
    if one_hot:
        q_ref = None
        e_ref, out_ref, ws_ref = refs
    else:
        q_ref, e_ref, out_ref, ws_ref = refs
    _init_out(out_ref, max_depth)
    num_tiles = pl.cdiv(vocab, tile)

    def draft_tile(j, tc, off, idx, m):
        if one_hot:
            return jnp.where(idx == tc, 1.0, 0.0)
        return _load_tile(q_ref, j, off, m, tile)

    def residual_pass(cur, j, tc, z, from_ws: bool):
        # ws <- max(p' - q_j, 0) over the whole vocab; returns its mass.
        def body(i, mass):
            off, idx, m = _tile(i, tile, vocab)
            if from_ws:
                src = _load_tile(ws_ref, None, off, m, tile) / z
            else:
                src = _load_tile(p_ref, cur, off, m, tile)
            new = jnp.maximum(src - draft_tile(j, tc, off, idx, m), 0.0)
            plgpu.store(ws_ref.at[pl.ds(off, tile)], new, mask=m)
            return mass + jnp.sum(new)

        mass = lax.fori_loop(0, num_tiles, body, jnp.float32(0.0))
        if barrier:
            plgpu.debug_barrier()
        return mass

    # 1. Walk. State: k = 1 when p' lives in ws (some child of cur was
    #    rejected), else p' = p[cur]; z = mass of ws.
    def cond(s):
        n, _, j, _, _ = s
        return (j >= 0) & (n < max_depth)

    def body(s):
        n, cur, j, k, z = s
        t = tok_ref[j]
        # Out-of-vocabulary ids are skipped like padding; tc keeps the loads in bounds.
        valid = in_vocab(t, vocab)
        tc = jnp.where(valid, t, 0)
        q_t = jnp.float32(1.0) if one_hot else q_ref[j, tc].astype(jnp.float32)
        p_t = jnp.where(k > 0, ws_ref[tc] / z, p_ref[cur, tc].astype(jnp.float32))
        accept = valid & (u_ref[j] * q_t < p_t)
        reject = valid & ~accept
        _record(out_ref, accept, n, j)
        mass = lax.cond(
            reject,
            lambda: lax.cond(k > 0,
                             lambda: residual_pass(cur, j, tc, z, True),
                             lambda: residual_pass(cur, j, tc, z, False)),
            lambda: z,
        )
        # A zero-mass residual (p' == q up to rounding) restarts from p[cur].
        live = reject & (mass > 0.0)
        k = jnp.where(accept | (reject & ~live), 0, jnp.where(live, 1, k))
        z = jnp.where(live, mass, jnp.where(accept, 1.0, z))
        return (n + accept.astype(jnp.int32), jnp.where(accept, j, cur),
                jnp.where(accept, nt_ref[j], ns_ref[j]), k, z)

    init = (jnp.int32(0), jnp.int32(0), nt_ref[0], jnp.int32(0), jnp.float32(1.0))
    n, cur, _, k, z = lax.while_loop(cond, body, init)

    # 2. Bonus from the final residual.
    def p_tile(off, m):
        return _load_tile(p_ref, cur, off, m, tile)

    def race(from_ws: bool):
        if from_ws:
            res = lambda off, idx, m: _load_tile(ws_ref, None, off, m, tile) / z  # noqa: E731
        else:
            res = lambda off, idx, m: p_tile(off, m)  # noqa: E731
        return _race_tiles(vocab, tile, res, p_tile, e_ref)

    bonus = lax.cond(k > 0, lambda: race(True), lambda: race(False))
    out_ref[max_depth + 1] = n
    out_ref[max_depth + 2] = bonus


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret", "vocab_tile"))
def verify_rejection_pallas(
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
    vocab_tile: int = DEFAULT_VOCAB_TILE,
) -> VerifyResult:
    """Kernel version of `jaxspec.speculative.verify.verify_rejection_ref`."""
    _check_runnable(interpret, "verify_rejection_pallas")
    b, n = tokens.shape
    vocab = target_probs.shape[-1]
    tile = _tile_size(vocab, vocab_tile)
    one_hot = draft_probs is None
    ints = [x.astype(jnp.int32) for x in (tokens, retrieve_next_token, retrieve_next_sibling)]
    probs = [target_probs] if one_hot else [target_probs, draft_probs]
    kernel = functools.partial(_rejection_kernel, max_depth=max_depth, vocab=vocab, tile=tile,
                               one_hot=one_hot, barrier=not interpret)
    out, _ = pl.pallas_call(
        kernel,
        grid=(b,),
        in_specs=([_row_spec(n)] * 4 + [_row_spec(n, vocab)] * len(probs)
                  + [_row_spec(vocab)]),
        out_specs=[_row_spec(max_depth + 3), _row_spec(vocab)],
        out_shape=[jax.ShapeDtypeStruct((b, max_depth + 3), jnp.int32),
                   jax.ShapeDtypeStruct((b, vocab), jnp.float32)],
        interpret=interpret,
        compiler_params=_compiler_params(interpret),
        name="verify_rejection",
    )(*ints, uniforms.astype(jnp.float32), *probs, bonus_noise.astype(jnp.float32))
    return _split_out(out, max_depth)
