"""Fresh draft heads for a target: the HeadConfig a published checkpoint of that
kind would parse to, and random weights in the loaders' (Hugging Face) layout.

Used where no trained head exists yet: the speed benchmarks (a head's cost does
not depend on its weights) and the start of drafter training. Scales keep
activations O(1) so timings see realistic numerics (no denormals, no NaN).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxspec.models.config import ModelConfig
from jaxspec.models.heads.config import HeadConfig


def head_config(kind: str, target: ModelConfig, *, draft_vocab_size: int = 0, num_heads: int = 4,
                feature_layers: tuple[int, ...] | None = None) -> HeadConfig:
    """The HeadConfig of a `kind` head (eagle, eagle3, medusa, mlp_speculator) shaped for `target`."""
    layer = dataclasses.replace(target, num_layers=1, qk_norm=False, qkv_bias=False)
    base = dict(layer=layer, target_hidden_size=target.hidden_size, draft_vocab_size=target.vocab_size)
    if kind == "eagle":
        return HeadConfig(kind=kind, **base)
    if kind == "eagle3":
        L = target.num_layers
        return HeadConfig(kind=kind, **{**base, "draft_vocab_size": draft_vocab_size or target.vocab_size},
                          feature_layers=feature_layers or (2, L // 2, L - 3), own_head=True)
    if kind == "medusa":
        return HeadConfig(kind=kind, **base, num_heads=num_heads, own_head=True)
    if kind == "mlp_speculator":
        return HeadConfig(kind=kind, **base, num_heads=num_heads, emb_dim=target.hidden_size,
                          inner_dim=target.hidden_size, own_head=True, own_embed=True, scale_input=True)
    raise ValueError(f"no fresh head of kind {kind!r}; kinds: eagle, eagle3, medusa, mlp_speculator")


def init_head_params(hcfg: HeadConfig, seed: int = 0, *, token_ids=None, dtype=jnp.float32) -> dict:
    """Random params (HF layout, as `load_draft_head` returns them). `token_ids`: the
    target ids of an EAGLE-3 draft vocabulary, sorted (default: the first ones)."""
    rng = np.random.default_rng(seed)
    c = hcfg.layer
    h, i, q, kv, v = c.hidden_size, c.intermediate_size, c.q_size, c.kv_size, c.vocab_size

    def mat(out, inp, gain=1.0):
        return (rng.standard_normal((out, inp)) * gain / np.sqrt(inp)).astype(np.float32)

    def ones(n):
        return np.ones((n,), np.float32)

    def layer(w_in):
        return {"wq": mat(q, w_in), "wk": mat(kv, w_in), "wv": mat(kv, w_in), "wo": mat(h, q),
                "mlp_norm": ones(h), "w_gate": mat(i, h), "w_up": mat(i, h), "w_down": mat(h, i)}

    if hcfg.kind == "eagle":
        p = {"fc": mat(h, 2 * h), **layer(h)}
    elif hcfg.kind == "eagle3":
        dv = hcfg.draft_vocab_size
        ids = np.arange(dv) if token_ids is None else np.asarray(token_ids)
        p = {"fc": mat(h, hcfg.feature_width), "enorm": ones(h), "hnorm": ones(h), "norm": ones(h),
             "lm_head": mat(dv, h, 4.0), **layer(2 * h), "d2t": (ids - np.arange(dv)).astype(np.int32)}
    elif hcfg.kind == "medusa":
        n = hcfg.num_heads
        p = {"res_w": [[mat(h, h, 0.1)] for _ in range(n)], "res_b": [[np.zeros(h, np.float32)] for _ in range(n)],
             "lm_head": [mat(v, h, 4.0) for _ in range(n)]}
    elif hcfg.kind == "mlp_speculator":
        n, d = hcfg.num_heads, hcfg.inner_dim
        p = {"emb": [mat(v, d, np.sqrt(d)) for _ in range(n)],
             "proj": [mat(d, hcfg.emb_dim if s == 0 else d) for s in range(n)],
             "head": [mat(v, d, 4.0) for _ in range(n)], "ln_w": [ones(d) for _ in range(n)],
             "ln_b": [np.zeros(d, np.float32) for _ in range(n)]}
    else:
        raise ValueError(f"no fresh head of kind {hcfg.kind!r}")

    def cast(x):
        if isinstance(x, list):
            return [cast(y) for y in x]
        return jnp.asarray(x) if x.dtype.kind == "i" else jnp.asarray(x, dtype)

    return {k: cast(x) for k, x in p.items()}
