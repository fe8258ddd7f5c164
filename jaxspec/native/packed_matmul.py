"""Packed-weight matmul for XLA:CPU: the FFI kernel (packed_matmul.cc) beside its jnp reference.

Built and registered by `jaxspec.native.build`.

Layout: a weight [K, N] (the runtime [in, out] layout) becomes `PackedWeight`
with `tiles` [ceil(N/64), K, 64], zero-padded, so each 64-column tile is one
contiguous stream (see packed_matmul.cc for why that matters). Weight-only int8
(`quantize_int8`): int8 tiles and a float32 scale per output column (symmetric,
max |w| over the column / 127): the kernel widens the weights in registers, so a
decode step streams a quarter of float32's bytes; activations stay float32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.native.build import ensure_registered

TILE = 64
TARGET = "jaxspec_packed_matmul"
TARGET_I8 = "jaxspec_packed_matmul_i8"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A [K, N] weight as column tiles, for `packed_matmul`: float32, or int8 with `scales`."""

    tiles: jax.Array  # [..., ceil(N/64), K, 64] float32 or int8 (leading axes: stacked layers)
    n_out: int = dataclasses.field(metadata=dict(static=True))
    scales: jax.Array | None = None  # [..., ceil(N/64) * 64] float32 per output column (int8 tiles)

    @property
    def shape(self) -> tuple[int, ...]:  # the logical [..., K, N]
        return self.tiles.shape[:-3] + (self.tiles.shape[-2], self.n_out)

    @property
    def dtype(self):
        return self.tiles.dtype

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes + (0 if self.scales is None else self.scales.nbytes)


def quantize_int8(
    w: jax.Array,  # [..., K, N] float32
) -> tuple[jax.Array, jax.Array]:  # ([..., K, N] int8, [..., N] float32)
    """Symmetric per-output-column int8: q = round(w / s), s = max |w[:, n]| / 127 (1 for a zero column)."""
    w = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w), axis=-2)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(w / scale[..., None, :]), -127, 127).astype(jnp.int8)
    return q, scale


def pack_weight(
    w,  # [..., K, N] float32, or (q [..., K, N] int8, scale [..., N] float32) already quantized
    int8: bool = False,
) -> PackedWeight:
    quantized = isinstance(w, tuple)
    *lead, k, n = w[0].shape if quantized else w.shape
    tiles = -(-n // TILE)
    pad = [(0, 0)] * (len(lead) + 1) + [(0, tiles * TILE - n)]
    scales = None
    if int8 or quantized:
        w, scales = w if quantized else quantize_int8(w)
        scales = jnp.pad(jnp.asarray(scales, jnp.float32), pad[1:], constant_values=1.0)
    else:
        w = jnp.asarray(w, jnp.float32)
    padded = jnp.pad(w, pad).reshape(*lead, k, tiles, TILE)
    return PackedWeight(tiles=jnp.swapaxes(padded, -3, -2), n_out=n, scales=scales)


def unpack_weight(pw: PackedWeight) -> jax.Array:  # [..., K, N] float32 (int8 dequantized)
    *lead, t, k, _ = pw.tiles.shape
    w = jnp.swapaxes(pw.tiles, -3, -2).reshape(*lead, k, t * TILE)
    if pw.scales is not None:
        w = w.astype(jnp.float32) * pw.scales[..., None, :]
    return w[..., : pw.n_out]


def ffi_matmul(
    target: str,  # the registered FFI kernel
    x: jax.Array,  # [..., K] float32
    n_out: int,
    *weights: jax.Array,  # the kernel's weight operands in its order, first the stream [tiles, K, X]
) -> jax.Array:  # [..., n_out] float32
    """x @ W through an FFI matmul kernel (built and registered on first trace), the shapes checked
    for every kernel alike: the packed float / int8 tiles here and the GGUF blocks (block_matmul)."""
    ensure_registered()
    stream = weights[0]
    if stream.ndim != 3:
        raise ValueError(f"{target} takes one layer's weight [tiles, K, X], got {stream.shape}")
    if x.shape[-1] != stream.shape[1]:
        raise ValueError(f"x's last axis {x.shape[-1]} != the weight's K {stream.shape[1]}")
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (n_out,), jnp.float32)
    return jax.ffi.ffi_call(target, out)(x, *weights, n_out=np.int64(n_out))


def packed_matmul(
    x: jax.Array,  # [..., K] float32
    pw: PackedWeight,
) -> jax.Array:  # [..., N] float32
    """x @ W through the FFI kernel."""
    int8 = pw.scales is not None
    if x.dtype != jnp.float32 or pw.tiles.dtype != (jnp.int8 if int8 else jnp.float32):
        raise TypeError(f"packed_matmul takes float32 x and float32 or int8 (with scales) weights, got x {x.dtype} "
                        f"and weight {pw.tiles.dtype}")
    if int8:
        return ffi_matmul(TARGET_I8, x, pw.n_out, pw.tiles, pw.scales)
    return ffi_matmul(TARGET, x, pw.n_out, pw.tiles)
