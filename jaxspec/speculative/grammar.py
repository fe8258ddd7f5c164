"""Grammar masks inside the loop: each verify position's logits restricted to what the request's
grammar allows after that position's prefix (`jaxspec.grammar.matcher` computes the masks).

Why constrained speculation stays exact. Plain constrained decoding samples each token from
the target's distribution with the forbidden tokens' logits set to -inf (then temperature,
top-k, top-p). A verify step checks node i against the distribution plain decoding would use at
node i's position if the draft path to it were committed: the same mask, computed for the
committed output plus that path. So every verify rule (greedy, target-only, rejection) is
handed exactly the plain constrained distribution at every node it reaches, and their
per-position losslessness carries over unchanged, as it does for the penalties. In particular:
- a draft the grammar forbids has target probability 0 there: never accepted;
- the bonus token (at the last accepted node, or from the residual of the rejected children)
  is drawn from the masked distribution of its own position;
- the drafter's q is left as the drafter made it: rejection sampling is exact for whatever q
  the draft was actually drawn from (the verify is told that q), and a q with mass on forbidden
  tokens only lowers acceptance. Masking q after the draft was drawn would break exactness;
  masking it while drafting would need a host round trip per draft step.

The masks come from the host through `jax.pure_callback`, once per iteration and only when a
row of the batch carries a grammar (`lax.cond`). Only the constrained build of the programs
(`SpecPlan.constrained`) holds the callback.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxspec.grammar.matcher import batch_masks, mask_words


def unpack_bitmask(
    bits: Int[Array, "... W"],
    vocab: int,
) -> Bool[Array, "... V"]:
    """llguidance's int32 bitmask (bit t % 32 of word t // 32) as booleans over the first `vocab` ids."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    allowed = jnp.right_shift(bits[..., None], shifts) & 1
    return allowed.reshape(*bits.shape[:-1], bits.shape[-1] * 32)[..., :vocab].astype(bool)


def apply_bitmask(
    logits: Float[Array, "B N V"],
    bits: Int[Array, "B N W"],
) -> Float[Array, "B N V"]:
    """Forbidden tokens' logits to -inf (the sampler's and the verifier's zero probability)."""
    return jnp.where(unpack_bitmask(bits, logits.shape[-1]), logits, -jnp.inf).astype(logits.dtype)


def tree_parents(
    tree,
) -> Int[Array, "B N"]:
    """Each node's parent (-1: the root, padding), from the ancestor mask and depths."""
    depth, mask = tree.depth, tree.mask
    n = depth.shape[1]
    cand = mask & (depth[:, None, :] == depth[:, :, None] - 1)
    real = tree.valid & (jnp.arange(n) >= 1)[None, :]
    return jnp.where(real & cand.any(-1), jnp.argmax(cand, axis=-1), -1).astype(jnp.int32)


def _host(words, ids, history, upto, prompt_lens, tokens, parents):
    return batch_masks(np.asarray(ids), np.asarray(history), np.asarray(upto), np.asarray(prompt_lens),
                       np.asarray(tokens), np.asarray(parents), words)


def constrain(
    logits: Float[Array, "B N V"],
    grammar_ids: Int[Array, "B"],
    history: Int[Array, "B C"],
    upto: Int[Array, "B"],
    prompt_lens: Int[Array, "B"],
    tokens: Int[Array, "B N"],
    parents: Int[Array, "B N"],
) -> Float[Array, "B N V"]:
    """`logits` with each node's grammar mask applied: node i of row b predicts the token after the
    committed output history[b, prompt_lens[b]:upto[b]] and its draft path (tokens / parents, node
    0 the root). Rows with grammar id -1 and batches without a grammar pass through."""
    b, n, vocab = logits.shape
    words = mask_words(vocab)

    def run(x):
        bits = jax.pure_callback(functools.partial(_host, words), jax.ShapeDtypeStruct((b, n, words), jnp.int32),
                                 grammar_ids, history, upto, prompt_lens, tokens, parents,
                                 vmap_method="sequential")
        return apply_bitmask(x, bits)

    return jax.lax.cond(jnp.any(grammar_ids >= 0), run, lambda x: x, logits)
