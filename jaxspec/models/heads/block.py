"""Block drafters: DFlash (z-lab/dflash, SpecForge) and DSpark, one forward per draft block.

A Qwen3 decoder stack (q/k norms, SwiGLU) with no embedding or LM head of its
own: the block `[root, MASK, ..., MASK]` is embedded with the target's
embedding, every position attends to the whole block (bidirectional; a
sliding-window layer stays causal within its window) and to the CONTEXT, and
the target's LM head decodes the final-normed states.

The context is the target itself: the features of the committed tokens
(`feature_layers`, concatenated) go through `fc` and `hidden_norm` once, and
every draft layer's k/v projections of that one vector are that layer's K/V
for the position (k_norm and RoPE at the token's own position). So after a
verify the drafter only projects the accepted tokens' features into its cache
(`context_kv`): there is no draft-extend forward, which is what makes a block
cheap to keep up to date.

Which block output drafts which token:
  dflash  block width W = drafts + 1; output j (j >= 1, a MASK position) is the
          token AT position root + j (the root's own output is unused).
  dspark  block width W = gamma = drafts; output j is the token at root + j + 1
          (next-token, as a causal LM; every output is used). Then a Markov bias
          B(t_prev) = W2 . W1[t_prev] (rank `markov_rank`) is added position by
          position from the previously drafted token, and a confidence head gives
          sigmoid(w . [h_j, logit p_j] + b), the probability that draft j is right, from
          the block state and the log-odds of the probability the drafter gives its own
          draft. Initialised to c = p_j (weight 1 on the log-odds, 0 elsewhere) and
          trained from there: a linear probe of h alone learnt little more than the base
          rate in a CPU budget, and Adam's step size kept it from finding the odds' scale.

Params (Hugging Face layout, as loaded; `prepare_block_params` makes matrices [in, out]):
  fc [H, F], hidden_norm [H], norm [H], layers: list of {attn_norm, wq, wk, wv, wo, q_norm,
  k_norm, mlp_norm, w_gate, w_up, w_down (, bq, bk, bv)}; dspark: markov_w1 [V, r] (an
  embedding), markov_w2 [V, r] (a Linear r -> V), conf_w [1, H + 1], conf_b [1].
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxspec.models.heads.config import HeadConfig, runtime_matrix
from jaxspec.models.layers import apply_rope, linear, rms_norm, rope_inv_freq, rope_tables

LAYER_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")

# attend(layer, q [B, W, nh, hd], k [B, W, kvh, hd], v [B, W, kvh, hd]) -> [B, W, nh, hd]: the block's
# queries over the context (the caller's cache) and the block's own K/V.
BlockAttend = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]


def output_offset(hcfg: HeadConfig) -> int:
    """Draft d (1-based) is block output d - offset: 0 for dflash, 1 for dspark."""
    return 1 if hcfg.kind == "dspark" else 0


def block_width(hcfg: HeadConfig, num_drafts: int) -> int:
    return num_drafts + 1 - output_offset(hcfg)


def block_tokens(
    root: Int[Array, "B"],
    hcfg: HeadConfig,
    width: int,
) -> Int[Array, "B W"]:
    """[root, MASK, ..., MASK]: the draft input."""
    mask = jnp.full((root.shape[0], width - 1), hcfg.mask_token_id, jnp.int32)
    return jnp.concatenate([root[:, None].astype(jnp.int32), mask], axis=1)


def project_context(
    params: dict,
    hcfg: HeadConfig,
    feats: Float[Array, "B T F"],  # F = hcfg.feature_width, the target features of committed tokens
) -> Float[Array, "B T H"]:
    if feats.shape[-1] != hcfg.feature_width:
        raise ValueError(f"{hcfg.kind} features have width {feats.shape[-1]}, fc expects {hcfg.feature_width}")
    return rms_norm(linear(feats, params["fc"]), params["hidden_norm"], hcfg.layer.rms_norm_eps)


def _proj(p: dict, c, x, name: str, heads: int):
    y = linear(x, p["w" + name])
    if c.qkv_bias:
        y = y + p["b" + name].astype(y.dtype)
    y = y.reshape(*x.shape[:-1], heads, c.head_dim)
    if name in ("q", "k"):
        y = rms_norm(y, p[name + "_norm"], c.rms_norm_eps)
    return y


def _rope(x, positions, c):
    cos, sin = rope_tables(positions, rope_inv_freq(c))
    return apply_rope(x, cos, sin)


def context_kv(
    params: dict,
    hcfg: HeadConfig,
    ctx: Float[Array, "B T H"],  # project_context output
    positions: Int[Array, "B T"],
) -> tuple[Float[Array, "N B T KVH HD"], Float[Array, "N B T KVH HD"]]:
    """Every draft layer's K/V of the context positions: all a verify leaves to do."""
    c = hcfg.layer
    ks, vs = [], []
    for p in params["layers"]:
        ks.append(_rope(_proj(p, c, ctx, "k", c.num_kv_heads), positions, c))
        vs.append(_proj(p, c, ctx, "v", c.num_kv_heads))
    return jnp.stack(ks), jnp.stack(vs)


