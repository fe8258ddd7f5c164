"""What the runner compiles around the loop: one chunked prefill, one loop-state
builder, and the per-row slicing of drafter state.

`jaxspec.engine.runner.ModelRunner` (under the offline engine and the server)
prefills through `make_chunk_prefill_fn` and builds the speculative carry with
`spec_state`, so a drafter sees the same calls whichever front end drives it:

    target forward over the chunk (capturing the drafter's features)
    -> sample the token at the chunk's end -> drafter.prefill(chunk + features)

Drafter state is a pytree whose leaves are either its paged KV cache (a
`KVCache`, shared by all rows through the page table) or per-row arrays with
a leading batch axis. `row_state` / `with_row_state` split the two, which is
what lets the server keep each sequence's drafter state on device in a slot
store between calls.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxspec.cache.paged import KVCache
from jaxspec.models.config import ModelConfig
from jaxspec.models.llama import forward
from jaxspec.speculative.grammar import constrain
from jaxspec.speculative.loop import SpecState
from jaxspec.speculative.logprobs import first_entries
from jaxspec.speculative.penalties import penalize
from jaxspec.speculative.sampling import sample_token
from jaxspec.speculative.types import Committed


def make_chunk_prefill_fn(cfg: ModelConfig, drafter, logprobs_mode: str = "raw", constrained: bool = False):
    """prefill(params, draft_params, cache, draft_state, tokens [B, L], q_start [B], chunk_lens [B],
    page_table [B, P], sampling, history [B, H], prompt_lens [B], after_cache [B] bool) -> (cache,
    draft_state, first [B],
    first's logprob entries ([B], [B], [B, K], [B, K]; `logprobs.first_entries`, zeros unless asked)).

    One chunk of up to L prompt tokens per row at cache slots q_start..
    (chunk_lens 0 = padding row); `first` is the token sampled at each chunk's
    end, seeded by its absolute position (what a chunk that finishes the
    prompt emits). `history` holds each row's whole prompt (+ any output before a
    re-prefill), which the penalties read (speculative/penalties.py). `after_cache`: the chunk
    resumes after a prefix served from the prefix cache (`Committed.after_cache`).
    `drafter` may be None (plain decoding). `constrained`: the sampled token follows its row's grammar
    (speculative/grammar.py), the build for batches with a structured-output row.
    """
    want = drafter.target_features if drafter is not None else None

    def prefill_fn(params, draft_params, cache, draft_state, tokens, q_start, chunk_lens, page_table, sampling,
                   history, prompt_lens, after_cache):
        positions = q_start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        kv_len = q_start + chunk_lens
        last = jnp.maximum(chunk_lens - 1, 0)[:, None]
        capture = {} if want is None else dict(capture_layers=want.layers, capture_final=want.final_norm)
        out = forward(params, cfg, tokens, positions, cache, page_table, q_start=q_start, kv_len=kv_len,
                      logits_index=last, **capture)
        logits = penalize(out.logits, sampling, history, kv_len, prompt_lens)
        if constrained:
            b = tokens.shape[0]
            logits = constrain(logits, sampling.grammar, history, kv_len, prompt_lens, jnp.zeros((b, 1), jnp.int32),
                               jnp.full((b, 1), -1, jnp.int32))
        first = sample_token(logits[:, 0], sampling.temperature, sampling.top_k, sampling.top_p,
                             sampling.seed, kv_len).astype(jnp.int32)
        if drafter is not None:
            chunk = Committed(tokens, out.features, q_start, chunk_lens, after_cache=after_cache)
            draft_state = drafter.prefill(draft_params, draft_state, chunk, page_table)
        lp = first_entries(out.logits[:, 0], logits[:, 0], first, sampling, logprobs_mode)
        return out.cache, draft_state, first, lp

    return prefill_fn


def spec_state(*, cache, draft, page_table, history, hist_len, prompt_lens, done, sampling, accept_width: int,
               corpus=None, iter_budget=None, zeros: Callable = jnp.zeros) -> SpecState:
    """The speculative loop's carry, with no verify step taken yet.

    `zeros(shape, dtype)` makes the counters: jnp.zeros inside jitted code,
    np.zeros for host inputs (no device fill op per shape), or
    jax.ShapeDtypeStruct for lowering.
    """
    b = hist_len.shape[0]
    return SpecState(
        cache=cache, draft=draft, page_table=page_table, history=history, hist_len=hist_len,
        prompt_lens=prompt_lens, done=done, num_verify=zeros((b,), jnp.int32),
        accept_lens=zeros((b, accept_width), jnp.int32), sampling=sampling, corpus=corpus, iter_budget=iter_budget,
    )


# ---- drafter state: the shared cache vs the per-row leaves -------------------------------------------

def _is_cache(x) -> bool:
    return isinstance(x, KVCache)


def row_state(draft):
    """The drafter state with its KV cache replaced by None: only per-row leaves [B, ...] remain."""
    return jax.tree.map(lambda x: None if _is_cache(x) else x, draft, is_leaf=_is_cache)


def draft_cache_of(draft) -> KVCache | None:
    found = [x for x in jax.tree.leaves(draft, is_leaf=_is_cache) if _is_cache(x)]
    return found[0] if found else None


def gather_rows(drafter, store, slots):
    """The drafter state of a call's rows from the slot store (draft cache, per-row leaves [S, ...]);
    slots [B] int32."""
    cache, rows = store
    return with_row_state(drafter.init_state(cache, slots.shape[0]), jax.tree.map(lambda x: x[slots], rows), cache)


def scatter_rows(store, slots, draft):
    """The slot store after a call: its drafter state's cache, and its per-row leaves written back at `slots`."""
    rows = jax.tree.map(lambda st, r: st.at[slots].set(r), store[1], row_state(draft))
    return draft_cache_of(draft), rows


