"""Containers of the speculative loop: proposals, feature requests, target outputs, commits.

A leaf module (jax, and the kernels' own leaf `jaxspec.pallas.types`, whose VerifyResult,
TreeInfo and tree-mask helpers it re-exports). The conventions are documented where they are
used: the tree convention in `jaxspec.speculative.tree`, the bonus-token convention in
`jaxspec.speculative.verify`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax

from jaxtyping import Array, Bool, Float, Int

# --------------------------------------------------------------------------
# A drafter's proposal (protocol: jaxspec.speculative.protocol)
# --------------------------------------------------------------------------


class Proposal(NamedTuple):
    tokens: Int[Array, "B N"]  # node 0 = root; -1 = padding
    parents: Int[Array, "B N"] | None  # None = chain (parents[i] = i - 1)
    draft_probs: Float[Array, "B N V"] | None  # q each node was drawn from; None = deterministic
    state: Any  # the drafter's new state


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=["layers"])
@dataclasses.dataclass(frozen=True)
class TargetKV:
    """The target cache's layers a drafter declared (`target_kv_layers`), read-only in `propose`.

    Per declared layer its page pool [P, page_size, kvh, hd] (RoPE applied), a slice of the loop's
    cache carry: no copy is made, and writing is impossible (propose returns no cache). Slots below
    hist_len - 1 hold the committed tokens' K/V; the root's is written by the verify forward. The
    layer ids are static (pytree metadata), so a jitted caller may pass the view as an argument."""
    layers: tuple[int, ...]
    k: tuple[Float[Array, "P S KVH HD"], ...]
    v: tuple[Float[Array, "P S KVH HD"], ...]


class FeatureRequest(NamedTuple):
    """Which target hidden states a drafter reads (a static declaration).

    `layers`: the residual stream ENTERING each listed decoder layer (k in
    [0, L]; k = L is the last layer's output before the final norm), the
    EAGLE-3 / vLLM convention. `final_norm`: the final-norm hidden state, the
    LM head's input (EAGLE-1, MTP, Medusa, the MLP speculator). Features are
    concatenated in that order: layers first, then the final-norm state.
    """

    layers: tuple[int, ...] = ()
    final_norm: bool = False

    @property
    def any(self) -> bool:
        return bool(self.layers) or self.final_norm

    def width(self, hidden_size: int) -> int:
        return hidden_size * (len(self.layers) + int(self.final_norm))


class Committed(NamedTuple):
    """What one verify step committed, as a drafter's `observe` (draft-extend) reads it.

    Column 0 is the old root (cache slot `start`), then the accepted drafts:
    `tokens[:, :count]` are the tokens now in the target cache at slots
    start.., `features[:, :count]` their target features, and the bonus
    token (the new root, not yet in any cache) is `bonus`. Rows that were done
    before the step have count 0. The same layout describes a prefill chunk
    (`start` = its first slot, `count` = its length, no bonus yet).
    """

    tokens: Int[Array, "B W"]
    features: Float[Array, "B W F"] | None
    start: Int[Array, "B"]
    count: Int[Array, "B"]
    bonus: Int[Array, "B"] | None = None
    # Prefill only: rows whose chunk resumes after a prefix served from the prefix cache. Their
    # drafter state before `start` is the cached pages', which a feature drafter's pending feature
    # does not match; the pair it would write at start - 1 is in those pages already.
    after_cache: Bool[Array, "B"] | None = None


# The verification result, tree info and draft-id test are shared with the kernels, which
# import nothing above them: they live in their leaf module and are re-exported here.
from jaxspec.pallas.types import (  # noqa: E402,F401
    TreeInfo, VerifyResult, assemble_tree_info, full_tree_mask, in_vocab, node_valid,
)


class DrafterContractError(ValueError):
    """A drafter whose `propose` output contradicts what it declares (protocol.py)."""
