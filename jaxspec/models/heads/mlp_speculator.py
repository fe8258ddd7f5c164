"""IBM's MLP speculator (vLLM mlp_speculator.py; "Accelerating Production LLMs with Combined
Token/Embedding Speculators", arXiv 2404.19124).

Stage i turns (state, last token) into the next state and the logits of the token i + 1 places
after the target's next token:
  s_i = GELU(LN_i(proj_i(s_{i-1}) + (emb_weight / state_weight) * emb_i(tok)))
  logits_i = head_i(s_i)
with state_weight = 0.5 ** (0.5 / n_predict), emb_weight = sqrt((1 - state_weight**2) * inner_dim / 2).
LN is vLLM's MLPSpeculatorLayerNorm: x * rsqrt(mean(x**2) + 1e-6) (an RMS norm, no mean removed),
then * weight + bias. With scale_input the initial state is ln0(h) / sqrt(2), where ln0 is the
same norm without weight or bias (so ln0 has no tensors). GELU is the exact (erf) form.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxspec.models.heads.config import HeadConfig, runtime_matrix
from jaxspec.models.layers import linear

LN_EPS = 1e-6

# Loaded params (HF layout), one entry per stage: emb [V, inner], proj [inner, emb_dim or inner]
# (out, in), head [V, inner], ln_w / ln_b [inner]. tie_weights checkpoints may store only stage 0
# (and proj.1); the reader repeats them.


def _weights(hcfg: HeadConfig) -> tuple[float, float]:
    state_w = 0.5 ** (0.5 / hcfg.num_heads)
    emb_w = math.sqrt((1 - state_w**2) * (hcfg.inner_dim / 2))
    return state_w, emb_w


def _ln(x: jax.Array, w: jax.Array | None = None, b: jax.Array | None = None) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + LN_EPS)).astype(x.dtype)
    if w is not None:
        y = w.astype(y.dtype) * y + b.astype(y.dtype)
    return y


def read_mlp_speculator(t, hcfg: HeadConfig) -> dict:
    v, e, d, n = hcfg.layer.vocab_size, hcfg.emb_dim, hcfg.inner_dim, hcfg.num_heads

    def stage(name: str, i: int, shape: tuple[int, ...]):
        full = f"{name}.{i}.weight" if name != "ln_b" else f"ln.{i}.bias"
        if name == "ln_w":
            full = f"ln.{i}.weight"
        if full not in t and hcfg.tie_weights:
            # Tied stages share one module; exporters may keep only its first name.
            j = 1 if name == "proj" and i > 0 else 0
            full = full.replace(f".{i}.", f".{j}.")
        return t.get(full, shape)

    return {
        "emb": [stage("emb", i, (v, d)) for i in range(n)],
        "proj": [stage("proj", i, (d, e if i == 0 else d)) for i in range(n)],
        "head": [stage("head", i, (v, d)) for i in range(n)],
        "ln_w": [stage("ln_w", i, (d,)) for i in range(n)],
        "ln_b": [stage("ln_b", i, (d,)) for i in range(n)],
    }


def prepare_mlp_params(params: dict, hcfg: HeadConfig, *, native: bool = False) -> dict:
    return {
        "emb": [jnp.asarray(w) for w in params["emb"]],
        "proj": [runtime_matrix(w, native) for w in params["proj"]],
        "head": [runtime_matrix(w, native) for w in params["head"]],
        "ln_w": [jnp.asarray(w) for w in params["ln_w"]],
        "ln_b": [jnp.asarray(w) for w in params["ln_b"]],
    }


def mlp_speculator_init_state(
    params: dict,
    hcfg: HeadConfig,
    h: Float[Array, "B H"],  # the target's final-norm state
) -> Float[Array, "B H"]:
    return _ln(h) / math.sqrt(2.0) if hcfg.scale_input else h


def mlp_speculator_step(
    params: dict,  # runtime layout
    hcfg: HeadConfig,
    state: Float[Array, "B S"],  # S = emb_dim at stage 0, inner_dim after
    token: Int[Array, "B"],  # the last token (target's next token at stage 0, then stage i-1's)
    i: int,  # stage, static
) -> tuple[Float[Array, "B D"], Float[Array, "B V"]]:
    state_w, emb_w = _weights(hcfg)
    z = params["emb"][i][token].astype(state.dtype)
    s = linear(state, params["proj"][i]) + (emb_w / state_w) * z
    s = jax.nn.gelu(_ln(s, params["ln_w"][i], params["ln_b"][i]), approximate=False)
    return s, linear(s, params["head"][i]).astype(jnp.float32)
