"""The types the kernels share with their callers: a leaf module (imports only JAX).

VerifyResult (the bonus-token convention: `jaxspec.speculative.verify`), TreeInfo and the
tree-mask helpers (the tree convention: `jaxspec.speculative.tree`), and `in_vocab`, the draft
test every verifier makes. `jaxspec.speculative.types` re-exports them for the loop's code.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


# --------------------------------------------------------------------------
# Verification result (bonus-token convention: jaxspec.speculative.verify)
# --------------------------------------------------------------------------


class VerifyResult(NamedTuple):
    """See `jaxspec.speculative.verify` for the convention."""

    accept_index: Int[Array, "B D1"]  # [B, max_depth + 1] int32, -1 padded
    num_accepted: Int[Array, "B"]  # [B] int32, accepted drafts only
    bonus_token: Int[Array, "B"]  # [B] int32


# --------------------------------------------------------------------------
# Tree info (tree convention: jaxspec.speculative.tree)
# --------------------------------------------------------------------------


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "depth", "positions", "mask", "retrieve_next_token", "retrieve_next_sibling",
        "valid", "prefix_lens", "full_mask",
    ],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class TreeInfo:
    """Everything verification needs about one batch of draft trees.

    Index tables are int32; -1 means "none".
    """

    depth: jax.Array  # [B, N] int32; root 0, padding nodes 1 (child of root)
    positions: jax.Array  # [B, N] int32; prefix_lens + depth (siblings share)
    mask: jax.Array  # [B, N, N] bool; [b,i,j]: j is ancestor-or-self of i
    retrieve_next_token: jax.Array  # [B, N] int32; first non-padding child
    retrieve_next_sibling: jax.Array  # [B, N] int32; next non-padding sibling
    valid: jax.Array  # [B, N] bool; False for padding nodes
    prefix_lens: jax.Array  # [B] int32
    full_mask: jax.Array | None = None  # [B, N, max_kv] bool if max_kv given

    def full_layout_mask(self, max_kv: int) -> jax.Array:
        """[B, N, max_kv] bool; see `full_tree_mask`."""
        return full_tree_mask(self.mask, self.prefix_lens, max_kv)


def node_valid(tokens: Int[Array, "B N"]) -> Bool[Array, "B N"]:
    """tokens [B, N] int32 -> [B, N] bool; the root always counts as real."""
    idx = jnp.arange(tokens.shape[-1], dtype=jnp.int32)
    return (tokens >= 0) | (idx == 0)


def full_tree_mask(
    mask: Bool[Array, "B N N"],
    prefix_lens: Int[Array, "B"],
    max_kv: int,
) -> Bool[Array, "B N S"]:
    """Expand the qlen-only mask to the full KV layout.

    mask [B, N, N] bool, prefix_lens [B] int32 -> [B, N, max_kv] bool where key
    slot s is visible to node i iff s < prefix_lens[b], or s = prefix_lens[b] + j
    with mask[b, i, j]. Slots past prefix_lens + N are never visible.
    """
    b, n, _ = mask.shape
    slot = jnp.arange(max_kv, dtype=jnp.int32)
    j = slot[None, :] - prefix_lens[:, None].astype(jnp.int32)  # [B, max_kv]
    in_tree = (j >= 0) & (j < n)
    jj = jnp.broadcast_to(jnp.clip(j, 0, n - 1)[:, None, :], (b, n, max_kv))
    tree_part = jnp.take_along_axis(mask, jj, axis=2) & in_tree[:, None, :]
    return (slot[None, None, :] < prefix_lens[:, None, None]) | tree_part


def assemble_tree_info(
    depth: Int[Array, "B N"],
    mask: Bool[Array, "B N N"],
    next_token: Int[Array, "B N"],
    next_sibling: Int[Array, "B N"],
    valid: Bool[Array, "B N"],
    prefix_lens: Int[Array, "B"],
    max_kv: int | None,
) -> TreeInfo:
    """Add the derived fields (positions, full mask)."""
    prefix_lens = prefix_lens.astype(jnp.int32)
    return TreeInfo(
        depth=depth,
        positions=prefix_lens[:, None] + depth,
        mask=mask,
        retrieve_next_token=next_token,
        retrieve_next_sibling=next_sibling,
        valid=valid,
        prefix_lens=prefix_lens,
        full_mask=None if max_kv is None else full_tree_mask(mask, prefix_lens, max_kv),
    )


# --------------------------------------------------------------------------
# Draft ids the verifiers may accept
# --------------------------------------------------------------------------


def in_vocab(tokens: Int[Array, "..."], vocab: int) -> Bool[Array, "..."]:
    """tokens [...] int -> [...] bool: a real token id, 0 <= t < vocab.

    Every verifier tests a draft only when this holds. A negative id is
    padding; an id >= vocab can come from an unchecked drafter (an n-gram
    corpus past the vocabulary), and a clamped gather would read a real
    probability for it, so without this test it could be accepted and emitted.
    """
    return (tokens >= 0) & (tokens < vocab)
