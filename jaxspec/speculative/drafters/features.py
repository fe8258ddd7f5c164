"""What every feature drafter shares: its state, the pending feature, and draft choice.

THE PENDING-FEATURE CONVENTION. A drafter reading target features pairs each
feature with the token after it: pair i is (h_i, x_{i+1}), where h_i is the
target's feature at position i (EAGLE trains on these pairs; Medusa and the
MLP speculator read h alone). At propose time the root x_r (r = hist_len - 1)
is committed but the target has not run on it yet, so the newest feature is
h_{r-1}, the one that predicted the root: the drafter state keeps it as
`pending` [B, F]. A drafter with attention keeps pairs 0 .. r-2 in its own
paged cache (pair i at slot i, RoPE position i); drafting starts from the pair
(pending, root) at slot r-1 and never writes the cache. Prefill chunks and
post-verify `observe` write the pairs that became complete, which is one
function (`extend_pairs`) because both are "tokens at slots start.. with their
features": pairs at slots start-1 .. start+count-2 and the new pending feature
features[count-1].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxspec.cache.paged import NULL_PAGE, KVCache, slot_to_page, write_layer_kv
from jaxspec.speculative.penalties import penalize_draft
from jaxspec.speculative.sampling import draft_noise, race_filtered, race_key, race_sample, target_probs_from_logits
from jaxspec.speculative.types import Committed, Proposal


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FeatureState:
    cache: KVCache | None  # the head's own paged K/V (1 layer); None for heads without attention
    pending: jax.Array  # [B, F] target feature at position hist_len - 2 (see the module doc)


def next_pending(
    pending: Float[Array, "B F"],
    c: Committed,
) -> Float[Array, "B F"]:
    """The feature of the newest committed token: features[count - 1] (unchanged where count is 0)."""
    last = jnp.take_along_axis(c.features, jnp.maximum(c.count - 1, 0)[:, None, None], axis=1)[:, 0]
    return jnp.where((c.count > 0)[:, None], last.astype(pending.dtype), pending)


def pair_inputs(
    pending: Float[Array, "B F"],
    c: Committed,
) -> tuple[Int[Array, "B W"], Float[Array, "B W F"], Int[Array, "B W"], jax.Array]:
    """(tokens, features, slots, valid) of the pairs a chunk completes: pair j at slot
    start - 1 + j is (features[j - 1] or pending for j = 0, tokens[j])."""
    w = c.tokens.shape[1]
    feats = jnp.concatenate([pending[:, None].astype(c.features.dtype), c.features[:, :-1]], axis=1)
    j = jnp.arange(w, dtype=jnp.int32)[None, :]
    slots = c.start[:, None] - 1 + j
    valid = (j < c.count[:, None]) & (slots >= 0)
    if c.after_cache is not None:  # that pair is in the shared pages, and `pending` is not its feature
        valid &= ~(c.after_cache[:, None] & (j == 0))
    return c.tokens, feats, jnp.maximum(slots, 0), valid


def write_pairs_kv(cache: KVCache, page_table, slots, valid, k, v) -> KVCache:
    """Scatter the head's K/V [B, W, kvh, hd] for pairs at `slots`; invalid ones hit the null page."""
    pages, offsets = slot_to_page(page_table, slots, cache.page_size)
    pages = jnp.where(valid, pages, NULL_PAGE)
    ck, cv = write_layer_kv(cache.k, cache.v, 0, pages, offsets, k, v)
    return KVCache(k=ck, v=cv)


