"""One-decoder-layer draft heads: EAGLE-1, EAGLE-3, DeepSeek MTP, MiMo MTP.

All four run `x_in -> attention -> MLP` once per draft step over [B, T] pairs
(h_t, token_{t+1}); they differ in how x_in is made and what follows the layer:

  eagle        x = fc(cat(embed(tok), h))  (+ fc bias); the layer has NO input_layernorm
               (cnets1.py LlamaDecoderLayer, index 0); logits = target_head(out), no norm
               in between (cnets1.py Model.forward returns the layer output, and
               topK_generate applies `head(last_hidden)` directly).
  eagle3       attention input cat(input_layernorm(embed(tok)), hidden_norm(h)), 2H wide;
               residual = h (un-normed); logits = lm_head(norm(out)) over the draft vocabulary.
  mtp_deepseek x = eh_proj(cat(enorm(embed(tok)), hnorm(h))), then an ordinary decoder layer
               (its own input_layernorm); logits = head(shared_head.norm(out)).
  mtp_mimo     x = input_proj(cat(hidden_layernorm(h), token_layernorm(embed(tok)))) -- hidden
               first --, ordinary layer, logits = target_head(final_layernorm(out)).

The fed-back h (HeadOut.h) is always the layer output before any final norm.
Attention itself is the caller's (`attend`): it owns the draft KV cache and masks, and the
softmax scale head_dim ** -0.5.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxspec.models.heads.config import HeadConfig, runtime_matrix
from jaxspec.models.layers import apply_rope, linear, rms_norm, rope_inv_freq, rope_tables

ATTN_KINDS = ("eagle", "eagle3", "mtp_deepseek", "mtp_mimo")
# Params that are matrices in HF [out, in] layout; prepare_head_params makes them [in, out].
MATRICES = ("fc", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

# Loaded params (HF layout), keys used by all four kinds (absent = not part of that kind):
#   fc        [H, F]   eagle F=2H (emb first), eagle3 F=3*H_t, mtp F=2H (eh_proj / input_proj)
#   fc_bias   [H]      eagle with `bias`
#   enorm     [H]      eagle3 input_layernorm (on emb); mtp enorm / token_layernorm
#   hnorm     [H]      eagle3 hidden_norm; mtp hnorm / hidden_layernorm
#   attn_norm [H]      mtp block input_layernorm
#   wq [nh*hd, Win], wk/wv [kvh*hd, Win], wo [H, nh*hd]   Win = 2H for eagle3, else H
#   bq/bk/bv, q_norm/k_norm  when the layer config has qkv_bias / qk_norm
#   mlp_norm [H], w_gate/w_up [I, H], w_down [H, I]
#   norm      [H]      eagle3 norm; mtp shared_head.norm / final_layernorm
#   lm_head   [Vd, H]  own LM head (eagle3; mtp shared_head.head when present)
#   embed     [V, H]   own embedding (optional)
#   d2t       [Vd] int offsets (eagle3): target_id = draft_id + d2t[draft_id]


class HeadOut(NamedTuple):
    h: Float[Array, "B T H"] | None  # next step's h (layer output, pre-norm); None when kv_only
    logits: Float[Array, "B T Vd"] | None  # float32; None when kv_only
    k: Float[Array, "B T KVH HD"]  # RoPE applied
    v: Float[Array, "B T KVH HD"]


Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def project_features(
    params: dict,
    hcfg: HeadConfig,
    feats: Float[Array, "B T F"],  # F = hcfg.feature_width
) -> Float[Array, "B T H"]:
    if hcfg.kind != "eagle3":
        return feats
    if feats.shape[-1] != hcfg.feature_width:
        raise ValueError(f"EAGLE-3 features have width {feats.shape[-1]}, fc expects {hcfg.feature_width}")
    return linear(feats, params["fc"])


def _embed(params: dict, shared: dict, tokens: jax.Array, dtype) -> jax.Array:
    table = params["embed"] if "embed" in params else shared["embed"]
    return table[tokens].astype(dtype)


def _layer_input(params: dict, hcfg: HeadConfig, emb: jax.Array, h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(attention input [B, T, Win], residual [B, T, H]) for the head's one layer."""
    eps = hcfg.layer.rms_norm_eps
    kind = hcfg.kind
    if kind == "eagle":
        x = linear(jnp.concatenate([emb, h], axis=-1), params["fc"])
        if "fc_bias" in params:
            x = x + params["fc_bias"].astype(x.dtype)
        return x, x  # no input_layernorm on layer 0
    if kind == "eagle3":
        hn = rms_norm(h, params["hnorm"], eps)
        residual = hn if hcfg.norm_before_residual else h
        return jnp.concatenate([rms_norm(emb, params["enorm"], eps), hn], axis=-1), residual
    en, hn = rms_norm(emb, params["enorm"], eps), rms_norm(h, params["hnorm"], eps)
    cat = [en, hn] if kind == "mtp_deepseek" else [hn, en]  # MiMo: hidden state first
    x = linear(jnp.concatenate(cat, axis=-1), params["fc"])
    return rms_norm(x, params["attn_norm"], eps), x


