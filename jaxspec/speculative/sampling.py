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
from jaxtyping import Array, Bool, Float, Int

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


def race_key(seed: Int[Array, ""], index: Int[Array, ""]) -> jax.Array:
    """The key of the race that draws the token at `index`: a plain decode step's, a verify step's
    bonus there, and the coupled rule's prediction there (one definition, so the coupled rule
    races exactly what plain sampling races)."""
    return jax.random.fold_in(step_key(seed, index), _EXP_STREAM)


def race_noise(seed: Int[Array, ""], index: Int[Array, ""], vocab_size: int) -> Float[Array, "V"]:
    """The Exp(1) noise of the race that draws the token at `index`, over the whole vocabulary."""
    return exp_noise(race_key(seed, index), (vocab_size,))


def draft_noise(
    seeds: Int[Array, "B"],
    hist_len: Int[Array, "B"],
    depth: int,
    size: int,
) -> Float[Array, "B Vd"]:
    """The Exp(1) noise a sampling drafter races its depth-`depth` draft (1-based) with under the
    rejection rule, [B, size]: the step's draft stream (`draft_key`), independent of the verify's
    coins and bonus race, which losslessness of rejection needs. (Under the coupled rule a
    drafter races with the target's own noise instead: `race_filtered` with `race_key`.)"""
    return jax.vmap(lambda sd, i: exp_noise(draft_key(sd, i, depth), (size,)))(seeds, hist_len)


def exp_noise(key: jax.Array, shape: tuple[int, ...]) -> Float[Array, "*shape"]:
    """Exp(1) samples that are never 0 nor inf, entry i hashed from (key, i): `exp_noise_at`.

    Why not `jax.random.exponential`: it returns exactly 0 with probability 2^-23 per element
    (its uniform is a multiple of 2^-23 that can be 0); a zero, even clamped to the smallest
    float, wins the race `argmax w / E` for any w > 0, so at V = 49,152 about 0.6% of draws
    would emit a token of near-zero probability. Here u = (m + 1/2) 2^-23 over the 2^23
    mantissa values m is exactly representable and strictly inside (0, 1), so E = -log(u) lies
    in [6e-8, 16.6]: a token of probability p can win only by the ratio the exact race allows
    up to that discretisation.
    """
    size = 1
    for d in shape:
        size *= d
    return exp_noise_at(key, jnp.arange(size, dtype=jnp.uint32)).reshape(shape)


def _exp_from_bits(bits):
    u = ((bits >> 9).astype(jnp.float32) + 0.5) * (2.0 ** -23)
    return -jnp.log(u)


