"""Logit processors that read the tokens before a position: logit bias, min_tokens, and the
repetition / frequency / presence penalties, in vLLM's order and definitions.

Why they stay exact under speculation: a verify step scores N positions at once, and the
processed distribution at a node depends on every token before the position it predicts,
the node's accepted-if-reached ancestors included. So each node is processed with the
committed history (prompt + output, on device in the loop state) plus its own draft path,
the tokens it would follow if the verifier reaches it. A node the verifier reaches has
exactly that prefix, so the distribution it is checked against is the one plain decoding
with the same parameters samples from at that position, and the verify rules' losslessness
(per position, against whatever distribution they are handed) carries over unchanged.

The counts are not kept as separate state: they are recounted from the history each step
(one scatter of [B, C] ids), so they cannot drift from the tokens actually committed, and a
row that joins a batch (the server) or is re-prefilled needs no set-up. All of it runs only
when some row of the batch asks for it (`lax.cond`), so a plain request pays nothing.

Order (vLLM's sampler): bias, min_tokens, then repetition (multiplicative, over prompt +
output: a seen token's positive logit is divided by the penalty, a negative one multiplied),
frequency (per occurrence in the output) and presence (once it occurred in the output); then
the sampler's temperature / top-k / top-p, or the argmax for greedy rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def active(sp) -> Bool[Array, ""]:
    """Whether any row of the batch (a DeviceSampling) uses a processor here."""
    return jnp.any((sp.presence != 0) | (sp.frequency != 0) | (sp.repetition != 1) | (sp.min_tokens > 0)
                   | jnp.any(sp.bias_ids >= 0, axis=-1))


def token_counts(
    history: Int[Array, "B C"],
    lo: Int[Array, "B"],
    hi: Int[Array, "B"],
    vocab: int,
) -> Int[Array, "B V"]:
    """How often each token occurs in history[b, lo[b]:hi[b]]."""
    col = jnp.arange(history.shape[1], dtype=jnp.int32)[None, :]
    ids = jnp.where((col >= lo[:, None]) & (col < hi[:, None]), history, vocab)
    rows = jnp.arange(history.shape[0])[:, None]
    return jnp.zeros((history.shape[0], vocab + 1), jnp.int32).at[rows, ids].add(1, mode="drop")[:, :vocab]


def path_counts(
    tokens: Int[Array, "B N"],
    mask: Bool[Array, "B N N"],
    depth: Int[Array, "B N"],
    vocab: int,
) -> Int[Array, "B N V"]:
    """For each node, how often each token occurs on its draft path: the non-root
    ancestors-or-self (mask [b, i, j]: j is an ancestor-or-self of i), padding excluded."""
    b, n = tokens.shape
    on = mask & ((depth >= 1) & (tokens >= 0) & (tokens < vocab))[:, None, :]
    ids = jnp.where(on, tokens[:, None, :], vocab)  # [B, N (node), N (path entry)]
    bi = jnp.arange(b)[:, None, None]
    ni = jnp.arange(n)[None, :, None]
    return jnp.zeros((b, n, vocab + 1), jnp.int32).at[bi, ni, ids].add(1, mode="drop")[..., :vocab]


def process(
    logits: Float[Array, "B N V"],
    sp,
    out_counts: Int[Array, "B N V"],
    seen: Bool[Array, "B N V"],
    out_len: Int[Array, "B N"],
) -> Float[Array, "B N V"]:
    """The processed logits of each position, given the output counts before it, whether each
    token occurs in prompt + output before it, and the output length before it (float32).

    Broadcasting: out_counts / seen may be [B, 1, V] (positions sharing a prefix)."""
    logits = logits.astype(jnp.float32)
    b, _, vocab = logits.shape
    # 1. Logit bias: a sparse [B, K] list (id -1 = unused), added where the ids point.
    bias = jnp.zeros((b, vocab + 1), jnp.float32).at[jnp.arange(b)[:, None],
                                                     jnp.where(sp.bias_ids >= 0, sp.bias_ids, vocab)].add(sp.bias)
    logits = logits + bias[:, None, :vocab]
    # 2. min_tokens: no stop token while the output is shorter.
    stops = jnp.zeros((b, vocab + 1), bool).at[jnp.arange(b)[:, None],
                                               jnp.where(sp.stop_ids >= 0, sp.stop_ids, vocab)].set(True)
    ban = stops[:, None, :vocab] & (out_len < sp.min_tokens[:, None])[..., None]
    logits = jnp.where(ban, -jnp.inf, logits)
    # 3. Repetition: multiplicative, over prompt + output.
    rep = jnp.where(seen, sp.repetition[:, None, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    # 4. Frequency and presence: additive, over the output only.
    counts = out_counts.astype(jnp.float32)
    return (logits - sp.frequency[:, None, None] * counts
            - sp.presence[:, None, None] * (out_counts > 0).astype(jnp.float32))


def _apply(logits, sp, history, hist_len, prompt_lens, path=None, depth=None):
    """`process` of positions after history[:hist_len] (+ each one's draft path counts [B, N, V]
    and length depth [B, N], when given)."""
    vocab = logits.shape[-1]
    out = token_counts(history, prompt_lens, hist_len, vocab)[:, None, :]
    prompt_seen = token_counts(history, jnp.zeros_like(prompt_lens), prompt_lens, vocab)[:, None, :] > 0
    base_len = (hist_len - prompt_lens)[:, None]
    if path is not None:
        out = out + path
        base_len = base_len + depth
    return process(logits, sp, out, prompt_seen | (out > 0), jnp.broadcast_to(base_len, logits.shape[:2]))


def penalize(
    logits: Float[Array, "B N V"],
    sp,
    history: Int[Array, "B C"],
    hist_len: Int[Array, "B"],
    prompt_lens: Int[Array, "B"],
) -> Float[Array, "B N V"]:
    """The processed logits of positions that each directly follow history[b, :hist_len[b]] (the
    prompt is its first prompt_lens[b] tokens): a prefill's or a plain step's next token.
    Unchanged when no row asks."""
    return jax.lax.cond(active(sp), lambda x: _apply(x, sp, history, hist_len, prompt_lens).astype(x.dtype),
                        lambda x: x, logits)


def penalize_tree(
    logits: Float[Array, "B N V"],
    sp,
    history: Int[Array, "B C"],
    hist_len: Int[Array, "B"],
    prompt_lens: Int[Array, "B"],
    tokens: Int[Array, "B N"],
    tree,
) -> Float[Array, "B N V"]:
    """`penalize` for a verify step: node i predicts the token at hist_len + depth_i, after its
    draft path (`path_counts`, built inside the cond: XLA does not hoist work out of a branch)."""
    vocab = logits.shape[-1]

    def run(x):
        path = path_counts(tokens, tree.mask, tree.depth, vocab)
        return _apply(x, sp, history, hist_len, prompt_lens, path, tree.depth).astype(x.dtype)

    return jax.lax.cond(active(sp), run, lambda x: x, logits)


def penalize_draft(
    logits: Float[Array, "B Vd"],
    s,
    prev: list,
    token_ids: Int[Array, "Vd"] | None = None,
    vocab: int | None = None,
) -> Float[Array, "B Vd"]:
    """A chain drafter's logits for its next draft under the request's processors, so that its q
    (and its greedy draft) follows the distribution the verify step checks against: the token
    after loop state `s`'s history and the drafts `prev` ([B] each) before it. `token_ids` [Vd]:
    a reduced draft vocabulary's target ids (`vocab` = V), lifted to the target's to be processed.
    A q built otherwise would still be exact (rejection sampling takes any q it is told about),
    only accepted less often."""
    sp = s.sampling
    b, vd = logits.shape

    def run(x):
        full = x[:, None] if token_ids is None else jnp.full((b, 1, vocab), -jnp.inf, jnp.float32).at[
            :, 0, token_ids].set(x.astype(jnp.float32))
        v = full.shape[-1]
        path, depth = None, None
        if prev:
            ids = jnp.stack(prev, axis=1)  # [B, d]
            path = jnp.zeros((b, 1, v + 1), jnp.int32).at[jnp.arange(b)[:, None], 0, jnp.clip(ids, 0, v)].add(
                1, mode="drop")[..., :v]
            depth = jnp.full((b, 1), len(prev), jnp.int32)
        out = _apply(full, sp, s.history, s.hist_len, s.prompt_lens, path, depth)[:, 0]
        return (out if token_ids is None else out[:, token_ids]).astype(x.dtype)

    return jax.lax.cond(active(sp), run, lambda x: x, logits)
