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

# Exp(1) noise is clamped to this so that w / E never divides by zero (E == 0
# has probability ~1e-7 per element with float32 uniforms, and 0/0 = NaN would
# win jnp.argmax).
_MIN_EXP_NOISE = float(jnp.finfo(jnp.float32).tiny)

# fold_in tags separating the two noise streams of one (seed, position) key.
_UNIFORM_STREAM = 0
_EXP_STREAM = 1


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


def _request_key(seed: Int[Array, ""], position: Int[Array, ""]) -> jax.Array:
    key = jax.random.key(jnp.asarray(seed).astype(jnp.uint32))
    return jax.random.fold_in(key, jnp.asarray(position).astype(jnp.uint32))


@functools.partial(jax.jit, static_argnames=("num_nodes", "vocab_size"))
def make_verify_noise(
    seeds: Int[Array, "B"],
    positions: Int[Array, "B"],
    num_nodes: int,
    vocab_size: int,
) -> tuple[Float[Array, "B N"], Float[Array, "B V"]]:
    """Per-request noise for one verification step.

    Args:
      seeds: [B] uint32/int32 per-request seed.
      positions: [B] int32 position of the tree root (the last committed token)
        in its sequence; a step's noise is a function of (seed, position) only.
      num_nodes: N, nodes per tree (static).
      vocab_size: V (static).

    Returns:
      uniforms: [B, N] float32 in [0, 1); uniforms[b, j] is the coin of node j
        (see jaxspec.speculative.verify for which test uses which coin).
      bonus_noise: [B, V] float32 Exp(1) samples (> 0) for the exponential race
        that draws the bonus token. It does not depend on N, so it equals the
        noise `sample_token` uses at the same (seed, position): a verify step
        that accepts no draft emits exactly the token plain decoding would.
    """

    def one(seed, position):
        key = _request_key(seed, position)
        k_u = jax.random.fold_in(key, _UNIFORM_STREAM)
        k_e = jax.random.fold_in(key, _EXP_STREAM)
        u = jax.random.uniform(k_u, (num_nodes,), jnp.float32)
        e = jax.random.exponential(k_e, (vocab_size,), jnp.float32)
        return u, jnp.maximum(e, _MIN_EXP_NOISE)

    return jax.vmap(one)(jnp.asarray(seeds), jnp.asarray(positions))


def race_sample(
    weights: Float[Array, "*batch V"],
    exp_noise: Float[Array, "*batch V"],
) -> Int[Array, "*batch"]:
    """Exponential race: index v with probability weights[v] / sum(weights)."""
    return argmax_last(weights / exp_noise)


def _top_k_top_p_mask(
    scaled: Float[Array, "B N V"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
) -> Float[Array, "B N V"]:
    """Sets logits outside each request's top-k / top-p set to -inf."""
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
    # The sort behind top-k/top-p is the expensive part; skip it for batches
    # where no request filters (the common temperature-only case).
    needs_filter = jnp.any(((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))
    scaled = jax.lax.cond(
        needs_filter,
        lambda s: _top_k_top_p_mask(s, top_k, top_p),
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