def _qkv(params: dict, hcfg: HeadConfig, x: jax.Array, positions: jax.Array, q_too: bool):
    c = hcfg.layer
    b, t = x.shape[:2]
    inv = rope_inv_freq(c)
    cos, sin = rope_tables(positions, inv)

    def proj(name: str, heads: int) -> jax.Array:
        y = linear(x, params["w" + name])
        if c.qkv_bias:
            y = y + params["b" + name].astype(y.dtype)
        y = y.reshape(b, t, heads, c.head_dim)
        if c.qk_norm and name in ("q", "k"):
            y = rms_norm(y, params[name + "_norm"], c.rms_norm_eps)
        return y

    k = apply_rope(proj("k", c.num_kv_heads), cos, sin)
    v = proj("v", c.num_kv_heads)
    q = apply_rope(proj("q", c.num_heads), cos, sin) if q_too else None
    return q, k, v


def _logits(params: dict, hcfg: HeadConfig, shared: dict, out: jax.Array) -> jax.Array:
    if hcfg.kind == "eagle":
        y = out
    else:
        y = rms_norm(out, params["norm"], hcfg.layer.rms_norm_eps)
    head = params["head"] if "head" in params else shared["head"]
    return linear(y, head).astype(jnp.float32)


def attn_head_step(
    params: dict,  # runtime layout (prepare_head_params)
    hcfg: HeadConfig,
    shared: dict,  # the target's runtime {"embed": [V, H_t], "head": [H_t, V], "final_norm": [H_t]}
    tokens: Int[Array, "B T"],  # the token at the NEXT position (pairs (h_t, x_{t+1}))
    h: Float[Array, "B T H"],  # project_features output, or the previous step's HeadOut.h
    positions: Int[Array, "B T"],  # RoPE positions
    attend: Attend | None,  # (q [B,T,nh,hd], k, v [B,T,kvh,hd]) -> [B,T,nh,hd]
    *,
    kv_only: bool = False,
) -> HeadOut:
    if hcfg.kind not in ATTN_KINDS:
        raise ValueError(f"attn_head_step runs {ATTN_KINDS}, not {hcfg.kind!r}")
    c = hcfg.layer
    emb = _embed(params, shared, tokens, h.dtype)
    x, residual = _layer_input(params, hcfg, emb, h)
    q, k, v = _qkv(params, hcfg, x, positions, q_too=not kv_only)
    if kv_only:
        return HeadOut(None, None, k, v)
    o = attend(q, k, v)
    b, t = o.shape[:2]
    out = residual + linear(o.reshape(b, t, c.num_heads * c.head_dim), params["wo"])
    y = rms_norm(out, params["mlp_norm"], c.rms_norm_eps)
    out = out + linear(jax.nn.silu(linear(y, params["w_gate"])) * linear(y, params["w_up"]), params["w_down"])
    return HeadOut(out, _logits(params, hcfg, shared, out), k, v)


def draft_to_target(params: dict, hcfg: HeadConfig) -> jax.Array | None:  # [Vd] int32 absolute target ids
    if "d2t" not in params:  # EAGLE-3's and FROZEN_KV_MTP's reduced vocabularies
        return None
    d2t = jnp.asarray(params["d2t"]).astype(jnp.int32)
    return jnp.arange(d2t.shape[0], dtype=jnp.int32) + d2t


def prepare_head_params(params: dict, hcfg: HeadConfig, *, native: bool = False) -> dict:
    """Loaded (HF [out, in]) params -> runtime: [in, out] matrices, own LM head as `head` [H, Vd].

    With `native` every matrix and an own LM head become PackedWeight (float32 only).
    """
    if hcfg.kind == "medusa":
        from jaxspec.models.heads.medusa import prepare_medusa_params

        return prepare_medusa_params(params, hcfg, native=native)
    if hcfg.kind == "mlp_speculator":
        from jaxspec.models.heads.mlp_speculator import prepare_mlp_params

        return prepare_mlp_params(params, hcfg, native=native)
    if hcfg.kind == "frozen_kv":
        from jaxspec.models.heads.frozen_kv import prepare_frozen_kv_params

        return prepare_frozen_kv_params(params, hcfg, native=native)
    out = {}
    for key, val in params.items():
        if key == "lm_head":
            out["head"] = runtime_matrix(val, native)
        elif key in MATRICES:
            out[key] = runtime_matrix(val, native)
        else:
            out[key] = jnp.asarray(val)
    return out
