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

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxspec.models.config import ConfigError
from jaxspec.models.heads.config import HeadConfig, check_equal, runtime_matrix
from jaxspec.models.heads.family import HeadFamily, archs, register_family
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


# ---- the family: read and parsed (not trained here: no exporter, no loss) ---------------------------


def detect(cfg: dict) -> str | None:
    return "mlp_speculator" if (cfg.get("model_type") == "mlp_speculator" or "mlpspeculator" in archs(cfg)) else None


def parse(kind: str, cfg: dict, t, convention: str) -> HeadConfig:
    emb = int(cfg.get("emb_dim") or 0)
    inner = int(cfg.get("inner_dim") or 0) or emb
    n = int(cfg.get("n_predict") or 0)
    if emb <= 0 or n <= 0:
        raise ConfigError(f"mlp_speculator config.json needs emb_dim and n_predict, got {emb} and {n}")
    check_equal("emb_dim (hidden size)", emb, t.hidden_size)
    check_equal("vocab_size", int(cfg.get("vocab_size", t.vocab_size)), t.vocab_size)
    return HeadConfig(kind=kind, layer=dataclasses.replace(t, num_layers=1), target_hidden_size=t.hidden_size,
                      draft_vocab_size=t.vocab_size, num_heads=n, emb_dim=emb, inner_dim=inner,
                      tie_weights=bool(cfg.get("tie_weights", False)),
                      scale_input=bool(cfg.get("scale_input", False)), own_head=True, own_embed=True)


def fresh(kind: str, target, *, num_heads: int = 4, **_) -> HeadConfig:
    layer = dataclasses.replace(target, num_layers=1, qk_norm=False, qkv_bias=False)
    return HeadConfig(kind=kind, layer=layer, target_hidden_size=target.hidden_size,
                      draft_vocab_size=target.vocab_size, num_heads=num_heads, emb_dim=target.hidden_size,
                      inner_dim=target.hidden_size, own_head=True, own_embed=True, scale_input=True)


def init(hcfg: HeadConfig, seed: int, token_ids=None) -> dict:
    rng = np.random.default_rng(seed)
    v, n, d = hcfg.layer.vocab_size, hcfg.num_heads, hcfg.inner_dim
    mat = lambda out, inp, gain=1.0: (rng.standard_normal((out, inp)) * gain / np.sqrt(inp)).astype(np.float32)  # noqa: E731
    return {"emb": [mat(v, d, np.sqrt(d)) for _ in range(n)],
            "proj": [mat(d, hcfg.emb_dim if s == 0 else d) for s in range(n)],
            "head": [mat(v, d, 4.0) for _ in range(n)], "ln_w": [np.ones((d,), np.float32) for _ in range(n)],
            "ln_b": [np.zeros(d, np.float32) for _ in range(n)]}


FAMILY = register_family(HeadFamily(
    "mlp_speculator", ("mlp_speculator",), detect, parse,
    read=lambda t, cfg, hcfg, target: (hcfg, read_mlp_speculator(t, hcfg)), tensor_prefix="speculator.",
    fresh=fresh, init=init))
