"""Target-distribution processing and seeded sampling noise.

Everything here is per-request: sampling parameters arrive as arrays [B] so one
batch can mix greedy and sampled requests, and all randomness is derived from a
request's own seed folded with a position, never from a batch-wide key, so a
seeded request reproduces exactly whatever else shares its batch.

Conventions:
  * temperature <= 0 means greedy: the distribution is one-hot(argmax logits).
  * top_k <= 0 or top_k >= V disables top-k; top_p >= 1 disables top-p.
    Top-k is applied first, top-p on the renormalised top-k distribution
    (vLLM/SGLang order). Both cut at a logit value, so tokens tied with the last
    kept token are kept too (a set marginally larger than k is possible only on
    exact ties).
  * Sampling is an exponential race: token = argmax_v w[v] / E[v] with
    E ~ Exp(1) i.i.d., which draws v with probability w[v] / sum(w) for any
    non-negative, possibly unnormalised w. That is why residual distributions
    never need normalising just to be sampled.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

# fold_in tags separating the noise streams of one (seed, index) step key.
_UNIFORM_STREAM = 0  # acceptance coins, one per tree node
_EXP_STREAM = 1  # the exponential race that draws the emitted (bonus / plain) token
_DRAFT_STREAM = 2  # drafters that sample their proposals, one subkey per draft depth


def argmax_last(
    x: Float[Array, "*batch V"],
) -> Int[Array, "*batch"]:
    """jnp.argmax over the last axis (first index among ties), as two plain reductions.

    XLA:CPU runs argmax's variadic (value, index) reduce without vectorising it:
    0.92 ms for a verify block's [8, 49152] logits, against 0.30 ms for a max
    and then a min over the indices that reach it (measured). A NaN row, which
    argmax would point at, gives the last index here instead of one past it.
    """
    m = jnp.max(x, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    first = jnp.min(jnp.where(x == m, iota, x.shape[-1]), axis=-1)
    return jnp.minimum(first, x.shape[-1] - 1)


def step_key(seed: Int[Array, ""], index: Int[Array, ""]) -> jax.Array:
    """The key of every random draw of the step whose first emitted token sits at `index`.

    THE NOISE CONVENTION. A step that emits tokens at indices index, index+1,
    ... (prefill: the first new token, index = prompt length; a plain decode
    step: its one token; a verify step: its accepted drafts and bonus, index =
    root index + 1) draws all its noise from (seed, index). Every step emits at
    least one token, so the indices of successive steps strictly increase and no
    two steps of a sequence ever share noise: each step's coins and race are
    independent of everything that decided the tokens before it, which is what
    makes the whole loop (not only one verify) lossless. A verify step with
    no drafts (k = 0, the server's plain mode) races the same (seed, index)
    noise over the same distribution as a plain decode step at that index, so
    it emits exactly the token plain decoding would (tested). With drafts, a
    rejection draws from the residual instead: same distribution overall, not
    the same token.
    """
    key = jax.random.key(jnp.asarray(seed).astype(jnp.uint32))
    return jax.random.fold_in(key, jnp.asarray(index).astype(jnp.uint32))


def draft_key(seed: Int[Array, ""], index: Int[Array, ""], depth: int | Int[Array, ""]) -> jax.Array:
    """Key for a sampling drafter's draw at `depth` (1-based) in the step keyed by `index`."""
    key = jax.random.fold_in(step_key(seed, index), _DRAFT_STREAM)
    return jax.random.fold_in(key, jnp.asarray(depth).astype(jnp.uint32))


def position_noise(
    seeds: Int[Array, "B"],
    start: Int[Array, "B"],
    count: int,
    vocab_size: int,
) -> Float[Array, "B count V"]:
    """The race noise of the tokens at indices start .. start+count-1, [B, count, V].

    Entry [b, d] is the Exp(1) noise a plain decode step emitting index start+d races with
    (`make_verify_noise`'s bonus noise at that position). THE COUPLED RULE's noise: a verify
    that takes, at every position, the target's race under this noise emits exactly the
    tokens plain sampling with the same seed emits, whatever was drafted.
    """
    offsets = jnp.arange(count, dtype=jnp.int32)

    def one(seed, position):
        return jax.vmap(lambda d: race_noise(seed, position + d, vocab_size))(offsets)

    return jax.vmap(one)(jnp.asarray(seeds), jnp.asarray(start).astype(jnp.int32))


def race_noise(seed: Int[Array, ""], index: Int[Array, ""], vocab_size: int) -> Float[Array, "V"]:
    """The Exp(1) noise of the race that draws the token at `index` in a plain decode step (and a
    verify step's bonus there): one definition, so the coupled rule races exactly what plain
    sampling races."""
    return exp_noise(jax.random.fold_in(step_key(seed, index), _EXP_STREAM), (vocab_size,))


def draft_noise(
    seeds: Int[Array, "B"],
    hist_len: Int[Array, "B"],
    depth: int,
    size: int,
    coupled: bool,
    d2t: Int[Array, "Vd"] | None = None,
    vocab_size: int | None = None,
) -> Float[Array, "B Vd"]:
    """The Exp(1) noise a sampling drafter races its depth-`depth` draft (1-based) with, [B, size].

    Independent (rejection verify): the step's draft stream (`draft_key`), independent of the
    verify's coins and bonus race, which losslessness of rejection needs. Coupled: the target's
    own race noise at the draft's position hist_len + depth - 1 (seen through d2t for a reduced
    draft vocabulary, whose tokens then race with their target ids' noise), so a draft that
    follows q close to p lands on the token the target will race to (Gumbel-max coupling).
    """
    if not coupled:
        return jax.vmap(lambda sd, i: exp_noise(draft_key(sd, i, depth), (size,)))(seeds, hist_len)
    full = position_noise(seeds, hist_len + depth - 1, 1, vocab_size or size)[:, 0]
    return full if d2t is None else full[:, d2t]


def exp_noise(key: jax.Array, shape: tuple[int, ...]) -> Float[Array, "*shape"]:
    """Exp(1) samples that are never 0 nor inf.

    `jax.random.exponential` returns exactly 0 with probability 2^-23 per
    element (its uniform is a multiple of 2^-23 that can be 0); a zero, even
    clamped to the smallest float, wins the race `argmax w / E` for any w > 0,
    so at V = 49,152 about 0.6% of draws would emit a token of near-zero
    probability. Here u = (m + 1/2) 2^-23 over the 2^23 mantissa values m is
    exactly representable and strictly inside (0, 1), so E = -log(u) lies in
    [6e-8, 16.6]: a token of probability p can win only by the ratio the exact
    race allows up to that discretisation.
    """
    bits = jax.random.bits(key, shape, jnp.uint32)
    u = ((bits >> 9).astype(jnp.float32) + 0.5) * (2.0 ** -23)
    return -jnp.log(u)


@functools.partial(jax.jit, static_argnames=("num_nodes", "vocab_size"))
def make_verify_noise(
    seeds: Int[Array, "B"],
    positions: Int[Array, "B"],
    num_nodes: int,
    vocab_size: int,
) -> tuple[Float[Array, "B N"], Float[Array, "B V"]]:
    """Per-request noise for one verification (or plain sampling) step.

    Args:
      seeds: [B] uint32/int32 per-request seed.
      positions: [B] int32 index of the first token the step emits (the root's
        index + 1 in a verify step; see `step_key` for why not the root's).
      num_nodes: N, nodes per tree (static).
      vocab_size: V (static).

    Returns:
      uniforms: [B, N] float32 in [0, 1); uniforms[b, j] is the coin of node j
        (see jaxspec.speculative.verify for which test uses which coin).
      bonus_noise: [B, V] float32 Exp(1) samples, strictly positive, for the
        race that draws the bonus token. It does not depend on N, so it equals
        the noise `sample_token` uses at the same (seed, position).
    """

    def one(seed, position):
        u = jax.random.uniform(jax.random.fold_in(step_key(seed, position), _UNIFORM_STREAM), (num_nodes,),
                               jnp.float32)
        return u, race_noise(seed, position, vocab_size)

    return jax.vmap(one)(jnp.asarray(seeds), jnp.asarray(positions))


def race_sample(
    weights: Float[Array, "*batch V"],
    exp_noise: Float[Array, "*batch V"],
) -> Int[Array, "*batch"]:
    """Exponential race: index v with probability weights[v] / sum(weights)."""
    return argmax_last(weights / exp_noise)


def coupled_predict(
    probs: Float[Array, "B N V"],
    depth: Int[Array, "B N"],
    seeds: Int[Array, "B"],
    hist_len: Int[Array, "B"],
    max_depth: int,
) -> Int[Array, "B N"]:
    """THE COUPLED RULE: the token the target races to after each tree node, [B, N].

    A node at depth d (root 0) predicts the token at index hist_len + d, so it races with
    that index's noise: the very draw plain sampling makes there. Greedy verification of the
    tree against these predictions then accepts a draft exactly when it equals the target's
    sample, and emits the sample at the first miss, so the output is plain sampling with the
    request's seed, token for token, whatever the drafter proposed, its draft shape, or the
    batch: exact (every index's noise is independent of the history that set its p), and
    reproducible by construction. The price: a draft is accepted with P(draft = sample),
    which a coupled drafter (`draft_noise`) pushes toward, but not up to, sum min(p, q).
    """
    noise = position_noise(seeds, hist_len, max_depth + 1, probs.shape[-1])  # [B, D + 1, V]
    at_node = jnp.take_along_axis(noise, jnp.clip(depth, 0, max_depth)[..., None], axis=1)  # [B, N, V]
    return race_sample(probs, at_node).astype(jnp.int32)


# Candidates the fast filter pre-selects per row, in tiers: 64 holds top-k 50 and most top-p
# nuclei of chat text (measured: 2% of T 0.8 / top-p 0.9 rows exceed 64, 0.3% exceed 256, none
# 1,024); a wider row sends the batch to the next tier, and only past the last to the sort.
SELECT_TIERS = (64, 256, 1024)


def _cutoff_mask(
    scaled: Float[Array, "B N V"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
    kk: int,
) -> tuple[Float[Array, "B N V"], jax.Array]:
    """(the filtered logits, whether every row's kept set fits in its kk largest values)."""
    vocab = scaled.shape[-1]
    # 1. The kk largest values of every row, descending: the reference's sorted prefix.
    vals = jax.lax.top_k(scaled, kk)[0]  # [B, N, kk]
    rank = jnp.arange(kk, dtype=jnp.int32)
    k_on = (top_k > 0) & (top_k < vocab)
    in_top_k = rank < jnp.where(k_on, top_k, vocab)[:, None, None]
    # 2. The top-p mass: over the top-k set when top-k is on (then it must lie inside the kk
    #    values), else over the whole vocabulary (normalised by the full logsumexp).
    probs_k = jax.nn.softmax(jnp.where(in_top_k, vals, -jnp.inf), axis=-1)
    probs_v = jnp.exp(vals - jax.nn.logsumexp(scaled, axis=-1, keepdims=True))
    probs = jnp.where(k_on[:, None, None], probs_k, probs_v)
    cum = jnp.cumsum(probs, axis=-1)
    p = top_p[:, None, None]
    keep = in_top_k & ((cum - probs < p) | (p >= 1.0))
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
    cutoff = jnp.take_along_axis(vals, n_keep - 1, axis=-1)
    # 3. Rows that filter nothing keep everything; the others need their cutoff inside kk.
    no_filter = ~k_on & (top_p >= 1.0)
    cutoff = jnp.where(no_filter[:, None, None], -jnp.inf, cutoff)
    fits = ((k_on & (top_k <= kk)) | no_filter)[:, None] | (~k_on[:, None] & (cum[..., -1] >= top_p[:, None]))
    return jnp.where(scaled >= cutoff, scaled, -jnp.inf), jnp.all(fits)


def top_k_top_p_mask(
    scaled: Float[Array, "B N V"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
    tiers: tuple[int, ...] | None = None,
) -> Float[Array, "B N V"]:
    """`top_k_top_p_mask_ref` without the sort: a bounded top-k pre-selection, then the cutoff.

    A full sort of 49,152 logits costs XLA:CPU ~13 ms a row (more than a plain decode step of the
    embedded model); `lax.top_k` of 64 costs ~0.1 ms. The kept set is a prefix of the sorted
    order, so if it fits in the first kk values the cutoff read there is the reference's. That
    holds for every row whose top-k is <= kk, and for a top-p-only row whose first kk tokens
    already hold mass >= top_p. Otherwise the whole batch tries the next tier, and past the last
    the reference (`cond`s: only the branch taken runs). `tiers` default: SELECT_TIERS, read when
    traced (tests on tiny vocabularies set smaller tiers to exercise every branch).
    """
    tiers = tuple(t for t in (SELECT_TIERS if tiers is None else tiers) if t < scaled.shape[-1])
    if not tiers:
        return top_k_top_p_mask_ref(scaled, top_k, top_p)
    fast, fits = _cutoff_mask(scaled, top_k, top_p, tiers[0])
    return jax.lax.cond(fits, lambda: fast, lambda: top_k_top_p_mask(scaled, top_k, top_p, tiers[1:]))


def top_k_top_p_mask_ref(
    scaled: Float[Array, "B N V"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
) -> Float[Array, "B N V"]:
    """Sets logits outside each request's top-k / top-p set to -inf.

    THE SPECIFICATION of the filter (a full sort of the vocabulary); `top_k_top_p_mask` is the fast
    path, tested equal to it."""
    vocab = scaled.shape[-1]
    # 1. Sort values only (descending): the kept set is a prefix of the sorted
    #    order, so a single cutoff value per row describes it; no scatter back.
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    rank = jnp.arange(vocab, dtype=jnp.int32)
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)[:, None, None]
    in_top_k = rank < k
    # 2. Top-p on the top-k-renormalised distribution: keep a token while the
    #    mass strictly before it is < top_p (the minimal set reaching top_p).
    probs_sorted = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    p = top_p[:, None, None]
    keep = in_top_k & ((mass_before < p) | (p >= 1.0))
    # 3. At least the top token survives even for top_p <= 0.
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
    cutoff = jnp.take_along_axis(sorted_desc, n_keep - 1, axis=-1)
    return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


@jax.jit
def target_probs_from_logits(
    logits: Float[Array, "B N V"],
    temperature: Float[Array, "B"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
) -> Float[Array, "B N V"]:
    """Turns target logits at every tree node into the distribution to verify
    against (float32), per request: temperature, then top-k, then top-p.

    temperature <= 0 gives one-hot(argmax), so greedy requests can share the
    sampling verifiers with sampled ones (any lossless verifier then reproduces
    greedy decoding exactly).
    """
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    top_k = jnp.asarray(top_k, jnp.int32)
    top_p = jnp.asarray(top_p, jnp.float32)
    vocab = logits.shape[-1]

    greedy = temperature <= 0.0
    safe_t = jnp.where(greedy, 1.0, temperature)
    scaled = logits / safe_t[:, None, None]
    # Skip the filter for batches where no request filters (the common temperature-only case).
    needs_filter = jnp.any(((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))
    scaled = jax.lax.cond(
        needs_filter,
        lambda s: top_k_top_p_mask(s, top_k, top_p),
        lambda s: s,
        scaled,
    )
    probs = jax.nn.softmax(scaled, axis=-1)
    one_hot = jax.nn.one_hot(argmax_last(logits), vocab, dtype=jnp.float32)
    return jnp.where(greedy[:, None, None], one_hot, probs)


@jax.jit
def sample_token(
    logits: Float[Array, "B V"],
    temperature: Float[Array, "B"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
    seeds: Int[Array, "B"],
    positions: Int[Array, "B"],
) -> Int[Array, "B"]:
    """Ordinary (non-speculative) decoding: one token per request.

    Same distribution processing as verification and the same noise stream as
    a verify step's bonus token at (seed, position); greedy (exact argmax) when
    temperature <= 0.
    """
    vocab = logits.shape[-1]

    def sampled(logits):
        probs = target_probs_from_logits(logits[:, None, :], temperature, top_k, top_p)[:, 0]
        _, exp_noise = make_verify_noise(seeds, positions, 1, vocab)
        return race_sample(probs, exp_noise)

    # An all-greedy batch skips the vocab-sized noise draw (measured 1 ms at
    # B=1, 5 ms at B=8 on CPU: a sizable share of a decode step). Same tokens.
    greedy = argmax_last(logits)
    return jax.lax.cond(jnp.all(temperature <= 0.0), lambda _: greedy, sampled, logits)
