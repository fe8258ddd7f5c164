"""Pallas kernel for draft-tree construction (SGLang's build_tree_kernel_efficient).

One program per sequence builds that sequence's whole tree in registers/VMEM:

* ancestor-or-self closure by repeated boolean squaring of (I + parent edge):
  ceil(log2(N-1)) small MXU/tensor-core matmuls instead of an N-long walk;
* depth = row popcount of the closure, positions = prefix_len + depth;
* first child / next sibling as masked row-minima over pairwise parent tests.

Layout choices (why the wrapper reshapes):
* N is padded to Np = max(16, next_pow2(N)): Triton needs power-of-two array
  sizes and tl.dot needs every dim >= 16. Extra nodes are padding (token -1),
  which by construction cannot touch real nodes' outputs; the wrapper slices
  them off.
* Per-node vectors arrive twice, as a row [1, Np] and a column [Np, 1], so the
  pairwise tests are plain broadcasts with no in-kernel transpose (TPU Mosaic
  relayouts are the fragile part). Per-node outputs leave as [Np, 1] columns.
* Everything in the kernel is int32/bf16/f32: bool refs are poorly supported
  on Mosaic, so the mask leaves as int32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxspec.pallas import target_platform

# The shared leaf module, not jaxspec.speculative.tree: that module dispatches
# to this kernel, and a kernel never imports its callers.
from jaxspec.pallas.types import TreeInfo, assemble_tree_info, node_valid


def _padded_nodes(n: int) -> int:
    return max(16, 1 << max(0, (n - 1).bit_length()))


def _tree_kernel(prefix_ref, prow_ref, pcol_ref, trow_ref, tcol_ref,
                 mask_ref, depth_ref, pos_ref, next_tok_ref, next_sib_ref,
                 *, n_squarings: int):
    # Refs (batch dim squeezed): prefix [1,1]; p/t row [1,Np]; p/t col [Np,1];
    # mask [Np,Np]; depth/pos/next_tok/next_sib [Np,1].
    np_ = prow_ref.shape[-1]
    prow, pcol = prow_ref[...], pcol_ref[...]
    ri = lax.broadcasted_iota(jnp.int32, (np_, np_), 0)  # row node i
    cj = lax.broadcasted_iota(jnp.int32, (np_, np_), 1)  # column node j
    vrow = (trow_ref[...] >= 0) | (lax.broadcasted_iota(jnp.int32, (1, np_), 1) == 0)
    vcol = (tcol_ref[...] >= 0) | (lax.broadcasted_iota(jnp.int32, (np_, 1), 0) == 0)

    # 1. Closure of I + (i -> parent(i)); padding rows have no edge so they
    #    see only themselves. After k squarings paths up to 2^k are covered.
    reach = (ri == cj) | ((cj == pcol) & vcol & (ri >= 1))
    for _ in range(n_squarings):
        m = jnp.where(reach, 1.0, 0.0).astype(jnp.bfloat16)  # 0/1 exact in bf16
        reach = jnp.dot(m, m, preferred_element_type=jnp.float32) > 0.5
    reach_i = jnp.where(reach, 1, 0).astype(jnp.int32)
    mask_ref[...] = reach_i

    # 2. Depth from the ancestor count; padding sits at depth 1 (parent 0).
    depth = jnp.sum(reach_i, axis=1, keepdims=True) - 1 + jnp.where(vcol, 0, 1)
    depth_ref[...] = depth
    pos_ref[...] = depth + prefix_ref[...]

    # 3. First real child of row i / next real sibling after row i.
    child = (prow == ri) & vrow & (cj >= 1)
    first = jnp.min(jnp.where(child, cj, np_), axis=1, keepdims=True)
    next_tok_ref[...] = jnp.where(first == np_, -1, first)
    sib = (pcol == prow) & (cj > ri) & vrow & vcol & (ri >= 1)
    nxt = jnp.min(jnp.where(sib, cj, np_), axis=1, keepdims=True)
    next_sib_ref[...] = jnp.where(nxt == np_, -1, nxt)


def _target_platform() -> str:
    # A seam for tests that cross-lower to GPU/TPU from a CPU host.
    return target_platform()


def _compiler_params(interpret: bool, platform: str | None = None):
    if interpret:
        return None
    backend = platform or _target_platform()
    if backend == "gpu":
        # Explicit Triton params: in JAX 0.10 pallas_call on GPU otherwise
        # lowers through Mosaic GPU (jax_pallas_use_mosaic_gpu defaults True).
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=4)
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel",))
    return None


@functools.partial(jax.jit, static_argnames=("max_kv", "interpret", "platform"))
def build_tree_pallas(
    tokens: jax.Array,  # [B, N] int32; < 0 marks padding
    parents: jax.Array,  # [B, N] int32; parents[:, 0] = -1, parents[:, i] < i
    prefix_lens: jax.Array,  # [B] int32
    *,
    max_kv: int | None = None,
    interpret: bool = False,
    platform: str | None = None,
) -> TreeInfo:
    """Kernel version of `jaxspec.speculative.tree.build_tree_ref` (same outputs).

    `platform` (default: `_target_platform()`) picks the compiler params; the
    dispatcher passes it so that jit's trace cache keys on it, and a trace made
    for one platform is never reused when lowering for another."""
    b, n = tokens.shape
    np_ = _padded_nodes(n)
    # k squarings cover paths of 2^k edges; real paths have <= n-1 edges
    # (padding nodes, including the Np-n extra ones, have no edge at all).
    n_squarings = max(n - 2, 0).bit_length()

    # 1. Pad to Np nodes; extra nodes are padding children of the root.
    tok = jnp.pad(tokens.astype(jnp.int32), ((0, 0), (0, np_ - n)), constant_values=-1)
    par = jnp.pad(parents.astype(jnp.int32), ((0, 0), (0, np_ - n)), constant_values=0)
    prefix = prefix_lens.astype(jnp.int32).reshape(b, 1, 1)

    # 2. One program per sequence; every block spans whole per-sequence dims,
    #    which satisfies both Triton (power-of-two) and Mosaic (full-dim) rules.
    def spec(*shape):
        return pl.BlockSpec((None, *shape), lambda i: (i,) + (0,) * len(shape))

    col = jax.ShapeDtypeStruct((b, np_, 1), jnp.int32)
    kernel = functools.partial(_tree_kernel, n_squarings=n_squarings)
    mask, depth, pos, next_tok, next_sib = pl.pallas_call(
        kernel,
        grid=(b,),
        in_specs=[spec(1, 1), spec(1, np_), spec(np_, 1), spec(1, np_), spec(np_, 1)],
        out_specs=[spec(np_, np_), spec(np_, 1), spec(np_, 1), spec(np_, 1), spec(np_, 1)],
        out_shape=[jax.ShapeDtypeStruct((b, np_, np_), jnp.int32), col, col, col, col],
        interpret=interpret,
        compiler_params=_compiler_params(interpret, platform),
        name="build_tree",
    )(prefix, par[:, None, :], par[:, :, None], tok[:, None, :], tok[:, :, None])

    # 3. Strip the padding nodes and restore dtypes.
    mask = mask[:, :n, :n] != 0
    info = assemble_tree_info(depth[:, :n, 0], mask, next_tok[:, :n, 0], next_sib[:, :n, 0],
                              node_valid(tokens), prefix_lens, max_kv)
    # assemble_tree_info recomputes positions identically; keep the kernel's.
    return dataclasses.replace(info, positions=pos[:, :n, 0])