def choose_draft(
    logits: Float[Array, "B Vd"],
    s,
    prev: list,
    d2t: Int[Array, "Vd"] | None,
    vocab: int,
    sample: bool,
    coupled: bool = False,
) -> tuple[Int[Array, "B"], Float[Array, "B V"] | None]:
    """One chain draft from draft logits: (target token id, q over the TARGET vocabulary | None).

    `s` is the loop state and `prev` the drafts before this one ([B] each): the draft's depth
    is len(prev) + 1, and the request's penalties / bias / min_tokens apply to its logits under
    that prefix (`penalties.penalize_draft`), as the verify step applies them to the target's.
    Greedy: the argmax. Rejection verify (`sample`): a draw from the request's own
    temperature / top-k / top-p applied to the draft logits, keyed by the step's draft key,
    with q returned over the target vocabulary (zero outside a reduced draft vocabulary,
    which `d2t` maps into it). Greedy rows of a sampled batch get a one-hot q, so they stay
    exactly greedy. `coupled` (the coupled verify rule, which never reads q): the draft is
    the race of the draft distribution under the target's own noise at the draft's position
    (`sampling.race_filtered` with the key plain sampling uses there), so a q close to p
    lands on the token the target will race to; no q is built.
    """
    sampling, hist_len, depth = s.sampling, s.hist_len, len(prev) + 1
    logits = penalize_draft(logits, s, prev, d2t, vocab)

    def greedy():
        idx = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return idx if d2t is None else d2t[idx]

    if not sample:
        return greedy(), None
    if coupled:
        keys = jax.vmap(race_key)(sampling.seed, hist_len + depth - 1)[:, None]
        idx = race_filtered(logits[:, None], sampling.temperature, sampling.top_k, sampling.top_p, keys,
                            token_ids=d2t)[:, 0]
        return (idx if d2t is None else d2t[idx]), None

    def sampled():
        q = target_probs_from_logits(logits[:, None], sampling.temperature, sampling.top_k, sampling.top_p)[:, 0]
        noise = draft_noise(sampling.seed, hist_len, depth, q.shape[-1])
        idx = race_sample(q, noise).astype(jnp.int32)
        if d2t is None:
            return idx, q
        return d2t[idx], jnp.zeros((q.shape[0], vocab), q.dtype).at[:, d2t].set(q)

    # An all-greedy batch takes the verifier's greedy rule, which never reads q
    # (`loop._verify` branches on the same predicate): skip the softmax and the
    # noise over the vocabulary, a real share of a cheap head's step on CPU.
    return jax.lax.cond(jnp.all(sampling.temperature <= 0.0),
                        lambda: (greedy(), jnp.zeros((logits.shape[0], vocab), jnp.float32)), sampled)


def topk_children(
    logits: Float[Array, "... Vd"],
    k: int,
    d2t: Int[Array, "Vd"] | None,
) -> tuple[Float[Array, "... K"], Int[Array, "... K"]]:
    """Top-k (log-prob, target id) of a node's draft distribution (EAGLE-2 expansion)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    scores, idx = jax.lax.top_k(logp, k)
    idx = idx.astype(jnp.int32)
    return scores, (idx if d2t is None else d2t[idx])


def expand_frontier(
    logits: Float[Array, "B K Vd"],
    fed_tok: Int[Array, "B K"],
    fed_sc: Float[Array, "B K"],
    k: int,
    d2t: Int[Array, "Vd"] | None,
) -> tuple[Int[Array, "B K K"], Float[Array, "B K K"]]:
    """EAGLE-2 expansion of the fed frontier: each node's top-k children (target ids) scored by
    cumulative log-prob; a padding node (token < 0) has padding children (-1, -inf)."""
    cs, ct = topk_children(logits, k, d2t)
    dead = fed_tok[:, :, None] < 0
    return jnp.where(dead, -1, ct), jnp.where(dead, -jnp.inf, fed_sc[:, :, None] + cs)


def chain_proposal(root, drafts: list, qs: list, sampled: bool, state) -> Proposal:
    """A chain Proposal from the root [B] and per-depth drafts [B] with their q [B, V] (or None)."""
    probs = None
    if sampled and qs and qs[0] is not None:  # coupled drafts carry no q
        probs = jnp.stack([jnp.zeros_like(qs[0])] + qs, axis=1)  # [B, N, V]; the root's row is unused
    return Proposal(jnp.stack([root] + drafts, axis=1), None, probs, state)
