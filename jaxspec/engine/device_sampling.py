"""The one device form of a batch's sampling parameters, and its one packer.

Every front end (the offline engine behind the CLI and the API, the server, the benchmarks)
hands the jitted programs a `DeviceSampling` of [B] arrays; a batch mixes greedy and sampled
rows, padding rows are greedy. `pack` is the only place host values become it.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.sampling_params import MAX_LOGIT_BIAS

MAX_STOP_IDS = 16  # the model's EOS ids + a request's stop_token_ids


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeviceSampling:
    temperature: jax.Array  # [B] f32, 0 = greedy
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] f32
    seed: jax.Array  # [B] uint32
    stop_ids: jax.Array  # [B, MAX_STOP_IDS] int32, -1 padded
    max_tokens: jax.Array  # [B] int32 new tokens at most (counted from the prompt)
    # The processors of speculative/penalties.py (all off: 0, 0, 1, 0, no bias ids).
    presence: jax.Array  # [B] f32
    frequency: jax.Array  # [B] f32
    repetition: jax.Array  # [B] f32
    min_tokens: jax.Array  # [B] int32
    bias_ids: jax.Array  # [B, MAX_LOGIT_BIAS] int32, -1 padded
    bias: jax.Array  # [B, MAX_LOGIT_BIAS] f32
    logprobs: jax.Array  # [B] bool: the row reports its tokens' log-probabilities (speculative/logprobs.py)
    grammar: jax.Array  # [B] int32: the row's grammar id (`grammar.matcher.Grammar.id`), -1 = unconstrained

    @classmethod
    def abstract(cls, b: int) -> "DeviceSampling":
        """ShapeDtypeStructs of a batch of b rows (what the buckets compile against)."""
        i32 = jax.ShapeDtypeStruct((b,), jnp.int32)
        f32 = jax.ShapeDtypeStruct((b,), jnp.float32)
        return cls(temperature=f32, top_k=i32, top_p=f32, seed=jax.ShapeDtypeStruct((b,), jnp.uint32),
                   stop_ids=jax.ShapeDtypeStruct((b, MAX_STOP_IDS), jnp.int32), max_tokens=i32,
                   presence=f32, frequency=f32, repetition=f32, min_tokens=i32,
                   bias_ids=jax.ShapeDtypeStruct((b, MAX_LOGIT_BIAS), jnp.int32),
                   bias=jax.ShapeDtypeStruct((b, MAX_LOGIT_BIAS), jnp.float32),
                   logprobs=jax.ShapeDtypeStruct((b,), jnp.bool_), grammar=i32)

    @classmethod
    def pack(cls, rows: Sequence, b: int) -> "DeviceSampling":
        """numpy arrays for `rows` (None = a padding row), padded to b rows.

        A row (`types.RowInput`) has `params` (a SamplingParams), `seed`, `stop_ids` and maybe a
        `grammar` (its matcher: `grammar.matcher.Grammar`, built by the front end). Seeds wrap
        to uint32, budgets clip to int32."""
        temp, topp = np.zeros((b,), np.float32), np.ones((b,), np.float32)
        topk, seed, max_tokens = np.zeros((b,), np.int32), np.zeros((b,), np.uint32), np.ones((b,), np.int32)
        stop = np.full((b, MAX_STOP_IDS), -1, np.int32)
        presence, frequency, repetition = np.zeros((b,), np.float32), np.zeros((b,), np.float32), np.ones((b,), np.float32)
        min_tokens, logprobs = np.zeros((b,), np.int32), np.zeros((b,), bool)
        grammar = np.full((b,), -1, np.int32)
        bias_ids, bias = np.full((b, MAX_LOGIT_BIAS), -1, np.int32), np.zeros((b, MAX_LOGIT_BIAS), np.float32)
        for i, r in enumerate(rows):
            if r is None:
                continue
            p = r.params
            temp[i], topp[i], topk[i] = p.temperature, p.top_p, p.top_k
            seed[i], max_tokens[i] = np.uint32(r.seed & 0xFFFFFFFF), min(p.max_tokens, 2**31 - 1)
            stop[i, : len(r.stop_ids)] = list(r.stop_ids)[:MAX_STOP_IDS]
            presence[i], frequency[i], repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
            min_tokens[i] = min(p.min_tokens, 2**31 - 1)
            logprobs[i] = p.logprobs is not None
            if getattr(r, "grammar", None) is not None:
                grammar[i] = r.grammar.id
            for j, (tid, v) in enumerate(p.logit_bias):
                bias_ids[i, j], bias[i, j] = tid, v
        return cls(temperature=temp, top_k=topk, top_p=topp, seed=seed, stop_ids=stop, max_tokens=max_tokens,
                   presence=presence, frequency=frequency, repetition=repetition, min_tokens=min_tokens,
                   bias_ids=bias_ids, bias=bias, logprobs=logprobs, grammar=grammar)
