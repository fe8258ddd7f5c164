"""Phase timing (`--profile-phases`): a decode call with draft / verify / commit jitted apart.

The fused loop has no per-phase clock, so this reruns a call through the loop's own phase
functions (`loop.make_phase_fns`: the same draft, verify, commit and observe as `spec_iteration`),
one host round trip per iteration: same tokens, and a total a little above the fused loop's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from jaxspec import mesh as shd
from jaxspec.engine.core import gather_rows, scatter_rows
from jaxspec.engine.runner import ModelRunner
from jaxspec.engine.types import RequestError, RowInput
from jaxspec.speculative.logprobs import TokenLogprobs
from jaxspec.speculative.loop import SpecState, make_phase_fns


def decode_phases(r: ModelRunner, k: int, rows: Sequence[RowInput], ctx: int, timer):
    """`r.decode(k, rows, ctx)` with each phase timed into `timer` (a PhaseTimer). The first
    iteration compiles the phases: not timed."""
    if r.split_pages:  # the phases are jitted apart, not per data shard
        raise RequestError("profile_phases needs one page pool: build the Engine with split_pages=False")
    s, slots = loop_state(r, k, rows, ctx)
    constrained = any(row is not None and row.grammar is not None for row in rows)  # the "+grammar" build
    draft, verify, commit, observe = make_phase_fns(dataclasses.replace(r.plans[k], constrained=constrained),
                                                    r.cfg, r.drafters[k])
    try:
        with r.mesh_context():
            for it in range(r.steps_per_call or ctx):
                if bool(jax.device_get(jnp.all(s.done))):
                    break
                timed = timer.phase if it else (lambda name: contextlib.nullcontext())
                with timed("draft"):
                    t, p, q, d = jax.block_until_ready(draft(r.draft_params, s))
                with timed("verify"):
                    new_cache, result, feats, lp = jax.block_until_ready(verify(r.params, s, t, p, q))
                with timed("other"):
                    new = jax.block_until_ready(commit(s, new_cache, d, t, result, p, lp))
                with timed("draft"):  # the draft-extend is drafting work
                    s = jax.block_until_ready(observe(r.draft_params, s, new, t, result, feats))
        r.cache = s.cache
        r.store = scatter_rows(r.store, slots, s.draft)
        r.draft_cache = r.store[0]
    finally:
        r._restore()
    asked = any(row is not None and row.params.logprobs is not None for row in rows)
    return r.decode_outputs(rows, r.fetch(s, asked))


def loop_state(r: ModelRunner, k: int, rows: Sequence[RowInput], ctx: int) -> tuple[SpecState, jax.Array]:
    """(the loop carry of a decode call, its slots [b]) with the drafter state gathered from the
    store, outside any executable: what the phases run on. The caches stay this runner's."""
    _, inputs = r.decode_inputs(k, rows, ctx)
    slots = jnp.asarray(inputs["slots"])
    s = r._state(shd.shard_batch(inputs, r.mesh), ctx)
    s = dataclasses.replace(s, draft=gather_rows(r.drafters[k], r.store, slots),
                            logprobs=TokenLogprobs.zeros(s.hist_len, ctx, r.cfg.vocab_size))
    return s, slots
