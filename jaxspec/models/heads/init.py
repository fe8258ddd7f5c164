"""Fresh draft heads for a target: the HeadConfig a published checkpoint of that
kind would parse to, and random weights in the loaders' (Hugging Face) layout.

Used where no trained head exists yet: the speed benchmarks (a head's cost does
not depend on its weights) and the start of drafter training. Each family writes
its own (`fresh`, `init` in its module); scales keep activations O(1) so timings
see realistic numerics (no denormals, no NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.config import ModelConfig
from jaxspec.models.heads.config import HeadConfig
from jaxspec.models.heads.family import family_of


def head_config(kind: str, target: ModelConfig, **opts) -> HeadConfig:
    """The HeadConfig of a fresh `kind` head shaped for `target`. `opts` are the family's own
    (draft_vocab_size, feature_layers for EAGLE-3; num_heads for Medusa and the MLP speculator;
    num_layers, block_size, mask_token_id, markov_rank for the block drafters); others are ignored."""
    family = family_of(kind)
    if family.fresh is None:
        raise ValueError(f"no fresh head of kind {kind!r}")
    return family.fresh(kind, target, **opts)


def init_head_params(hcfg: HeadConfig, seed: int = 0, *, token_ids=None, dtype=jnp.float32) -> dict:
    """Random params (HF layout, as `load_draft_head` returns them). `token_ids`: the
    target ids of an EAGLE-3 draft vocabulary, ascending (default: the first ones)."""
    family = family_of(hcfg.kind)
    if family.init is None:
        raise ValueError(f"no fresh head of kind {hcfg.kind!r}")
    p = family.init(hcfg, seed, token_ids)
    return jax.tree.map(lambda x: jnp.asarray(x) if np.asarray(x).dtype.kind in "ib" else jnp.asarray(x, dtype), p)