def _mix(x: jax.Array) -> jax.Array:
    """lowbias32 (C. Wellons' hash-prospector): a bijection of uint32 with near-ideal avalanche."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def noise_bits(
    keys: jax.Array,
    ids: Int[Array, "*K C"],
) -> jax.Array:
    """32 random bits for entry ids[..., c] of the stream keyed by keys[...] (typed keys [*K]).

    THE NOISE HASH. Three keyed rounds of `_mix` over the entry's index, not threefry: a race
    over the vocabulary hashes 49,152 entries per position, and threefry's 20 rounds made a
    temperature-only verify block of 8 x 4 cost ~14 ms on XLA:CPU (this: ~4 ms, measured),
    1.15x the greedy step. The key itself still comes from threefry (`step_key`'s fold_ins), so
    streams of different (seed, index) are independent; within one stream the entries are
    distinct (a bijection of the index), and the chi-square tests hold the races exact.
    """
    data = jax.random.key_data(keys)
    k0, k1 = data[..., 0:1], data[..., 1:2]
    x = _mix(ids.astype(jnp.uint32) ^ k0)
    x = _mix(x ^ k1)
    return _mix(x ^ jnp.uint32(0x9E3779B9))


# -log of the smallest E `exp_noise` can return (u = 1 - 2^-24) is 16.64: no race score
# s_v - log E_v exceeds s_v by more. Rounded up, for the float32 arithmetic around it.
_MAX_RACE_GAIN = 17.0


def exp_noise_at(
    keys: jax.Array,
    ids: Int[Array, "*K C"],
) -> Float[Array, "*K C"]:
    """`exp_noise(key, (V,))[ids]` for a batch of keys [*K] and ids [*K, C], computing only those
    entries (any V above max(ids)): the race noise of a few candidate tokens costs C hashes
    instead of V."""
    return _exp_from_bits(noise_bits(keys, ids))


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


def coupled_keys(seed: Int[Array, "B"], depth: Int[Array, "B N"], hist_len: Int[Array, "B"], max_depth: int):
    """The race key of every tree node under the coupled rule, [B, N]: a node at depth d predicts
    index hist_len + d and races with that index's key, the one plain sampling uses there."""
    index = hist_len[:, None] + jnp.clip(depth, 0, max_depth)
    return jax.vmap(jax.vmap(race_key, in_axes=(None, 0)))(seed, index)


def coupled_predict(
    logits: Float[Array, "B N V"],
    depth: Int[Array, "B N"],
    sampling,
    hist_len: Int[Array, "B"],
    max_depth: int,
) -> Int[Array, "B N"]:
    """THE COUPLED RULE: the token the target races to after each tree node, [B, N].

    A node at depth d (root 0) predicts the token at index hist_len + d, so it races with
    that index's noise: the very draw plain sampling makes there (`race_filtered` under
    `race_key`, as `sample_token`). Greedy verification of the tree against these predictions
    then accepts a draft exactly when it equals the target's sample, and emits the sample at
    the first miss, so the output is plain sampling with the request's seed, token for token,
    whatever the drafter proposed, its draft shape, or the batch: exact (every index's noise
    is independent of the history that set its p), and reproducible by construction. The
    price: a draft is accepted with P(draft = sample), which a coupled drafter (racing its q
    with the same noise) pushes toward, but not up to, sum min(p, q).
    """
    keys = coupled_keys(sampling.seed, depth, hist_len, max_depth)
    return race_filtered(logits, sampling.temperature, sampling.top_k, sampling.top_p, keys)


# Candidates the fast filter pre-selects per row, in tiers: 64 holds top-k 50 and most top-p
# nuclei of chat text (measured: 2% of T 0.8 / top-p 0.9 rows exceed 64, 0.3% exceed 256, none
# 1,024; a verify position after a rejected draft is flatter: 9% exceed 1,024); a wider row
# sends the batch to the next tier, and only past the last to the bisection (`_cutoff_bisect`).
SELECT_TIERS = (64, 256, 1024)


def _cutoff(
    scaled: Float[Array, "B N V"],
    vals: Float[Array, "B N kk"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
) -> tuple[Float[Array, "B N 1"], Bool[Array, "B N"], Bool[Array, "B"]]:
    """(each row's cutoff value, whether its kept set is decided by its kk largest values `vals`
    (descending), whether the row filters nothing). The kept set is {v: scaled_v >= cutoff}."""
    vocab, kk = scaled.shape[-1], vals.shape[-1]
    rank = jnp.arange(kk, dtype=jnp.int32)
    k_on = (top_k > 0) & (top_k < vocab)
    in_top_k = rank < jnp.where(k_on, top_k, vocab)[:, None, None]
    # 1. The top-p mass: over the top-k set when top-k is on (then it must lie inside the kk
    #    values), else over the whole vocabulary (normalised by the full logsumexp, a pass over V
    #    paid only when some row is top-p alone; the others never read probs_v).
    probs_k = jax.nn.softmax(jnp.where(in_top_k, vals, -jnp.inf), axis=-1)
    lse = jax.lax.cond(jnp.any(~k_on & (top_p < 1.0)), lambda: jax.nn.logsumexp(scaled, axis=-1, keepdims=True),
                       lambda: jnp.max(vals, axis=-1, keepdims=True))
    probs_v = jnp.exp(vals - lse)
    probs = jnp.where(k_on[:, None, None], probs_k, probs_v)
    cum = jnp.cumsum(probs, axis=-1)
    p = top_p[:, None, None]
    keep = in_top_k & ((cum - probs < p) | (p >= 1.0))
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
    cutoff = jnp.take_along_axis(vals, n_keep - 1, axis=-1)
    # 2. Rows that filter nothing keep everything; the others need their cutoff inside kk.
    no_filter = ~k_on & (top_p >= 1.0)
    cutoff = jnp.where(no_filter[:, None, None], -jnp.inf, cutoff)
    fits = ((k_on & (top_k <= kk)) | no_filter)[:, None] | (~k_on[:, None] & (cum[..., -1] >= top_p[:, None]))
    return cutoff, fits, no_filter


def _cutoff_mask(
    scaled: Float[Array, "B N V"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
    kk: int,
) -> tuple[Float[Array, "B N V"], jax.Array]:
    """(the filtered logits, whether every row's kept set fits in its kk largest values)."""
    cutoff, fits, _ = _cutoff(scaled, jax.lax.top_k(scaled, kk)[0], top_k, top_p)
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
    the bisection, which finds the reference's cutoff without sorting (`cond`s: only the branch
    taken runs). `tiers` default: SELECT_TIERS, read when traced (tests on tiny vocabularies set
    smaller tiers to exercise every branch; `()` sends every row to the bisection).
    """
    tiers = tuple(t for t in (SELECT_TIERS if tiers is None else tiers) if t < scaled.shape[-1])
    if not tiers:
        return jnp.where(scaled >= _cutoff_bisect(scaled, top_k, top_p), scaled, -jnp.inf)
    fast, fits = _cutoff_mask(scaled, top_k, top_p, tiers[0])
    return jax.lax.cond(fits, lambda: fast, lambda: top_k_top_p_mask(scaled, top_k, top_p, tiers[1:]))


def _order_keys(x: Float[Array, "*S"]) -> jax.Array:
    """uint32 keys in float32 order (the sign-magnitude trick; no NaN in logits)."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


def _from_order_keys(u: jax.Array) -> jax.Array:
    b = jnp.where((u >> 31) == 1, u & jnp.uint32(0x7FFFFFFF), ~u)
    return jax.lax.bitcast_convert_type(b, jnp.float32)


def _bisect(u: jax.Array, lo: jax.Array, hi: jax.Array, holds) -> jax.Array:
    """The smallest key t in (lo, hi] with holds(t), for a predicate false at lo, true at hi and
    monotone between: 32 halvings cover any uint32 range, each one pass over the keys."""
    def body(_, c):
        lo, hi = c
        mid = lo + (hi - lo) // 2
        ok = holds(mid)
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    return jax.lax.fori_loop(0, 32, body, (lo, hi))[1]


def _cutoff_bisect(
    scaled: Float[Array, "B N V"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
) -> Float[Array, "B N 1"]:
    """The cutoff of `top_k_top_p_mask_ref` without its sort: bisection over the float order.

    Rows past every tier are the flat ones (thousands of tokens in the nucleus: a verify position
    after a rejected draft), and XLA:CPU sorts 8 rows of 49,152 in ~66 ms, more than three plain
    decode steps; 32 passes over them cost ~6 ms. 1. The k-th largest value: the smallest key
    with fewer than k keys above it. 2. Top-p over the top-k set: the smallest key whose strictly
    greater mass is below top_p, which is the value of the reference's last kept rank (every rank
    before it has mass before it < top_p, and the mass through it is >= top_p). Sums differ from
    the reference's cumsum only in rounding, as the tiers' do.
    """
    vocab = scaled.shape[-1]
    u = _order_keys(scaled)
    lo = jnp.min(u, axis=-1, keepdims=True) - 1  # -inf's key is 0x007FFFFF: no wrap
    hi = jnp.max(u, axis=-1, keepdims=True)
    k_on = (top_k > 0) & (top_k < vocab)
    k = jnp.where(k_on, top_k, vocab)[:, None, None]
    # 1. Top-k (only when some row asks: a top-k within the tiers never reaches here).
    kth = jax.lax.cond(jnp.any(k_on), lambda: _bisect(u, lo, hi, lambda t: jnp.sum(u > t, -1, keepdims=True) < k),
                       lambda: lo + 1)
    kth = jnp.where(k_on[:, None, None], kth, lo + 1)
    # 2. Top-p on the top-k set, renormalised over exactly k ranks: the reference's softmax counts
    #    only as many copies of a value tied at the k-th rank as the k ranks hold.
    above = u > kth
    c = _from_order_keys(kth)
    m = jnp.max(scaled, axis=-1, keepdims=True)
    e = jnp.where(above, jnp.exp(scaled - m), 0.0)
    ties = (k - jnp.sum(above, axis=-1, keepdims=True)).astype(jnp.float32)
    w = e / (jnp.sum(e, axis=-1, keepdims=True) + ties * jnp.exp(c - m))
    p = top_p[:, None, None]
    cut = _bisect(u, kth - 1, hi, lambda t: jnp.sum(jnp.where(u > t, w, 0.0), -1, keepdims=True) < p)
    cut = jnp.where(p >= 1.0, kth, cut)
    return jnp.where((~k_on & (top_p >= 1.0))[:, None, None], -jnp.inf, _from_order_keys(cut))


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


def filters(top_k: Int[Array, "B"], top_p: Float[Array, "B"], vocab: int) -> Bool[Array, "B"]:
    """Whether each row's top-k or top-p removes any token."""
    return ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)


def filtered_logits(
    scaled: Float[Array, "B N V"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
) -> Float[Array, "B N V"]:
    """`top_k_top_p_mask`, skipped for batches where no request filters (the common
    temperature-only case)."""
    return jax.lax.cond(jnp.any(filters(top_k, top_p, scaled.shape[-1])),
                        lambda x: top_k_top_p_mask(x, top_k, top_p), lambda x: x, scaled)


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
    probs = jax.nn.softmax(filtered_logits(scaled, top_k, top_p), axis=-1)
    one_hot = jax.nn.one_hot(argmax_last(logits), vocab, dtype=jnp.float32)
    return jnp.where(greedy[:, None, None], one_hot, probs)


def race_filtered(
    logits: Float[Array, "B N V"],
    temperature: Float[Array, "B"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
    keys: jax.Array,
    token_ids: Int[Array, "V"] | None = None,
    tiers: tuple[int, ...] | None = None,
) -> Int[Array, "B N"]:
    """THE SAMPLER: the token each row's race draws from its filtered distribution, [B, N].

    Row (b, n) draws argmax over the kept set {v: s_v >= cutoff} of s_v - log E_v, with
    s = logits / T, the cutoff of `top_k_top_p_mask` and E = exp_noise(keys[b, n], (V,)): the
    exponential race of the module docstring in the log domain (softmax(s)_v / E_v has the
    same argmax), so the token is distributed as the filtered softmax. Greedy rows
    (T <= 0) take the argmax. `token_ids` [V]: entry v races with the noise of token
    token_ids[v] (a drafter's reduced vocabulary seen through d2t).

    The fast path never touches V-sized noise: the kk largest values (`lax.top_k`) hold every
    filtered row's kept set when its cutoff lies inside them, and their noise is hashed one
    entry at a time (`exp_noise_at`, the dense draw's entries). A row that filters
    nothing fits too when its best candidate's score beats the kk-th value by more than any
    noise can lift a token (`_MAX_RACE_GAIN`): no token outside can then win. Otherwise the
    dense race over V under this tier's cutoffs if they are right (a temperature-only row
    that did not fit), else the next tier, and past the last the dense race after the bisection:
    the same scores, so the same token, whichever path ran. On CPU the dense race costs ~1.7 ms for 8 rows of
    49,152 (noise, log, max), several times a greedy argmax; the fast path a `top_k` of 64.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    greedy = temperature <= 0.0
    safe_t = jnp.where(greedy, 1.0, temperature).astype(jnp.float32)
    scaled = logits / safe_t[:, None, None]
    ids_map = (lambda i: i) if token_ids is None else (lambda i: token_ids[i])  # noqa: E731

    def dense(masked=None):
        if masked is None:  # the filter decides its own tiers, then the bisection
            masked = filtered_logits(scaled, top_k, top_p)
        noise = _dense_noise(keys, vocab, token_ids)
        return argmax_last(jnp.where(masked > -jnp.inf, masked - jnp.log(noise), -jnp.inf)).astype(jnp.int32)

    def sparse(kk: int, rest: tuple[int, ...]):
        def run():
            token, inside, fits, cutoff = _race_tier(scaled, top_k, top_p, keys, kk, ids_map)
            # 1. Every row decided by its candidates: their race. 2. The filter's cutoffs are right
            # here (`top_k_top_p_mask`'s own test) but some row is not decided (a temperature-only
            # row, a tie at the boundary): the dense race under those cutoffs; wider tiers would
            # rarely decide such a row. 3. Else the next tier, and past the last the bisection.
            case = jnp.where(jnp.all(inside | greedy[:, None]), 0, jnp.where(jnp.all(fits), 1, 2))
            nxt = (lambda: sparse(rest[0], rest[1:])()) if rest else dense
            return jax.lax.switch(case, [lambda: token, lambda: dense(jnp.where(scaled >= cutoff, scaled, -jnp.inf)),
                                         nxt])

        return run

    tiers = tuple(t for t in (SELECT_TIERS if tiers is None else tiers) if t < vocab)
    sampled = sparse(tiers[0], tiers[1:]) if tiers else dense
    # 0: all greedy (no sampler: the dense race draws V-sized noise); 1: mixed; 2: all sampled
    # (no argmax pass over the vocabulary).
    argmax = lambda: argmax_last(logits).astype(jnp.int32)  # noqa: E731
    mixed = lambda: jnp.where(greedy[:, None], argmax(), sampled())  # noqa: E731
    case = jnp.where(jnp.all(greedy), 0, jnp.where(jnp.any(greedy), 1, 2))
    return jax.lax.switch(case, [argmax, mixed, sampled])


def _race_tier(scaled: Float[Array, "B N V"], top_k: Int[Array, "B"], top_p: Float[Array, "B"], keys: jax.Array,
               kk: int, ids_map=lambda i: i):
    """One tier of `race_filtered`'s fast path: (each row's race over its kk likeliest tokens [B, N],
    whether those candidates decide the row [B, N], whether its cutoff lies inside them [B, N],
    the cutoffs [B, N, 1])."""
    vals, idx = jax.lax.top_k(scaled, kk)  # [B, N, kk], descending
    cutoff, fits, no_filter = _cutoff(scaled, vals, top_k, top_p)
    noise = exp_noise_at(keys, ids_map(idx))
    score = jnp.where(vals >= cutoff, vals - jnp.log(noise), -jnp.inf)
    best = jnp.max(score, axis=-1)
    # The kk-th value as a min, not vals[..., -1]: slicing top_k's output made XLA:CPU run
    # the full sort behind it (100 ms for 8 rows of 49,152, measured) instead of its TopK.
    kth = jnp.min(vals, axis=-1)
    inside = jnp.where(no_filter[:, None], best > kth + _MAX_RACE_GAIN, fits & (kth < cutoff[..., 0]))
    token = jnp.take_along_axis(idx, argmax_last(score)[..., None], axis=-1)[..., 0].astype(jnp.int32)
    return token, inside, fits, cutoff


# A prediction `race_first_tier` leaves open: no token (drafts, padding included, are > this).
UNDECIDED = -(2**31)


def race_first_tier(
    logits: Float[Array, "B N V"],
    temperature: Float[Array, "B"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
    keys: jax.Array,
) -> Int[Array, "B N"]:
    """`race_filtered`'s token where the first tier's candidates decide the row, else UNDECIDED.

    A verify block's positions after a rejected draft are flat (a nucleus of thousands of tokens
    where the history is wrong), and one such row sent the whole block of `race_filtered` to the
    wider tiers and the dense race. Their tokens are rarely needed: the coupled walk reads a
    position only while every draft before it was accepted. So the walk takes these, and decides
    exactly the one open position it stops at (`verify.verify_coupled`). Greedy rows take the
    argmax."""
    tiers = [t for t in SELECT_TIERS if t < logits.shape[-1]]
    if not tiers:  # a vocabulary within the first tier: every row is decided by the full race
        return race_filtered(logits, temperature, top_k, top_p, keys)
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, temperature).astype(jnp.float32)[:, None, None]
    token, inside, _, _ = _race_tier(scaled, top_k, top_p, keys, tiers[0])
    sampled = jnp.where(inside, token, UNDECIDED)
    return jax.lax.cond(jnp.any(greedy), lambda: jnp.where(greedy[:, None], argmax_last(logits), sampled),
                        lambda: sampled).astype(jnp.int32)


def race_past_first_tier(
    logits: Float[Array, "B N V"],
    temperature: Float[Array, "B"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
    keys: jax.Array,
) -> Int[Array, "B N"]:
    """`race_filtered` for rows `race_first_tier` left UNDECIDED: the same token, from the second
    tier on (the first is known not to decide them). A batch whose sampled rows filter nothing
    races densely at once: a wider tier decides such a row only when its best candidate clears
    the kk-th value by `_MAX_RACE_GAIN`, and its `top_k` costs more than the race (8 rows of
    49,152: 1.4 ms against 0.9 ms, measured)."""
    vocab = logits.shape[-1]
    plain = (temperature <= 0.0) | ~filters(top_k, top_p, vocab)
    return jax.lax.cond(jnp.all(plain), lambda: race_filtered(logits, temperature, top_k, top_p, keys, tiers=()),
                        lambda: race_filtered(logits, temperature, top_k, top_p, keys, tiers=SELECT_TIERS[1:]))


def _dense_noise(keys: jax.Array, vocab: int, token_ids: Int[Array, "V"] | None) -> Float[Array, "B N V"]:
    """exp_noise of each key [B, N] over the vocabulary the races index (token_ids's entries for a
    reduced one)."""
    ids = jnp.arange(vocab, dtype=jnp.uint32) if token_ids is None else token_ids
    return exp_noise_at(keys, jnp.broadcast_to(ids, (*keys.shape, ids.shape[0])))


@jax.jit
def sample_token(
    logits: Float[Array, "B V"],
    temperature: Float[Array, "B"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
    seeds: Int[Array, "B"],
    positions: Int[Array, "B"],
) -> Int[Array, "B"]:
    """Ordinary (non-speculative) decoding: one token per request, drawn by `race_filtered`
    under the race key at (seed, position), as a verify step's coupled prediction there;
    greedy (exact argmax) when temperature <= 0."""
    keys = jax.vmap(race_key)(seeds, positions)[:, None]
    return race_filtered(logits[:, None], temperature, top_k, top_p, keys)[:, 0]
