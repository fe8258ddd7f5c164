"""Building blocks of the Llama family: RMSNorm, RoPE (default/linear/llama3), linear."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxspec.models.config import ModelConfig
from jaxspec.native.block_matmul import BlockWeight, block_matmul
from jaxspec.native.packed_matmul import PackedWeight, packed_matmul


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """Weight-only int8 for XLA's own dot (TPU, GPU, a mesh, engine.cpu_kernels = xla): the same
    per-output-column quantization as the packed int8 kernel (`quantize_int8`), so every path
    computes with the same dequantized weights. The convert sits beside the dot for XLA to fuse."""

    q: jax.Array  # [..., K, N] int8
    scale: jax.Array  # [..., N] float32


def rms_norm(
    x: jax.Array,  # [..., d]
    weight: jax.Array,  # [d]
    eps: float,
) -> jax.Array:  # [..., d]
    # Statistics in f32 whatever the activation dtype, as Hugging Face does.
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * xf).astype(x.dtype)


def linear(
    x: jax.Array,  # [..., in]
    w,  # [in, out] array, PackedWeight, BlockWeight or Int8Weight (see models.llama.prepare_params)
) -> jax.Array:  # [..., out]
    if isinstance(w, PackedWeight):
        return packed_matmul(x, w)
    if isinstance(w, BlockWeight):
        return block_matmul(x, w)
    if isinstance(w, Int8Weight):
        return jnp.einsum("...i,io->...o", x, w.q.astype(x.dtype)) * w.scale.astype(x.dtype)
    # [in, out] measured 15-25% faster than Hugging Face's [out, in] on XLA:CPU
    # for 2-16 rows (the verify and batched-decode shapes), and equal at 1 row.
    return jnp.einsum("...i,io->...o", x, w.astype(x.dtype) if w.dtype != x.dtype else w)


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:  # [head_dim // 2] f32
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    sc = cfg.rope_scaling
    if sc.rope_type == "linear":
        inv = inv / sc.factor
    elif sc.rope_type == "llama3":
        # Llama 3.1 frequency-dependent scaling: long wavelengths are divided by
        # `factor`, short ones kept, and the band between is interpolated.
        low_wl = sc.original_max_position_embeddings / sc.low_freq_factor
        high_wl = sc.original_max_position_embeddings / sc.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
            sc.high_freq_factor - sc.low_freq_factor
        )
        scaled = jnp.where(wavelen > low_wl, inv / sc.factor, inv)
        mid = (1 - smooth) * scaled / sc.factor + smooth * scaled
        is_mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        inv = jnp.where(is_mid, mid, scaled)
    return inv


def rope_tables(
    positions: jax.Array,  # [B, T] int32
    inv_freq: jax.Array,  # [hd/2]
) -> tuple[jax.Array, jax.Array]:  # cos, sin: [B, T, hd]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(
    x: jax.Array,  # [B, T, heads, hd]
    cos: jax.Array,  # [B, T, hd]
    sin: jax.Array,  # [B, T, hd]
) -> jax.Array:
    # Hugging Face "rotate_half" convention (not interleaved pairs).
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * c + rotated * s
