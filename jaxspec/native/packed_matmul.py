"""Packed-weight float32 matmul for XLA:CPU: the FFI kernel (packed_matmul.cc) beside its jnp reference.

Built and registered by `jaxspec.native.build`.

Layout: a weight [K, N] (the runtime [in, out] layout) becomes `PackedWeight`
with `tiles` [ceil(N/64), K, 64], zero-padded, so each 64-column tile is one
contiguous stream (see packed_matmul.cc for why that matters).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.native.build import ensure_registered

TILE = 64
TARGET = "jaxspec_packed_matmul"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A [K, N] float32 weight as column tiles, for `packed_matmul`."""

    tiles: jax.Array  # [..., ceil(N/64), K, 64] float32 (leading axes: stacked layers)
    n_out: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:  # the logical [..., K, N]
        return self.tiles.shape[:-3] + (self.tiles.shape[-2], self.n_out)

    @property
    def dtype(self):
        return self.tiles.dtype

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes


def pack_weight(
    w: jax.Array,  # [..., K, N] float32
) -> PackedWeight:
    *lead, k, n = w.shape
    tiles = -(-n // TILE)
    pad = [(0, 0)] * (len(lead) + 1) + [(0, tiles * TILE - n)]
    padded = jnp.pad(jnp.asarray(w, jnp.float32), pad).reshape(*lead, k, tiles, TILE)
    return PackedWeight(tiles=jnp.swapaxes(padded, -3, -2), n_out=n)


def unpack_weight(pw: PackedWeight) -> jax.Array:  # [..., K, N]
    *lead, t, k, _ = pw.tiles.shape
    return jnp.swapaxes(pw.tiles, -3, -2).reshape(*lead, k, t * TILE)[..., : pw.n_out]


def packed_matmul_ref(
    x: jax.Array,  # [..., K] float32
    pw: PackedWeight,
) -> jax.Array:  # [..., N] float32
    """The jnp reference: XLA's own dot on the unpacked weight."""
    return jnp.einsum("...i,io->...o", x, unpack_weight(pw))


def packed_matmul(
    x: jax.Array,  # [..., K] float32
    pw: PackedWeight,
) -> jax.Array:  # [..., N] float32
    """x @ W through the FFI kernel (built and registered on first trace)."""
    ensure_registered()
    if x.dtype != jnp.float32 or pw.tiles.dtype != jnp.float32:
        raise TypeError(f"packed_matmul is float32 only, got x {x.dtype} and weight {pw.tiles.dtype}")
    if pw.tiles.ndim != 3:
        raise ValueError(f"packed_matmul takes one layer's weight [tiles, K, 64], got {pw.tiles.shape}")
    if x.shape[-1] != pw.tiles.shape[1]:
        raise ValueError(f"x's last axis {x.shape[-1]} != the weight's K {pw.tiles.shape[1]}")
    out = jax.ShapeDtypeStruct(x.shape[:-1] + (pw.n_out,), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x, pw.tiles, n_out=np.int64(pw.n_out))