def with_row_state(draft_like, rows, cache: KVCache | None):
    """Rebuild a drafter state from a template (for its structure), per-row leaves and the cache."""
    flat_rows = iter(jax.tree.leaves(rows))

    def pick(x):
        return cache if _is_cache(x) else next(flat_rows)

    return jax.tree.map(pick, draft_like, is_leaf=_is_cache)


# ---- the runner's call signatures over the slot store ------------------------------------------------


def prefill_adapter(chunk_prefill):
    """The shared chunked prefill with the drafter state third (what `with_slots` expects)."""

    def fn(params, draft_params, draft, cache, tokens, q_start, lens, table, sampling, history, prompt_lens,
           after_cache):
        cache, draft, first, lp = chunk_prefill(params, draft_params, cache, draft, tokens, q_start, lens, table,
                                                sampling, history, prompt_lens, after_cache)
        return cache, first, lp, draft

    return fn


def decode_adapter(decode):
    def fn(params, draft_params, draft, state):
        out = decode(params, draft_params, dataclasses.replace(state, draft=draft))
        return dataclasses.replace(out, draft=None), out.draft

    return fn


def with_slots(fn, drafter):
    """fn(params, draft_params, draft, *args) -> (..., draft) as a function of the
    slot store instead: store = (draft cache, per-row leaves [num_slots + 1, ...]),
    slots [B] int32 -> (store, ...). The rows are gathered before and scattered back
    after, inside the same executable (padding rows use the spare last slot).

    The store comes first in the outputs as in the arguments: jit pairs donated inputs
    with outputs by shape in order, so a draft cache shaped like the target's (a
    standalone draft as deep as the target) would otherwise alias the target's
    buffer, and XLA copies both caches in and out of every call."""

    def run(params, draft_params, store, slots, *args):
        *out, draft = fn(params, draft_params, gather_rows(drafter, store, slots), *args)
        return (scatter_rows(store, slots, draft), *out)

    return run


def stateless(decode):
    """A decode that keeps no drafter state (the plain drafter of a run-to-completion call):
    the store passes through untouched, so one call signature serves every k."""

    def run(params, draft_params, store, slots, state):
        return store, dataclasses.replace(decode(params, draft_params, state), draft=None)

    return run
