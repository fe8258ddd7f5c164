"""The speculative iteration as one pure function, run inside `lax.while_loop`.

    draft -> build tree -> verify forward -> accept -> commit KV -> emit -> observe

The drafter is called through its protocol (`jaxspec.speculative.protocol`):
`propose` drafts, the verify forward returns the target features it declared
(`target_features`), and `observe` (its draft-extend) reads the committed
path with their features. Nothing here asks which drafter it is.

`SpecState` is the loop carry. The token history (prompt + committed output)
lives on device, which is what lets the n-gram drafter run inside the loop.
Invariant: history[b, hist_len[b] - 1] is the root (the last committed token,
whose K/V is not yet in the target cache), so the target cache holds
hist_len - 1 tokens. Accept/bonus semantics: see `jaxspec.speculative.verify`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.cache.paged import NULL_PAGE, KVCache, slot_to_page, write_layer_kv
from jaxspec.config import SpecSection
from jaxspec.models.config import ModelConfig
from jaxspec.models.llama import forward
from jaxspec.pallas import use_kernel
from jaxspec.speculative.commit import commit_accepted_kv
from jaxspec.speculative.grammar import constrain, tree_parents
from jaxspec.speculative.logprobs import TokenLogprobs, path_entries, record
from jaxspec.speculative.penalties import penalize_tree
from jaxspec.speculative.sampling import argmax_last, make_verify_noise, target_probs_from_logits
from jaxspec.speculative.tree import build_tree
from jaxspec.speculative.types import Committed, DrafterContractError, FeatureRequest, TargetKV
from jaxspec.speculative.verify import (emitted_tokens, verify_coupled, verify_greedy, verify_rejection,
                                       verify_target_only)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    cache: KVCache
    draft: object  # drafter state pytree (None for drafters without one)
    page_table: jax.Array  # [B, max_pages] int32
    history: jax.Array  # [B, C] int32 prompt + committed tokens
    hist_len: jax.Array  # [B] int32
    prompt_lens: jax.Array  # [B] int32
    done: jax.Array  # [B] bool
    num_verify: jax.Array  # [B] int32 verify steps taken
    accept_lens: jax.Array  # [B, C] int32 committed tokens per verify step (num_accepted + 1)
    sampling: object  # engine.device_sampling.DeviceSampling
    # [1, K] int32 n-gram corpus prepended to every history for matching, or None.
    corpus: jax.Array | None = None
    # The committed tokens' log-probabilities of this call (speculative/logprobs.py), or None:
    # not recorded (the decode function adds the buffers; a hand-built state may go without).
    logprobs: TokenLogprobs | None = None
    # [B] int32 iterations this call may run (the same in every row: a per-row leaf shards with the
    # batch), at most `max_iters`; or None: `max_iters`. The server shortens a call while a prefill
    # waits, without compiling a program per length.
    iter_budget: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class SpecPlan:
    """Static shape of one speculative iteration, derived from the [spec] config: the draft's size, the
    verify rule and the capabilities the loop branches on. What only one drafter reads stays in its
    [spec] fields, which its registered builder is given."""

    algorithm: str
    num_draft_tokens: int  # N, root included
    topk: int
    num_steps: int
    verify: str  # as configured: auto | greedy | target-only | rejection
    sampled_rule: str  # the rule sampled rows get: target-only | rejection (greedy: never sampled)
    threshold_single: float
    threshold_acc: float
    simulate_accept_length: int
    # Capabilities of the algorithm (AlgorithmInfo), so nothing here asks its name.
    drafts_in_steps: bool = True  # tree depth bounded by num_steps (else by num_draft_tokens)
    variable_draft_width: bool = False  # drafts often end in padding: verify at narrower widths
    logprobs_mode: str = "raw"  # which distribution logprobs report (engine.logprobs_mode)
    # The build for batches with a structured-output row: the verify applies each node's grammar
    # mask, fetched from the host once per iteration (speculative/grammar.py).
    constrained: bool = False

    @property
    def chain(self) -> bool:
        return self.topk == 1

    @property
    def max_depth(self) -> int:
        if self.chain or not self.drafts_in_steps:
            return self.num_draft_tokens - 1
        return self.num_steps

    @classmethod
    def from_config(cls, spec: SpecSection) -> "SpecPlan":
        from jaxspec.speculative.algorithm import algorithm_info, canonical_name, sampling_verify

        algorithm = canonical_name(spec.algorithm)
        info = algorithm_info(algorithm)
        return cls(
            algorithm=algorithm, num_draft_tokens=spec.num_draft_tokens, topk=spec.topk,
            num_steps=spec.num_steps, verify=spec.verify,
            sampled_rule=sampling_verify(spec.verify), threshold_single=spec.threshold_single,
            threshold_acc=spec.threshold_acc, simulate_accept_length=spec.simulate_accept_length,
            drafts_in_steps=info.drafts_in_steps,
            variable_draft_width=info.variable_draft_width,
        )


def _verify(plan: SpecPlan, tree, tokens, logits, draft_probs, s: SpecState):
    """Accept decision, per row: the greedy rule for greedy rows, `plan.sampled_rule`
    for sampled ones; returns a VerifyResult.

    The sampling rules equal the greedy one on temperature-0 rows (their
    target distribution is one-hot(argmax), and so is a sampling drafter's q),
    which is what makes one rule per row possible in one batch. An all-greedy
    batch takes the greedy rule outright and skips the noise draw over the
    vocabulary (milliseconds per step on CPU). The branches only read logits,
    so the cond costs no cache copy.

    Noise: the step's key is (seed, hist_len), hist_len being the index of the
    first token this step emits (the root sits at hist_len - 1); see
    `sampling.step_key`. The coupled rule instead races each position with its
    own index's noise (`sampling.position_noise`).
    """

    def greedy():
        predict = argmax_last(logits)
        return verify_greedy(tokens, tree.retrieve_next_token, tree.retrieve_next_sibling, predict,
                             max_depth=plan.max_depth)

    if plan.verify == "greedy":  # sampled requests are refused up front (check_request_sampling)
        return greedy()
    sp = s.sampling

    def sampled():
        if plan.sampled_rule == "coupled":  # the races alone: no distribution over V is built
            return verify_coupled(tokens, tree.retrieve_next_token, tree.retrieve_next_sibling, logits, tree.depth,
                                  sp, s.hist_len, max_depth=plan.max_depth)
        probs = target_probs_from_logits(logits, sp.temperature, sp.top_k, sp.top_p)
        uniforms, bonus_noise = make_verify_noise(sp.seed, s.hist_len, tokens.shape[1], logits.shape[-1])
        if plan.sampled_rule == "target-only":
            return verify_target_only(
                tokens, tree.retrieve_next_token, tree.retrieve_next_sibling, probs, uniforms, bonus_noise,
                plan.threshold_single, plan.threshold_acc, max_depth=plan.max_depth,
            )
        return verify_rejection(
            tokens, tree.retrieve_next_token, tree.retrieve_next_sibling, probs, draft_probs, uniforms,
            bonus_noise, max_depth=plan.max_depth,
        )

    return jax.lax.cond(jnp.all(sp.temperature <= 0.0), greedy, sampled)


def _simulate(plan: SpecPlan, result, logits):
    """Benchmark-only: force the chain acceptance length (output is NOT exact)."""
    depth = plan.max_depth
    forced = jnp.full_like(result.num_accepted, min(plan.simulate_accept_length, depth + 1) - 1)
    accept_index = jnp.where(jnp.arange(depth + 1)[None] <= forced[:, None], jnp.arange(depth + 1)[None], -1)
    bonus = argmax_last(jnp.take_along_axis(logits, forced[:, None, None], axis=1)[:, 0])
    return type(result)(accept_index.astype(jnp.int32), forced, bonus.astype(jnp.int32))


def target_kv(drafter, cache: KVCache | None) -> TargetKV | None:
    """The target cache as `propose` may see it: the declared layers' pools, or nothing."""
    layers = tuple(int(i) for i in getattr(drafter, "target_kv_layers", ()) or ())
    if not layers or cache is None:
        return None
    bad = [i for i in layers if not 0 <= i < cache.k.shape[0]]
    if bad:
        raise DrafterContractError(f"drafter {type(drafter).__name__} declares target_kv_layers {list(layers)}; "
                                   f"{bad} are outside the target's {cache.k.shape[0]} layers")
    return TargetKV(layers, tuple(cache.k[i] for i in layers), tuple(cache.v[i] for i in layers))


def draft_phase(plan: SpecPlan, drafter, draft_params, s: SpecState):
    """1. Draft: (tokens [B,N], parents [B,N] | None, draft_probs [B,N,V] | None, drafter state)."""
    tokens, parents, draft_probs, draft_state = drafter.propose(draft_params, s.draft,
                                                                dataclasses.replace(s, cache=target_kv(drafter, s.cache)))
    # The declaration is the contract (checked when traced, so at compile time): the verifier
    # trusts draft_probs as the q each draft was drawn from, and one-hot verifies the rest.
    declared = bool(getattr(drafter, "provides_draft_probs", False))
    name = type(drafter).__name__
    if draft_probs is not None and not declared:
        raise DrafterContractError(f"drafter {name}: propose returned draft probabilities but the drafter does "
                                   "not declare provides_draft_probs = True")
    if draft_probs is None and declared and tokens.shape[1] > 1:
        raise DrafterContractError(f"drafter {name} declares provides_draft_probs but propose returned no draft "
                                   "probabilities (the q each draft was sampled from)")
    if plan.simulate_accept_length:
        tokens = jnp.maximum(tokens, 0)  # every node is real, so the forced path exists
    return tokens, parents, draft_probs, draft_state


def verify_widths(plan: SpecPlan) -> tuple[int, ...]:
    """Forward widths a verify step may use. Drafters that leave padding (n-gram:
    no match, or a short one) also get narrow widths, on the jnp path."""
    n = plan.num_draft_tokens
    if not plan.variable_draft_width or plan.simulate_accept_length or use_kernel():
        return (n,)
    # Powers of two: a forward over up to 4 tokens costs one decode step on CPU,
    # and from there on cost grows with width (the n-gram match-length cap aims at 4).
    return tuple(sorted({1, n} | {w for w in (2, 4, 8) if w < n}))


def _verify_forward(plan: SpecPlan, cfg: ModelConfig, params, s: SpecState, tokens, tree, seq_lens, live,
                    want: FeatureRequest):
    """(cache, logits [B, N, V], features [B, N, F] | None) of the target forward over the draft tree.

    Node i is written at slot seq_len + i (commit later moves the accepted ones).
    With several widths, the forward runs over only the first `w` nodes, `w`
    the narrowest width holding every live row's real nodes: padding comes after
    the real nodes (tree convention), so those `w` nodes form a valid tree, and a
    step where the n-gram drafter found nothing costs a plain decode step. The
    branches only read the cache (the block attends to its own K/V directly) and
    the K/V are written after the switch: a cache written inside a branch would
    be copied whole by XLA every iteration. Logits past `w` are zero; they
    belong to padding nodes, which no verifier accepts; features past `w` are
    zero too, and commit never gathers them (only accepted nodes).
    """
    n = plan.num_draft_tokens
    widths = verify_widths(plan)
    tok = jnp.maximum(tokens, 0)
    capture = dict(capture_layers=want.layers, capture_final=want.final_norm)
    if len(widths) == 1:
        out = forward(params, cfg, tok, tree.positions, s.cache, s.page_table, q_start=seq_lens,
                      kv_len=jnp.where(live, seq_lens + n, seq_lens), tree_mask=tree.mask, **capture)
        return out.cache, out.logits, out.features

    def branch(w):
        def run(cache):
            out = forward(params, cfg, tok[:, :w], tree.positions[:, :w], cache, s.page_table, q_start=seq_lens,
                          kv_len=seq_lens + w, tree_mask=tree.mask[:, :w, :w], write_cache=False, **capture)
            # Node axis: 1 for logits and features [B, T, ...], 2 for the K/V [L, B, T, ...].
            pad = lambda x, ax: jnp.pad(x, [(0, 0)] * ax + [(0, n - w)] + [(0, 0)] * (x.ndim - ax - 1))  # noqa: E731
            feats = None if out.features is None else pad(out.features, 1)
            return pad(out.logits, 1), feats, pad(out.new_kv[0], 2), pad(out.new_kv[1], 2)

        return run

    real = (tokens >= 0) & live[:, None]
    need = jnp.max(jnp.where(real, jnp.arange(n)[None, :] + 1, 1))
    index = jnp.searchsorted(jnp.array(widths), need)
    logits, feats, k_new, v_new = jax.lax.switch(index, [branch(w) for w in widths], s.cache)
    # Write the used nodes' K/V (all layers at once); the rest go to the null page.
    width = jnp.array(widths)[index]
    slots = seq_lens[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    pages, offsets = slot_to_page(s.page_table, slots, s.cache.page_size)
    used = (jnp.arange(n)[None, :] < width) & live[:, None]
    pages = jnp.where(used, pages, NULL_PAGE)
    k, v = write_layer_kv(s.cache.k, s.cache.v, slice(None), pages, offsets, k_new, v_new)
    return KVCache(k=k, v=v), logits, feats


def verify_phase(plan: SpecPlan, cfg: ModelConfig, params, s: SpecState, tokens, parents, draft_probs,
                 want: FeatureRequest = FeatureRequest()):
    """2-4. Tree, one target forward over the draft tree, accept:
    (cache, VerifyResult, features [B, N, F] | None per `want`, the emitted tokens' logprob
    entries (`logprobs.path_entries`) | None when the state records none)."""
    live = ~s.done
    seq_lens = s.hist_len - 1
    tree = build_tree(tokens, parents, seq_lens, chain=parents is None)
    cache, raw, feats = _verify_forward(plan, cfg, params, s, tokens, tree, seq_lens, live, want)
    # Penalties, bias, min_tokens: each node under its own prefix (speculative/penalties.py).
    logits = penalize_tree(raw, s.sampling, s.history, s.hist_len, s.prompt_lens, tokens, tree)
    if plan.constrained:  # each node under its grammar mask (speculative/grammar.py: why this is exact)
        logits = constrain(logits, s.sampling.grammar, s.history, s.hist_len, s.prompt_lens, tokens, tree_parents(tree))
    result = _verify(plan, tree, tokens, logits, draft_probs, s)
    if plan.simulate_accept_length:
        result = _simulate(plan, result, logits)
    step_lp = None
    if s.logprobs is not None:
        step_lp = path_entries(raw, logits, result.accept_index, emitted_tokens(tokens, result), s.sampling,
                               plan.logprobs_mode)
    return cache, result, feats, step_lp


def committed_path(s: SpecState, tokens, result, feats) -> Committed:
    """The root and accepted drafts of this step, with their target features
    (gathered the way commit gathers their K/V), for the drafter's observe.

    tokens [B, N]; feats [B, N, F] | None.
    """
    idx = jnp.maximum(result.accept_index, 0)  # [B, D+1]
    path_tokens = jnp.take_along_axis(jnp.maximum(tokens, 0), idx, axis=1)
    path_feats = None if feats is None else jnp.take_along_axis(feats, idx[:, :, None], axis=1)
    count = jnp.where(s.done, 0, result.num_accepted + 1)
    return Committed(path_tokens, path_feats, s.hist_len - 1, count.astype(jnp.int32), result.bonus_token)


def commit_phase(s: SpecState, cache, draft_state, tokens, result, chain: bool = False, step_lp=None) -> SpecState:
    """5-7. Commit K/V, emit tokens (cut at stops / max_new_tokens) with their logprob entries
    (`step_lp`, verify_phase's), record metrics."""
    live = ~s.done
    seq_lens = s.hist_len - 1
    # 5. The accepted path's K/V becomes contiguous. A chain's accepted path is a
    # prefix, already in place, so chains skip the move: it would gather and
    # scatter every layer for nothing, and where its indices do not depend on
    # the forward (forced acceptance) XLA ran it beside the last layer's
    # attention and copied the whole cache every iteration to allow that.
    if not chain:
        cache = commit_accepted_kv(cache, s.page_table, seq_lens, result.accept_index, result.num_accepted)
    # 6. Emit: accepted drafts + bonus, cut at a stop token or max_new_tokens.
    new = emitted_tokens(tokens, result)  # [B, D+1]
    width = new.shape[1]
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    committed = result.num_accepted + 1
    is_stop = jnp.any(new[:, :, None] == s.sampling.stop_ids[:, None, :], axis=-1) & (j < committed[:, None])
    first_stop = jnp.where(is_stop.any(-1), jnp.argmax(is_stop, axis=-1), width)
    room = s.sampling.max_tokens - (s.hist_len - s.prompt_lens)
    n_emit = jnp.where(live, jnp.minimum(jnp.minimum(committed, first_stop + 1), room), 0)
    cols = jnp.where(j < n_emit[:, None], s.hist_len[:, None] + j, s.history.shape[1])
    history = s.history.at[jnp.arange(new.shape[0])[:, None], cols].set(new, mode="drop")
    hist_len = s.hist_len + n_emit
    done = s.done | (live & ((first_stop < committed) | (hist_len - s.prompt_lens >= s.sampling.max_tokens)))
    # 7. Metrics: committed tokens per verify (before any stop/max-tokens cut).
    step_col = jnp.where(live, s.num_verify, s.accept_lens.shape[1])
    accept_lens = s.accept_lens.at[jnp.arange(new.shape[0]), step_col].set(committed, mode="drop")
    logprobs = s.logprobs if step_lp is None else record(s.logprobs, step_lp, s.hist_len, n_emit)
    return dataclasses.replace(
        s, cache=cache, draft=draft_state, history=history, hist_len=hist_len, done=done,
        num_verify=s.num_verify + live.astype(jnp.int32), accept_lens=accept_lens, logprobs=logprobs,
    )


def spec_iteration(plan: SpecPlan, cfg: ModelConfig, drafter, params, draft_params, s: SpecState) -> SpecState:
    """One draft -> verify -> commit -> observe iteration (the while_loop body)."""
    tokens, parents, draft_probs, draft_state = draft_phase(plan, drafter, draft_params, s)
    cache, result, feats, step_lp = verify_phase(plan, cfg, params, s, tokens, parents, draft_probs,
                                                 drafter.target_features)
    out = commit_phase(s, cache, draft_state, tokens, result, chain=parents is None, step_lp=step_lp)
    # 8. Draft-extend: the drafter sees what was committed, with its features.
    draft_state = drafter.observe(draft_params, out.draft, committed_path(s, tokens, result, feats), s.page_table)
    return dataclasses.replace(out, draft=draft_state)


def make_spec_decode_fn(plan: SpecPlan, cfg: ModelConfig, drafter, max_iters: int | None = None):
    """Iterate until every row is done, or for at most `max_iters` iterations (the
    server's bounded calls, so requests can join between them; fewer when the state's
    `iter_budget` says so). The returned state's
    `logprobs` hold the call's committed tokens' entries (as wide as a call can commit)."""

    def decode_fn(params, draft_params, state: SpecState) -> SpecState:
        width = state.history.shape[1]
        if max_iters is not None:
            width = min(width, max_iters * (plan.max_depth + 1))
        state = dataclasses.replace(state, logprobs=TokenLogprobs.zeros(state.hist_len, width, cfg.vocab_size))
        if max_iters is None:
            return jax.lax.while_loop(
                lambda s: ~jnp.all(s.done),
                lambda s: spec_iteration(plan, cfg, drafter, params, draft_params, s),
                state,
            )
        limit = max_iters if state.iter_budget is None else jnp.minimum(max_iters, jnp.max(state.iter_budget))
        return jax.lax.while_loop(
            lambda c: (c[0] < limit) & ~jnp.all(c[1].done),
            lambda c: (c[0] + 1, spec_iteration(plan, cfg, drafter, params, draft_params, c[1])),
            (jnp.int32(0), state),
        )[1]

    return decode_fn


def make_phase_fns(plan: SpecPlan, cfg: ModelConfig, drafter):
    """The three phases as separately jitted functions, for timing them (the
    fused while_loop gives no per-phase clock). Same math, same tokens. The
    caches are donated phase to phase, as in the fused loop; a copy of a
    cache in every call would swamp the timings.

    draft(draft_params, state) -> (tokens, parents, draft_probs, draft_state), consumes state.draft
    verify(params, state, tokens, parents, draft_probs) -> (cache, result, feats, step_lp), consumes state.cache
    commit(state, cache, draft_state, tokens, result, parents, step_lp) -> state
    observe(draft_params, old_state, new_state, tokens, result, feats) -> new_state (draft-extend), consumes new_state.draft
    """
    want = drafter.target_features

    def draft(draft_params, draft_state, rest):
        return draft_phase(plan, drafter, draft_params, dataclasses.replace(rest, draft=draft_state))

    def verify(params, cache, rest, tokens, parents, draft_probs):
        return verify_phase(plan, cfg, params, dataclasses.replace(rest, cache=cache), tokens, parents, draft_probs,
                            want)

    def commit(rest, cache, draft_state, tokens, result, parents=None, step_lp=None):
        # The fused loop's predicate (a chain is a proposal without parents), not the plan's shape.
        return commit_phase(dataclasses.replace(rest, cache=None), cache, draft_state, tokens, result,
                            chain=parents is None, step_lp=step_lp)

    def observe(draft_params, draft_state, old, tokens, result, feats):
        return drafter.observe(draft_params, draft_state, committed_path(old, tokens, result, feats), old.page_table)

    draft_j = jax.jit(draft, donate_argnums=(1,))
    verify_j = jax.jit(verify, donate_argnums=(1,))
    commit_j = jax.jit(commit, donate_argnums=(1,))
    observe_j = jax.jit(observe, donate_argnums=(1,))
    bare = lambda s: dataclasses.replace(s, cache=None, draft=None)  # noqa: E731
    return (
        lambda dp, s: draft_j(dp, s.draft, dataclasses.replace(s, draft=None)),
        lambda p, s, t, par, q: verify_j(p, s.cache, bare(s), t, par, q),
        lambda s, cache, d, t, r, par=None, lp=None: commit_j(bare(s), cache, d, t, r, par, lp),
        lambda dp, old, new, t, r, f: dataclasses.replace(new, draft=observe_j(dp, new.draft, bare(old), t, r, f)),
    )
