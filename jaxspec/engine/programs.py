"""The engine's jitted programs: plain prefill and decode (`DecodeState` carry) and the
speculative prefill (the loop carry comes from `jaxspec.speculative.loop`).

Pure functions of (params, cache, batch inputs); `jaxspec.engine.Engine` compiles them per
shape bucket and donates the cache to them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.cache.paged import KVCache
from jaxspec.engine.device_sampling import DeviceSampling
from jaxspec.models.config import ModelConfig
from jaxspec.models.llama import forward
from jaxspec.speculative.sampling import sample_token


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    cache: KVCache
    page_table: jax.Array  # [B, max_pages] int32
    seq_lens: jax.Array  # [B] int32 tokens whose K/V is in the cache
    last_token: jax.Array  # [B] int32 newest token, not yet in the cache
    output: jax.Array  # [B, max_out] int32 generated tokens, -1 padded
    num_generated: jax.Array  # [B] int32
    done: jax.Array  # [B] bool
    sampling: DeviceSampling


def emit_token(state_out, num_generated, done, token, sampling):
    """Append `token` [B] to unfinished sequences and update their done flags."""
    live = ~done
    b = jnp.arange(token.shape[0])
    idx = jnp.minimum(num_generated, state_out.shape[1] - 1)
    state_out = state_out.at[b, idx].set(jnp.where(live, token, state_out[b, idx]))
    num_generated = num_generated + live.astype(jnp.int32)
    hit_stop = jnp.any(token[:, None] == sampling.stop_ids, axis=-1)
    done = done | (live & (hit_stop | (num_generated >= sampling.max_new)))
    return state_out, num_generated, done


def make_prefill_fn(cfg: ModelConfig):
    def prefill_fn(params, cache, tokens, prompt_lens, page_table, sampling: DeviceSampling, max_out: int):
        # tokens [B, L] int32 right-padded; prompt_lens [B] int32 (0 = padding row)
        b, _ = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        last = jnp.maximum(prompt_lens - 1, 0)[:, None]
        out = forward(
            params, cfg, tokens, positions, cache, page_table,
            q_start=jnp.zeros((b,), jnp.int32), kv_len=prompt_lens, logits_index=last,
        )
        first = sample_token(
            out.logits[:, 0], sampling.temperature, sampling.top_k, sampling.top_p,
            sampling.seed, prompt_lens,
        )
        output = jnp.full((b, max_out), -1, jnp.int32)
        done = prompt_lens == 0
        output, num_generated, done = emit_token(output, jnp.zeros((b,), jnp.int32), done, first, sampling)
        return DecodeState(
            cache=out.cache, page_table=page_table, seq_lens=prompt_lens, last_token=first,
            output=output, num_generated=num_generated, done=done, sampling=sampling,
        )

    return prefill_fn


def make_spec_prefill_fn(cfg: ModelConfig, drafter):
    """The whole prompt as one chunk of the shared chunked prefill (target, then
    the drafter's prefill on the target's features), then the loop carry."""
    from jaxspec.engine.core import make_chunk_prefill_fn, spec_state

    chunk_prefill = make_chunk_prefill_fn(cfg, drafter)

    def spec_prefill_fn(params, draft_params, cache, draft_cache, corpus, tokens, prompt_lens, page_table, sampling,
                        max_out):
        b = tokens.shape[0]
        cache, draft, first = chunk_prefill(params, draft_params, cache, drafter.init_state(draft_cache, b), tokens,
                                            jnp.zeros((b,), jnp.int32), prompt_lens, page_table, sampling)
        history = jnp.zeros((b, max_out), jnp.int32).at[:, : tokens.shape[1]].set(tokens)
        history = history.at[jnp.arange(b), prompt_lens].set(first, mode="drop")
        hit_stop = jnp.any(first[:, None] == sampling.stop_ids, axis=-1)
        done = (prompt_lens == 0) | hit_stop | (sampling.max_new <= 1)
        return spec_state(cache=cache, draft=draft, page_table=page_table, history=history,
                          hist_len=prompt_lens + (prompt_lens > 0).astype(jnp.int32), prompt_lens=prompt_lens,
                          done=done, sampling=sampling, accept_width=max_out, corpus=corpus)

    return spec_prefill_fn


def make_decode_fn(cfg: ModelConfig):
    def decode_fn(params, state: DecodeState) -> DecodeState:
        def cond(s: DecodeState):
            return ~jnp.all(s.done)

        def body(s: DecodeState) -> DecodeState:
            # 1. Feed each sequence's newest token at slot seq_len; done rows write
            #    to the null page (kv_len == q_start) and their output is ignored.
            live = ~s.done
            kv_len = s.seq_lens + live.astype(jnp.int32)
            out = forward(
                params, cfg, s.last_token[:, None], s.seq_lens[:, None], s.cache, s.page_table,
                q_start=s.seq_lens, kv_len=kv_len,
            )
            # 2. Sample the next token at absolute position kv_len (seeded by position).
            token = sample_token(
                out.logits[:, 0], s.sampling.temperature, s.sampling.top_k, s.sampling.top_p,
                s.sampling.seed, kv_len,
            )
            output, num_generated, done = emit_token(s.output, s.num_generated, s.done, token, s.sampling)
            return dataclasses.replace(
                s, cache=out.cache, seq_lens=kv_len, last_token=jnp.where(live, token, s.last_token),
                output=output, num_generated=num_generated, done=done,
            )

        return jax.lax.while_loop(cond, body, state)

    return decode_fn
