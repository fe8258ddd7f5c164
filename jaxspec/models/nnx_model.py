"""Flax NNX module view of a Llama-family model, for notebooks and training code.

The weights live as `nnx.Param` variables in the loader's layout (stacked
`[L, ...]` layers, Hugging Face `[out, in]` matrices). The jitted engine never
sees the module: `nnx.split` gives a state whose pure dict is exactly the params
pytree that `prepare_params` and `forward` take, so the module and the pure
functions stay one model, not two.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache.paged import KVCache
from jaxspec.models.config import ModelConfig
from jaxspec.models.llama import ForwardOutput, forward, prepare_params


class LlamaForCausalLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, params: dict):
        self.cfg = cfg
        self.embed = nnx.Param(params["embed"])
        self.final_norm = nnx.Param(params["final_norm"])
        if "lm_head" in params:
            self.lm_head = nnx.Param(params["lm_head"])
        self.layers = nnx.Dict({k: nnx.Param(v) for k, v in params["layers"].items()})

    @classmethod
    def from_loaded(cls, loaded) -> "LlamaForCausalLM":
        """From `jaxspec.models.loading.load_model(...)`."""
        return cls(loaded.config, loaded.params)

    def params(self) -> dict:
        """The params pytree (loader layout) that the pure functions take."""
        _, state = nnx.split(self)
        return nnx.to_pure_dict(state)

    def __call__(
        self,
        tokens: jax.Array,  # [B, T] int32
        cache: KVCache | None = None,
        page_table: jax.Array | None = None,  # [B, max_pages] int32
        q_start: jax.Array | None = None,  # [B] int32
    ) -> ForwardOutput:
        """Causal forward of a block of tokens, by default from an empty cache."""
        b, t = tokens.shape
        cfg = self.cfg
        if cache is None:
            # A private cache just large enough: page size 1, one page per token (+ null page).
            cache = KVCache.zeros(cfg.num_layers, 1 + b * t, 1, cfg.num_kv_heads, cfg.head_dim,
                                  self.embed[...].dtype)
            page_table = 1 + jnp.arange(b * t, dtype=jnp.int32).reshape(b, t)
        q_start = jnp.zeros((b,), jnp.int32) if q_start is None else q_start
        positions = q_start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        params = prepare_params(self.params(), cfg, unstack=False)
        return forward(params, cfg, tokens, positions, cache, page_table, q_start=q_start, kv_len=q_start + t)
