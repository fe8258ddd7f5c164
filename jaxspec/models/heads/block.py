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

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxspec.models.config import ConfigError, LoadError, ModelConfig
from jaxspec.models.heads.config import HeadConfig, check_equal, eagle3_layers, feature_layers_from, runtime_matrix
from jaxspec.models.heads.family import HeadFamily, LAYER_TENSORS, archs, llama_fields, register_family, to_np
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


# ---- the family: the DFlash format both ways, fresh drafters, the recipe's init ---------------------

KINDS = ("dflash", "dspark")


def detect(cfg: dict) -> str | None:
    joined = archs(cfg)
    if "dspark" in joined or "dspark_config" in cfg:
        return "dspark"
    if "dflash" in joined or "dflash_config" in cfg:
        return "dflash"
    return None


def parse(kind: str, cfg: dict, t: ModelConfig, convention: str = "output") -> HeadConfig:
    """DFlash (z-lab/dflash, SpecForge) and DSpark configs: a Qwen3 decoder stack over a block.

    The checkpoint names target layers as `target_layer_ids`, the OUTPUT of layer i
    (z-lab reads hidden_states[i + 1]); vLLM adds one on load, which is the "input"
    convention here. Both become "entering layer k" ids.
    """
    sub = dict(cfg.get(f"{kind}_config") or {})
    get = lambda name, default=None: sub.get(name, cfg.get(name, default))  # noqa: E731
    fixed = {**cfg, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    fixed.setdefault("vocab_size", t.vocab_size)
    layer = ModelConfig.from_hf_dict(fixed)
    layer = dataclasses.replace(layer, qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True)
    # The drafter embeds with the target's embedding and decodes with its LM head.
    check_equal("hidden_size", layer.hidden_size, t.hidden_size)
    check_equal("vocab_size", layer.vocab_size, t.vocab_size)
    ids = get("target_layer_ids")
    if not ids:
        raise ConfigError(f"{kind} config.json has no {kind}_config.target_layer_ids")
    n_target = int(cfg.get("num_target_layers") or t.num_layers)
    check_equal("num_target_layers", n_target, t.num_layers)
    feats = feature_layers_from(ids, t.num_layers, convention, field=f"{kind}_config.target_layer_ids")
    mask = get("mask_token_id")
    if mask is None or not 0 <= int(mask) < t.vocab_size:
        raise ConfigError(f"{kind} config.json: mask_token_id {mask!r} is not a token id in [0, {t.vocab_size})")
    block = int(get("block_size", 16 if kind == "dflash" else 7))
    if block < 2 - (kind == "dspark"):
        raise ConfigError(f"{kind} block_size {block} is too small")
    types = cfg.get("layer_types") or ["full_attention"] * layer.num_layers
    if len(types) != layer.num_layers:
        raise ConfigError(f"{kind} config.json: {len(types)} layer_types for {layer.num_layers} layers")
    sliding = tuple(ty == "sliding_attention" for ty in types)
    window = int(cfg.get("sliding_window") or 0) if any(sliding) else 0
    if any(sliding) and window <= 0:
        raise ConfigError(f"{kind} config.json has sliding_attention layers but no sliding_window")
    rank = int(get("markov_rank", 0)) if kind == "dspark" else 0
    if kind == "dspark":
        mtype = get("markov_type", "vanilla")
        if mtype != "vanilla":
            raise ConfigError(f"dspark markov_type {mtype!r} is not supported (only 'vanilla')")
        if rank <= 0:
            raise ConfigError("dspark config.json needs dspark_config.markov_rank > 0")
    return HeadConfig(kind=kind, layer=layer, target_hidden_size=t.hidden_size, draft_vocab_size=t.vocab_size,
                      feature_layers=feats, block_size=block, mask_token_id=int(mask), sliding_layers=sliding,
                      sliding_window=window, input_embedding_scale=float(get("input_embedding_scale", 1.0)),
                      markov_rank=rank, confidence=kind == "dspark" and bool(get("confidence", True)))


_LAYER_NAMES = {"attn_norm": "input_layernorm.weight", **LAYER_TENSORS}


def read(t, cfg: dict, hcfg: HeadConfig, target) -> tuple[HeadConfig, dict]:
    """DFlash tensors (z-lab/dflash `DFlashDraftModel`); DSpark adds its Markov and confidence heads."""
    from jaxspec.models.heads.loading import read_layer

    c, h = hcfg.layer, hcfg.layer.hidden_size
    layers = []
    for i in range(c.num_layers):
        pre = f"layers.{i}."
        layer = read_layer(t, pre, c, h)
        layer["attn_norm"] = t.get(pre + "input_layernorm.weight", (h,))
        layers.append(layer)
    extra = sorted(n for n in t.names if n.startswith("layers.") and int(n.split(".")[1]) >= c.num_layers)
    if extra:
        raise LoadError(f"{hcfg.kind} checkpoint {t.where} has {extra[0]!r} past num_hidden_layers={c.num_layers}")
    params = {"layers": layers, "fc": t.get("fc.weight", (h, hcfg.feature_width)),
              "hidden_norm": t.get("hidden_norm.weight", (h,)), "norm": t.get("norm.weight", (h,))}
    if hcfg.kind == "dspark":
        v, r = c.vocab_size, hcfg.markov_rank
        params.update(markov_w1=t.get("markov_head.w1.weight", (v, r)), markov_w2=t.get("markov_head.w2.weight", (v, r)))
        if hcfg.confidence:
            params.update(conf_w=t.get("confidence_head.weight", (1, h + 1)), conf_b=t.get("confidence_head.bias", (1,)))
    return hcfg, params


def mask_token_for(target_cfg: ModelConfig) -> int:
    """A MASK id for a target without one: 3, past SmolLM2's <|endoftext|>, <|im_start|>, <|im_end|>
    (a special token chat never emits); any id works, the drafter learns what its embedding means."""
    return min(3, target_cfg.vocab_size - 1)


def fresh(kind: str, target: ModelConfig, *, num_layers: int = 1, block_size: int = 0, mask_token_id: int = -1,
          feature_layers=None, markov_rank: int = 0, **_) -> HeadConfig:
    """The HeadConfig a fresh DFLASH / DSPARK drafter for `target` parses to (target geometry, Qwen3 norms);
    block_size 0 = 16 (dflash) or 7 (dspark), mask_token_id -1 = `mask_token_for(target)`."""
    # What `parse` reads back from the export: a Qwen3 layer stack, untied.
    layer = dataclasses.replace(target, model_type="qwen3", num_layers=num_layers, qk_norm=True, qkv_bias=False,
                                tie_word_embeddings=False)
    return HeadConfig(kind=kind, layer=layer, target_hidden_size=target.hidden_size,
                      draft_vocab_size=target.vocab_size,
                      feature_layers=tuple(feature_layers or eagle3_layers(target.num_layers)),
                      sliding_layers=(False,) * num_layers,
                      block_size=block_size or (16 if kind == "dflash" else 7),
                      mask_token_id=mask_token_id if mask_token_id >= 0 else mask_token_for(target),
                      markov_rank=markov_rank if kind == "dspark" else 0, confidence=kind == "dspark")


def init(hcfg: HeadConfig, seed: int = 0, token_ids=None) -> dict:
    """Random HF-layout weights: projections at 1/sqrt(fan-in), norms at one, the Markov head's
    output at zero (it starts as no bias), the confidence head at c = the draft's own probability."""
    rng = np.random.default_rng([seed, 7])
    c = hcfg.layer
    h, i, q, kv = c.hidden_size, c.intermediate_size, c.q_size, c.kv_size

    def mat(out, inp):
        return jnp.asarray((rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32))

    def ones(n):
        return jnp.ones((n,), jnp.float32)

    layers = [{"attn_norm": ones(h), "wq": mat(q, h), "wk": mat(kv, h), "wv": mat(kv, h), "wo": mat(h, q),
               "q_norm": ones(c.head_dim), "k_norm": ones(c.head_dim), "mlp_norm": ones(h),
               "w_gate": mat(i, h), "w_up": mat(i, h), "w_down": mat(h, i)} for _ in range(c.num_layers)]
    p = {"layers": layers, "fc": mat(h, hcfg.feature_width), "hidden_norm": ones(h), "norm": ones(h)}
    if hcfg.kind == "dspark":
        r = hcfg.markov_rank
        p["markov_w1"] = jnp.asarray(rng.standard_normal((c.vocab_size, r)).astype(np.float32))
        p["markov_w2"] = jnp.zeros((c.vocab_size, r), jnp.float32)
        p["conf_w"] = jnp.zeros((1, h + 1), jnp.float32).at[0, h].set(1.0)  # c = the draft's own p
        p["conf_b"] = jnp.zeros((1,), jnp.float32)
    return p


def write(params: dict, hcfg: HeadConfig, *, num_target_layers: int | None = None, **_) -> tuple[dict, dict, str]:
    """The DFlash format (z-lab/dflash, SpecForge): Qwen3 config with `block_size` and
    `dflash_config {mask_token_id, target_layer_ids}` (the OUTPUT convention, z-lab's
    hidden_states[i + 1]); DSpark adds `dspark_config {markov_rank, ...}` and its heads."""
    c = hcfg.layer
    if any(k < 1 for k in hcfg.feature_layers):
        raise ValueError(f"feature layers {hcfg.feature_layers} include the embedding (0), which the output "
                         "convention cannot write")
    t = {"fc.weight": to_np(params["fc"]), "hidden_norm.weight": to_np(params["hidden_norm"]),
         "norm.weight": to_np(params["norm"])}
    for i, layer in enumerate(params["layers"]):
        t.update({f"layers.{i}.{_LAYER_NAMES[k]}": to_np(v) for k, v in layer.items()})
    sub = {"mask_token_id": hcfg.mask_token_id, "target_layer_ids": [k - 1 for k in hcfg.feature_layers],
           "block_size": hcfg.block_size}
    cfg = {**llama_fields(c), "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
           "num_hidden_layers": c.num_layers, "block_size": hcfg.block_size, "dflash_config": sub}
    if num_target_layers is not None:
        cfg["num_target_layers"] = num_target_layers
    if hcfg.kind == "dspark":
        cfg["architectures"] = ["DSparkDraftModel"]
        cfg["dspark_config"] = {**cfg.pop("dflash_config"), "markov_rank": hcfg.markov_rank,
                                "markov_type": "vanilla", "confidence": bool(hcfg.confidence)}
        t["markov_head.w1.weight"] = to_np(params["markov_w1"])
        t["markov_head.w2.weight"] = to_np(params["markov_w2"])
        if hcfg.confidence:
            t["confidence_head.weight"] = to_np(params["conf_w"])
            t["confidence_head.bias"] = to_np(params["conf_b"])
    return cfg, t, "model.safetensors"


FAMILY = register_family(HeadFamily(
    "block", KINDS, detect, parse, read=read, fresh=fresh, init=init, write=write,
    loss="jaxspec.train.block:block_loss", train_features=("aux",)))