def block_hidden(
    params: dict,
    hcfg: HeadConfig,
    shared: dict,  # the target's runtime {"embed": [V, H], "head": [H, V]}
    tokens: Int[Array, "B W"],
    positions: Int[Array, "B W"],
    attend: BlockAttend,
    dtype=jnp.float32,
) -> Float[Array, "B W H"]:
    """The final-normed block states (LM-head input)."""
    c = hcfg.layer
    x = shared["embed"][tokens].astype(dtype)
    if hcfg.input_embedding_scale != 1.0:
        x = x * hcfg.input_embedding_scale
    b, w = tokens.shape
    for i, p in enumerate(params["layers"]):
        y = rms_norm(x, p["attn_norm"], c.rms_norm_eps)
        q = _rope(_proj(p, c, y, "q", c.num_heads), positions, c)
        k = _rope(_proj(p, c, y, "k", c.num_kv_heads), positions, c)
        v = _proj(p, c, y, "v", c.num_kv_heads)
        o = attend(i, q, k, v)
        x = x + linear(o.reshape(b, w, c.num_heads * c.head_dim), p["wo"])
        y = rms_norm(x, p["mlp_norm"], c.rms_norm_eps)
        x = x + linear(jax.nn.silu(linear(y, p["w_gate"])) * linear(y, p["w_up"]), p["w_down"])
    return rms_norm(x, params["norm"], c.rms_norm_eps)


def block_logits(
    shared: dict,
    hidden: Float[Array, "... H"],
) -> Float[Array, "... V"]:
    return linear(hidden, shared["head"]).astype(jnp.float32)


def markov_bias(
    params: dict,
    prev: Int[Array, "..."],  # the previously drafted (or, in training, the true) token
) -> Float[Array, "... V"]:
    """DSpark's B(t_prev) = W2 . W1[t_prev]: a rank-r lookup, not a forward."""
    return linear(params["markov_w1"][prev].astype(jnp.float32), params["markov_w2"]).astype(jnp.float32)


def draft_log_odds(
    logits: Float[Array, "... V"],  # the logits a draft is chosen from (Markov bias included)
) -> Float[Array, "..."]:
    """log(p / (1 - p)) of the argmax draft's probability p under the drafter's own
    (temperature 1) distribution, p clipped to [1e-6, 1 - 1e-6]."""
    p = jnp.clip(jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1), 1e-6, 1 - 1e-6)
    return jnp.log(p) - jnp.log1p(-p)


def confidence_logit(
    params: dict,
    hidden: Float[Array, "B W H"],
    odds: Float[Array, "B W"],  # draft_log_odds of each position's draft
) -> Float[Array, "B W"]:
    x = jnp.concatenate([hidden.astype(jnp.float32), odds[..., None].astype(jnp.float32)], axis=-1)
    return (linear(x, params["conf_w"])[..., 0] + params["conf_b"][0]).astype(jnp.float32)


_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


def block_attend(
    q: Float[Array, "B A W NH HD"],  # A blocks per context row (training: anchors; inference: 1)
    k_ctx: Float[Array, "B T KVH HD"],  # the context K/V of each row, shared by its blocks
    v_ctx: Float[Array, "B T KVH HD"],
    k_blk: Float[Array, "B A W KVH HD"],  # each block's own K/V
    v_blk: Float[Array, "B A W KVH HD"],
    ctx_vis: jax.Array,  # [B, A, W, T] bool: context keys each query sees
    blk_vis: jax.Array | None,  # [B, A, W, W] bool, None = bidirectional
) -> Float[Array, "B A W NH HD"]:
    """A block's queries over its context and itself, one softmax over both (GQA groups in one
    einsum): the drafter's forward (over its gathered cache) and training (over the sequence)."""
    b, a, w, nh, hd = q.shape
    kvh = k_ctx.shape[2]
    qg = q.reshape(b, a, w, kvh, nh // kvh, hd)
    scale = hd ** -0.5
    sc = jnp.einsum("bawkgd,btkd->bkgawt", qg, k_ctx, preferred_element_type=jnp.float32) * scale
    sc = jnp.where(ctx_vis[:, None, None], sc, _MASK)
    sb = jnp.einsum("bawkgd,bavkd->bkgawv", qg, k_blk, preferred_element_type=jnp.float32) * scale
    if blk_vis is not None:
        sb = jnp.where(blk_vis[:, None, None], sb, _MASK)
    p = jax.nn.softmax(jnp.concatenate([sc, sb], axis=-1), axis=-1)
    t = k_ctx.shape[1]
    o = jnp.einsum("bkgawt,btkd->bawkgd", p[..., :t].astype(v_ctx.dtype), v_ctx, preferred_element_type=jnp.float32)
    o = o + jnp.einsum("bkgawv,bavkd->bawkgd", p[..., t:].astype(v_blk.dtype), v_blk,
                       preferred_element_type=jnp.float32)
    return o.reshape(b, a, w, nh, hd).astype(q.dtype)


def window_mask(
    hcfg: HeadConfig,
    layer: int,
    q_pos: Int[Array, "B W"],
    k_pos: Int[Array, "B S"],
) -> jax.Array | None:
    """[B, W, S] visibility a sliding-window layer adds (None for a full layer): causal and
    q - k < window, over context and block keys alike (z-lab's `_attention_mask`)."""
    if not (hcfg.sliding_layers and hcfg.sliding_layers[layer]):
        return None
    d = q_pos[:, :, None] - k_pos[:, None, :]
    return (d >= 0) & (d < hcfg.sliding_window)


def prepare_block_params(params: dict, hcfg: HeadConfig, *, native: bool = False) -> dict:
    """Loaded (HF [out, in]) params -> runtime [in, out] matrices (PackedWeight when native)."""
    out: dict = {}
    for key, val in params.items():
        if key == "layers":
            out["layers"] = [{k: runtime_matrix(x, native) if k in LAYER_MATRICES else jnp.asarray(x)
                              for k, x in layer.items()} for layer in val]
        elif key in ("fc", "markov_w2", "conf_w"):
            out[key] = runtime_matrix(val, native and key == "fc")
        else:
            out[key] = jnp.asarray(val)
    return out
