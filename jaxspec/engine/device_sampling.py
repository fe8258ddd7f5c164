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

MAX_STOP_IDS = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DeviceSampling:
    temperature: jax.Array  # [B] f32, 0 = greedy
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] f32
    seed: jax.Array  # [B] uint32
    stop_ids: jax.Array  # [B, MAX_STOP_IDS] int32, -1 padded
    max_tokens: jax.Array  # [B] int32 new tokens at most (counted from the prompt)

    @classmethod
    def abstract(cls, b: int) -> "DeviceSampling":
        """ShapeDtypeStructs of a batch of b rows (what the buckets compile against)."""
        i32 = jax.ShapeDtypeStruct((b,), jnp.int32)
        f32 = jax.ShapeDtypeStruct((b,), jnp.float32)
        return cls(temperature=f32, top_k=i32, top_p=f32, seed=jax.ShapeDtypeStruct((b,), jnp.uint32),
                   stop_ids=jax.ShapeDtypeStruct((b, MAX_STOP_IDS), jnp.int32), max_tokens=i32)

    @classmethod
    def pack(cls, rows: Sequence, b: int) -> "DeviceSampling":
        """numpy arrays for `rows` (None = a padding row), padded to b rows.

        A row (`types.RowInput`) has `params` (a SamplingParams), `seed` and `stop_ids`. Seeds wrap
        to uint32, budgets clip to int32."""
        temp, topp = np.zeros((b,), np.float32), np.ones((b,), np.float32)
        topk, seed, max_tokens = np.zeros((b,), np.int32), np.zeros((b,), np.uint32), np.ones((b,), np.int32)
        stop = np.full((b, MAX_STOP_IDS), -1, np.int32)
        for i, r in enumerate(rows):
            if r is None:
                continue
            p = r.params
            temp[i], topp[i], topk[i] = p.temperature, p.top_p, p.top_k
            seed[i], max_tokens[i] = np.uint32(r.seed & 0xFFFFFFFF), min(p.max_tokens, 2**31 - 1)
            stop[i, : len(r.stop_ids)] = list(r.stop_ids)[:MAX_STOP_IDS]
        return cls(temperature=temp, top_k=topk, top_p=topp, seed=seed, stop_ids=stop, max_tokens=max_tokens)
