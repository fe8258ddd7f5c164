"""Tree verification: which draft nodes the target accepts, and the bonus token.

Inputs follow the tree convention of `jaxspec.speculative.tree`: per sequence N nodes,
node 0 the root (last committed token), `retrieve_next_token[b, i]` the first
non-padding child of node i (or -1), `retrieve_next_sibling[b, i]` the next
non-padding sibling (or -1), sibling order = index order.

THE BONUS-TOKEN CONVENTION (every verifier in jaxspec returns this; other
modules refer here instead of restating it):

  accept_index [B, max_depth + 1] int32
      Node indices of the accepted path: column 0 is always the root 0, then
      the accepted draft nodes in depth order, then -1 padding.
  num_accepted [B] int32
      Number of accepted DRAFT tokens (the root and the bonus are excluded),
      so accept_index[b, 1 : 1 + num_accepted[b]] are the accepted drafts.
  bonus_token [B] int32
      The target's own token after the last accepted node
      (accept_index[b, num_accepted[b]]): the argmax there (greedy) or a sample
      from the target, or from the residual left by the rejected children.

  Tokens emitted this step are tokens[accept_index[1 .. num_accepted]]
  followed by bonus_token (`emitted_tokens` builds them), so every verify
  commits num_accepted + 1 tokens and the mean acceptance length is
  tau = mean(num_accepted + 1). The KV of nodes accept_index[0 .. num_accepted]
  is kept; the bonus is not yet in the cache and becomes the next root.

Three verifiers, all walking from the root through the child/sibling tables:

* `verify_greedy`: accept the child whose token equals the target argmax at the
  current node (SGLang verify_tree_greedy).
* `verify_target_only`: SGLang tree_speculative_sampling_target_only, using
  only target probabilities. Children of the current node are tested in
  sibling order with ONE coin per level, uniforms[b, current]: child j is
  accepted when coin < (sum of target probs of the children tested so far,
  j included) / threshold_acc, or when its own prob >= threshold_single. If
  none is accepted the bonus is drawn from the target at the current node with
  the rejected children's tokens removed. With thresholds 1.0 (the default)
  this is an exact inverse-CDF sample of the target, i.e. lossless; thresholds
  < 1 accept more drafts than the target would choose and are NOT lossless.
  (Differences from SGLang: the test is strict `<`, so a zero-prob token is
  never accepted, and a token repeated among siblings counts once.)
* `verify_rejection`: lossless recursive rejection sampling, one rule for
  chains and trees. draft_probs[b, j] is the distribution node j's token was
  drawn from (i.i.d. drafting: the parent's q; without replacement: q with
  earlier siblings removed and renormalised; deterministic drafters: one-hot,
  pass draft_probs=None). With residual p' (initially target_probs[current]),
  each child j in sibling order is accepted with probability
  min(1, p'(t_j) / q_j(t_j)) using coin uniforms[b, j]; on acceptance the walk
  moves to j (p' = target_probs[j]); on rejection
  p' = normalize(max(p' - q_j, 0)). If no child is accepted the bonus is
  sampled from p'. A chain is Leviathan et al. 2023. draft_probs=None is
  exact given each proposed token, so it stays lossless whatever produced the
  drafts (sampled ones included); it only accepts less (sum q*p instead of
  sum min(p, q) per test) when q is known and informative.

Bonus tokens are sampled by exponential race with bonus_noise [B, V] (see
`jaxspec.speculative.sampling`); `make_verify_noise` derives uniforms and bonus_noise
from per-request seeds. Greedy requests in a sampled batch get one-hot target
probs (temperature 0) and then reproduce `verify_greedy` exactly.

Degenerate guards (probability ~0 events, so outputs stay valid tokens): a
rejection residual with zero mass restarts from target_probs[current]; a bonus
race over an all-zero residual falls back to target_probs[current].

Out-of-vocabulary drafts: a linked node whose token is outside [0, V) (a
drafter that was not checked, e.g. a corpus past the vocabulary) is skipped
exactly like padding: never accepted, never emitted, residual and coins
untouched. Greedy needs no test for it (an argmax is always in range).

The public functions run the Mosaic kernels of `jaxspec.pallas.verify_tpu` on
TPU, the Triton kernels of `jaxspec.pallas.verify` on GPU (and, interpreted,
under JAXSPEC_KERNELS=interpret), the jnp references below on CPU; see
`jaxspec.pallas` for the rule. They are not jitted themselves (the choice is
made in Python, so a cached trace never hides a JAXSPEC_KERNELS change) but
are jittable; the kernels and references they call are jitted.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from jaxspec.pallas import interpret_mode, kernel_backend, use_kernel
from jaxspec.speculative.sampling import (UNDECIDED, coupled_keys, make_verify_noise, race_first_tier,
                                         race_past_first_tier, race_sample)

# VerifyResult lives in a leaf module the Pallas kernels import too (a kernel
# never imports its dispatcher); re-exported here, where its convention is.
from jaxspec.speculative.types import VerifyResult, in_vocab

__all__ = [
    "VerifyResult",
    "emitted_tokens",
    "make_verify_noise",
    "verify_coupled",
    "verify_greedy",
    "verify_greedy_ref",
    "verify_rejection",
    "verify_rejection_ref",
    "verify_target_only",
    "verify_target_only_ref",
]


def emitted_tokens(
    tokens: Int[Array, "B N"],
    result: VerifyResult,
) -> Int[Array, "B D1"]:
    """[B, max_depth + 1] int32: accepted draft tokens then the bonus, -1 padded."""
    acc, n, bonus = result
    col = jnp.arange(acc.shape[1], dtype=jnp.int32)[None, :]
    # Column c holds the draft at accept_index[c + 1]; shift left by one.
    nxt = jnp.concatenate([acc[:, 1:], jnp.full_like(acc[:, :1], -1)], axis=1)
    drafts = jnp.take_along_axis(tokens, jnp.maximum(nxt, 0), axis=1)
    out = jnp.where(col < n[:, None], drafts, -1)
    return jnp.where(col == n[:, None], bonus[:, None], out).astype(jnp.int32)


def _initial_accept_index(max_depth: int) -> jax.Array:
    return jnp.full((max_depth + 1,), -1, jnp.int32).at[0].set(0)


def _record(acc: jax.Array, accept: jax.Array, n: jax.Array, j: jax.Array) -> jax.Array:
    # Index max_depth + 1 is out of bounds and dropped: a rejection writes nothing.
    slot = jnp.where(accept, n + 1, acc.shape[0])
    return acc.at[slot].set(j, mode="drop")


def _race_with_fallback(
    residual: Float[Array, "V"], fallback: Float[Array, "V"], exp_noise: Float[Array, "V"]
) -> jax.Array:
    score = residual / exp_noise
    empty = jnp.max(score) <= 0.0
    return race_sample(jnp.where(empty, fallback, residual), exp_noise)


# --------------------------------------------------------------------------
# References (per sequence, vmapped)
# --------------------------------------------------------------------------


def _greedy_one(tokens, next_token, next_sibling, target_predict, max_depth):
    # tokens/next_token/next_sibling/target_predict: [N] int32 (one sequence).
    def cond(s):
        _, n, _, j = s
        return (j >= 0) & (n < max_depth)

    def body(s):
        acc, n, cur, j = s
        # target_predict is an argmax, in [0, V), so neither padding (< 0) nor an
        # out-of-vocabulary draft (>= V) can ever match: no range test needed.
        accept = tokens[j] == target_predict[cur]
        acc = _record(acc, accept, n, j)
        return (acc, n + accept, jnp.where(accept, j, cur),
                jnp.where(accept, next_token[j], next_sibling[j]))

    init = (_initial_accept_index(max_depth), jnp.int32(0), jnp.int32(0), next_token[0])
    acc, n, cur, _ = lax.while_loop(cond, body, init)
    return acc, n, target_predict[cur]


@functools.partial(jax.jit, static_argnames=("max_depth",))
def verify_greedy_ref(
    tokens: Int[Array, "B N"],
    retrieve_next_token: Int[Array, "B N"],
    retrieve_next_sibling: Int[Array, "B N"],
    target_predict: Int[Array, "B N"],
    *,
    max_depth: int,
) -> VerifyResult:
    """jnp reference of `verify_greedy`."""
    fn = functools.partial(_greedy_one, max_depth=max_depth)
    acc, n, bonus = jax.vmap(fn)(
        tokens.astype(jnp.int32), retrieve_next_token.astype(jnp.int32),
        retrieve_next_sibling.astype(jnp.int32), target_predict.astype(jnp.int32))
    return VerifyResult(acc, n, bonus.astype(jnp.int32))


def _target_only_one(tokens, next_token, next_sibling, target_probs, uniforms,
                     bonus_noise, threshold_single, threshold_acc, max_depth):
    # tokens/next_*: [N]; target_probs: [N, V]; uniforms: [N]; bonus_noise: [V].
    vocab = target_probs.shape[-1]

    def cond(s):
        _, n, _, j, _, _ = s
        return (j >= 0) & (n < max_depth)

    def body(s):
        acc, n, cur, j, prob_acc, res = s
        t = tokens[j]
        # Out-of-vocabulary ids are skipped like padding: a clamped gather would
        # read a real probability for them (see types.in_vocab).
        valid = in_vocab(t, vocab)
        tc = jnp.where(valid, t, 0)
        # res is target_probs[cur] with already-rejected tokens zeroed, so a
        # repeated sibling token adds nothing to the cumulative mass.
        p_single = jnp.where(valid, res[tc], 0.0)
        prob_acc = prob_acc + p_single
        accept = valid & ((uniforms[cur] < prob_acc / threshold_acc)
                          | (p_single >= threshold_single))
        res_rejected = res.at[tc].set(jnp.where(valid, 0.0, res[tc]))
        acc = _record(acc, accept, n, j)
        return (acc, n + accept, jnp.where(accept, j, cur),
                jnp.where(accept, next_token[j], next_sibling[j]),
                jnp.where(accept, 0.0, prob_acc),
                jnp.where(accept, target_probs[j], res_rejected))

    init = (_initial_accept_index(max_depth), jnp.int32(0), jnp.int32(0), next_token[0],
            jnp.float32(0.0), target_probs[0])
    acc, n, cur, _, _, res = lax.while_loop(cond, body, init)
    return acc, n, _race_with_fallback(res, target_probs[cur], bonus_noise)


def _per_request(x, batch: int) -> jax.Array:
    return jnp.broadcast_to(jnp.asarray(x, jnp.float32), (batch,))


@functools.partial(jax.jit, static_argnames=("max_depth",))
def verify_target_only_ref(
    tokens: Int[Array, "B N"],
    retrieve_next_token: Int[Array, "B N"],
    retrieve_next_sibling: Int[Array, "B N"],
    target_probs: Float[Array, "B N V"],
    uniforms: Float[Array, "B N"],
    bonus_noise: Float[Array, "B V"],
    threshold_single: float | Float[Array, "B"] = 1.0,
    threshold_acc: float | Float[Array, "B"] = 1.0,
    *,
    max_depth: int,
) -> VerifyResult:
    """jnp reference of `verify_target_only`."""
    batch = tokens.shape[0]
    fn = functools.partial(_target_only_one, max_depth=max_depth)
    acc, n, bonus = jax.vmap(fn)(
        tokens.astype(jnp.int32), retrieve_next_token.astype(jnp.int32),
        retrieve_next_sibling.astype(jnp.int32), target_probs.astype(jnp.float32),
        uniforms.astype(jnp.float32), bonus_noise.astype(jnp.float32),
        _per_request(threshold_single, batch),
        jnp.maximum(_per_request(threshold_acc, batch), 1e-9))
    return VerifyResult(acc, n, bonus)


def _rejection_one(tokens, next_token, next_sibling, target_probs, draft_probs,
                   uniforms, bonus_noise, max_depth):
    # tokens/next_*: [N]; target_probs: [N, V]; draft_probs: [N, V] or None
    # (one-hot drafts); uniforms: [N]; bonus_noise: [V].
    vocab = target_probs.shape[-1]
    iota = jnp.arange(vocab, dtype=jnp.int32)

    def cond(s):
        _, n, _, j, _ = s
        return (j >= 0) & (n < max_depth)

    def body(s):
        acc, n, cur, j, res = s
        t = tokens[j]
        # Out-of-vocabulary ids are skipped like padding: a clamped gather would
        # read a real probability for them (see types.in_vocab).
        valid = in_vocab(t, vocab)
        tc = jnp.where(valid, t, 0)
        if draft_probs is None:
            q_row = jnp.where(iota == tc, 1.0, 0.0)
        else:
            q_row = draft_probs[j]
        # 1. Accept with probability min(1, p'(t)/q(t)); no division, so q(t)=0
        #    (impossible for a drawn token) cannot produce NaN.
        accept = valid & (uniforms[j] * q_row[tc] < res[tc])
        # 2. Rejection: residual max(p' - q, 0), renormalised so the next
        #    sibling's ratio test sees a distribution.
        new = jnp.maximum(res - q_row, 0.0)
        z = jnp.sum(new)
        res_rejected = jnp.where(z > 0.0, new / z, target_probs[cur])
        res_rejected = jnp.where(valid, res_rejected, res)
        acc = _record(acc, accept, n, j)
        return (acc, n + accept, jnp.where(accept, j, cur),
                jnp.where(accept, next_token[j], next_sibling[j]),
                jnp.where(accept, target_probs[j], res_rejected))

    init = (_initial_accept_index(max_depth), jnp.int32(0), jnp.int32(0), next_token[0],
            target_probs[0])
    acc, n, cur, _, res = lax.while_loop(cond, body, init)
    return acc, n, _race_with_fallback(res, target_probs[cur], bonus_noise)


@functools.partial(jax.jit, static_argnames=("max_depth",))
def verify_rejection_ref(
    tokens: Int[Array, "B N"],
    retrieve_next_token: Int[Array, "B N"],
    retrieve_next_sibling: Int[Array, "B N"],
    target_probs: Float[Array, "B N V"],
    draft_probs: Float[Array, "B N V"] | None,
    uniforms: Float[Array, "B N"],
    bonus_noise: Float[Array, "B V"],
    *,
    max_depth: int,
) -> VerifyResult:
    """jnp reference of `verify_rejection`."""
    ints = [x.astype(jnp.int32) for x in (tokens, retrieve_next_token, retrieve_next_sibling)]
    floats = [target_probs.astype(jnp.float32), uniforms.astype(jnp.float32),
              bonus_noise.astype(jnp.float32)]
    if draft_probs is None:
        def fn(tok, nt, ns, p, u, e):
            return _rejection_one(tok, nt, ns, p, None, u, e, max_depth)
        acc, n, bonus = jax.vmap(fn)(*ints, *floats)
    else:
        def fn(tok, nt, ns, p, q, u, e):
            return _rejection_one(tok, nt, ns, p, q, u, e, max_depth)
        acc, n, bonus = jax.vmap(fn)(*ints, floats[0], draft_probs.astype(jnp.float32),
                                     *floats[1:])
    return VerifyResult(acc, n, bonus)


# --------------------------------------------------------------------------
# Public, dispatching (kernel vs reference per jaxspec.pallas)
# --------------------------------------------------------------------------

def _kernel(rule: str):
    """The kernel a dispatcher calls for `rule` ("greedy", "target_only", "rejection"), or None
    where the jnp reference runs (the `jaxspec.pallas` rule). Two kernel sets with one
    signature: Mosaic on TPU (`jaxspec.pallas.verify_tpu`; Mosaic rejects the Triton ones'
    blocks and loads), Triton on GPU and in interpret mode (`jaxspec.pallas.verify`). Looked up
    by name at call time, so tests can stub either set."""
    if kernel_backend() == "tpu":
        import jaxspec.pallas.verify_tpu as tpu

        return functools.partial(getattr(tpu, f"verify_{rule}_tpu"), interpret=False)
    if use_kernel(("gpu",)):
        import jaxspec.pallas.verify as triton

        return functools.partial(getattr(triton, f"verify_{rule}_pallas"), interpret=interpret_mode())
    return None


def verify_greedy(
    tokens: Int[Array, "B N"],
    retrieve_next_token: Int[Array, "B N"],
    retrieve_next_sibling: Int[Array, "B N"],
    target_predict: Int[Array, "B N"],
    *,
    max_depth: int,
) -> VerifyResult:
    """Greedy tree verification. target_predict [B, N]: target argmax at each
    node. Among the children of the current node the one whose token equals
    target_predict[current] is accepted; the walk stops when none matches (or
    at max_depth); bonus = target_predict[last accepted node]."""
    if (kernel := _kernel("greedy")) is not None:
        from jaxspec.pallas.shard import shard_kernel_rows

        kernel = functools.partial(kernel, max_depth=max_depth)
        return shard_kernel_rows(kernel, tokens, retrieve_next_token, retrieve_next_sibling, target_predict)
    return verify_greedy_ref(tokens, retrieve_next_token, retrieve_next_sibling,
                             target_predict, max_depth=max_depth)


def verify_coupled(
    tokens: Int[Array, "B N"],
    retrieve_next_token: Int[Array, "B N"],
    retrieve_next_sibling: Int[Array, "B N"],
    logits: Float[Array, "B N V"],
    depth: Int[Array, "B N"],
    sampling,
    hist_len: Int[Array, "B"],
    *,
    max_depth: int,
) -> VerifyResult:
    """The coupled rule's walk, racing only the positions it reads.

    Equals `verify_greedy(..., coupled_predict(logits, depth, sampling, hist_len, max_depth))`,
    the specification (tested). `coupled_predict` races every node in full, and a node after a
    rejected draft is flat (thousands of tokens in its nucleus), so on real drafts the whole block
    fell through to the wide tiers: a sampled n-gram verify of 8 cost ~2.8x a greedy one. Here:
    1. Every node races its 64 likeliest tokens (`race_first_tier`); a node they do not decide is
       UNDECIDED, which no draft token equals.
    2. The greedy walk over those. A row that stops at an UNDECIDED node has that node raced in
       full (`race_past_first_tier`, one [V] row per sequence) and walks again, until every row stops
       at a decided node: a chain races at most one position in full per step, and the flat
       positions past the first miss never.
    """
    walk = functools.partial(verify_greedy, tokens, retrieve_next_token, retrieve_next_sibling, max_depth=max_depth)
    keys = coupled_keys(sampling.seed, depth, hist_len, max_depth)
    rows = jnp.arange(tokens.shape[0])

    # 1. The candidates' races.
    pred = race_first_tier(logits, sampling.temperature, sampling.top_k, sampling.top_p, keys)

    # 2. Walk; race in full where a walk stopped on an open node; walk again.
    def body(carry):
        pred, res = carry
        need = res.bonus_token == UNDECIDED
        node = jnp.take_along_axis(res.accept_index, res.num_accepted[:, None], axis=1)[:, 0]
        temperature = jnp.where(need, sampling.temperature, 0.0)  # the other rows: a cheap argmax, unused
        tok = race_past_first_tier(logits[rows, node][:, None], temperature, sampling.top_k, sampling.top_p,
                                   keys[rows, node][:, None])[:, 0]
        pred = pred.at[rows, node].set(jnp.where(need, tok, pred[rows, node]))
        return pred, walk(pred)

    _, res = lax.while_loop(lambda c: jnp.any(c[1].bonus_token == UNDECIDED), body, (pred, walk(pred)))
    return res


def verify_target_only(
    tokens: Int[Array, "B N"],
    retrieve_next_token: Int[Array, "B N"],
    retrieve_next_sibling: Int[Array, "B N"],
    target_probs: Float[Array, "B N V"],
    uniforms: Float[Array, "B N"],
    bonus_noise: Float[Array, "B V"],
    threshold_single: float | Float[Array, "B"] = 1.0,
    threshold_acc: float | Float[Array, "B"] = 1.0,
    *,
    max_depth: int,
) -> VerifyResult:
    """SGLang's target-only tree sampling (module docstring). Lossless only at
    threshold_single = threshold_acc = 1.0 (the default)."""
    if (kernel := _kernel("target_only")) is not None:
        from jaxspec.pallas.shard import shard_kernel_rows

        kernel = functools.partial(kernel, max_depth=max_depth)
        return shard_kernel_rows(kernel, tokens, retrieve_next_token, retrieve_next_sibling, target_probs, uniforms,
                                 bonus_noise, threshold_single, threshold_acc)
    return verify_target_only_ref(
        tokens, retrieve_next_token, retrieve_next_sibling, target_probs, uniforms,
        bonus_noise, threshold_single, threshold_acc, max_depth=max_depth)


def verify_rejection(
    tokens: Int[Array, "B N"],
    retrieve_next_token: Int[Array, "B N"],
    retrieve_next_sibling: Int[Array, "B N"],
    target_probs: Float[Array, "B N V"],
    draft_probs: Float[Array, "B N V"] | None,
    uniforms: Float[Array, "B N"],
    bonus_noise: Float[Array, "B V"],
    *,
    max_depth: int,
) -> VerifyResult:
    """Lossless rejection-sampling tree verification (module docstring).
    draft_probs [B, N, V] is indexed by CHILD node; None means one-hot drafts
    (deterministic drafters) without materialising them."""
    if (kernel := _kernel("rejection")) is not None:
        from jaxspec.pallas.shard import shard_kernel_rows

        kernel = functools.partial(kernel, max_depth=max_depth)
        return shard_kernel_rows(kernel, tokens, retrieve_next_token, retrieve_next_sibling, target_probs,
                                 draft_probs, uniforms, bonus_noise)
    return verify_rejection_ref(tokens, retrieve_next_token, retrieve_next_sibling,
                                target_probs, draft_probs, uniforms, bonus_noise,
                                max_depth=max_depth)
