"""GGUF block-quantized matmul for XLA:CPU: the FFI kernel (block_matmul.cc) beside its jnp reference.

`engine.quantize = "gguf"` computes on a GGUF's own Q4_0 / Q4_1 / Q8_0 blocks: 32 consecutive
input rows of one output column share a float16 scale d (and, 4-bit, a minimum m):
w = d * q + m, q in 0..15 (Q4_0 is Q4_1 with m = -8 d, exact in float16), or w = d * q, q int8
(Q8_0). `decode_blocks` splits llama.cpp's byte layout into (q, d, m); `pack_blocks` rearranges
the same bits into the kernel's column tiles (see block_matmul.cc). The reference dequantizes
with the same arithmetic and runs XLA's dot: the kernel equals it up to summation order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.native.packed_matmul import ffi_matmul

TILE = 64
BLOCK = 32
TARGET_Q4 = "jaxspec_block_matmul_q4"
TARGET_Q8 = "jaxspec_block_matmul_q8"
# llama.cpp's block byte layouts (ggml-common.h): float16 d [, float16 m], then the values.
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockWeight:
    """A [K, N] weight as GGUF blocks in column tiles, for `block_matmul`."""

    q: jax.Array  # [..., tiles, K, 32] uint8 (4-bit: two values a byte) or [..., tiles, K, 64] int8 (8-bit)
    d: jax.Array  # [..., tiles, K / 32, 64] float16 block scales
    m: jax.Array | None  # [..., tiles, K / 32, 64] float16 block minimums (4-bit), None (8-bit)
    n_out: int = dataclasses.field(metadata=dict(static=True))

    @property
    def bits(self) -> int:
        return 4 if self.m is not None else 8

    @property
    def shape(self) -> tuple[int, ...]:  # the logical [..., K, N]
        return self.q.shape[:-3] + (self.q.shape[-2], self.n_out)

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.d.nbytes + (0 if self.m is None else self.m.nbytes)


def decode_blocks(
    raw: np.ndarray,  # [N, K / 32 * BLOCK_BYTES[kind]] uint8: one GGUF tensor's rows, as stored
    kind: str,  # "Q4_0" | "Q4_1" | "Q8_0"
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:  # q [N, K] uint8 0..15 or int8, d, m [N, K / 32] f16
    """llama.cpp's bytes -> (q, d, m), the same bits: nothing is rounded."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"GGUF block type {kind} is not one of {sorted(BLOCK_BYTES)}")
    size = BLOCK_BYTES[kind]
    n = raw.shape[0]
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % size:
        raise ValueError(f"a {kind} tensor is [rows, blocks * {size}] uint8, got {raw.dtype} {raw.shape}")
    blocks = np.ascontiguousarray(raw).reshape(n, -1, size)
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    if kind == "Q8_0":
        return blocks[..., 2:].copy().view(np.int8).reshape(n, -1), d, None
    qs = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]  # [N, nb, 16]: value j low nibble, j + 16 high
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, -1)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0] if kind == "Q4_1" else (d * np.float16(-8)).astype(np.float16)
    return q, d, m


def pack_blocks(
    q,  # [..., N, K] uint8 0..15 (4-bit, with m) or int8 (8-bit, m None): rows are output columns
    d,  # [..., N, K / 32] float16
    m=None,  # [..., N, K / 32] float16
) -> BlockWeight:
    """(q, d, m) in GGUF's row order -> the kernel's column tiles; leading axes (stacked layers) kept."""
    *lead, n, k = q.shape
    if k % BLOCK:
        raise ValueError(f"GGUF blocks need K divisible by {BLOCK}, got {k}")
    tiles = -(-n // TILE)
    pad = [(0, 0)] * len(lead) + [(0, tiles * TILE - n), (0, 0)]

    def tiled(a):  # [..., N, X] -> [..., tiles, X, 64]
        a = jnp.pad(jnp.asarray(a), pad).reshape(*lead, tiles, TILE, a.shape[-1])
        return jnp.swapaxes(a, -1, -2)

    d = tiled(jnp.asarray(d, jnp.float16))
    if m is None:
        return BlockWeight(q=tiled(jnp.asarray(q, jnp.int8)), d=d, m=None, n_out=n)
    qt = tiled(jnp.asarray(q, jnp.uint8))  # [..., tiles, K, 64]
    packed = qt[..., : TILE // 2] | (qt[..., TILE // 2:] << 4)  # byte i: column i | column 32 + i
    return BlockWeight(q=packed, d=d, m=tiled(jnp.asarray(m, jnp.float16)), n_out=n)


def dequantize(bw: BlockWeight) -> jax.Array:  # [..., K, N] float32
    """The reference's weights: d * q + m per block, in float32, as the kernel computes each weight."""
    if bw.m is None:
        q = bw.q.astype(jnp.float32)
    else:
        q = jnp.concatenate([bw.q & 0xF, bw.q >> 4], axis=-1).astype(jnp.float32)
    per_row = lambda s: jnp.repeat(s.astype(jnp.float32), BLOCK, axis=-2)  # noqa: E731 [..., tiles, K, 64]
    w = q * per_row(bw.d) + (0.0 if bw.m is None else per_row(bw.m))
    *lead, t, k, _ = w.shape
    return jnp.swapaxes(w, -3, -2).reshape(*lead, k, t * TILE)[..., : bw.n_out]


def block_matmul(
    x: jax.Array,  # [..., K] float32
    bw: BlockWeight,
) -> jax.Array:  # [..., N] float32
    """x @ W through the FFI kernel."""
    if x.dtype != jnp.float32:
        raise TypeError(f"block_matmul takes float32 x, got {x.dtype}")
    if bw.m is None:
        return ffi_matmul(TARGET_Q8, x, bw.n_out, bw.q, bw.d)
    return ffi_matmul(TARGET_Q4, x, bw.n_out, bw.q, bw.d, bw.m)
