"""FROZEN_KV_MTP heads: draft layers that attend to the target's own cached K/V, read-only.

The published form is Gemma 4's "assistant" draft (SGLang `gemma4_mtp.py`, vLLM `gemma4_mtp.py`,
Hugging Face `gemma4_assistant`); docs/frozen_kv_mtp.md has what was read where. One draft step:

    x  = pre_projection(cat(target_embed(token) * embed_scale, h_prev))          [B, T, d]
    per draft layer i (reading target layer target_kv_layers[i]):
        x = x + post_attention_layernorm(o_proj(attn(rope(q_norm(q_proj(input_layernorm(x)))),
                                                     target K_i, target V_i)))
        x = (x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))) * layer_scalar
    y  = norm(x);  logits = lm_head(y);  h_next = post_projection(y)              [B, T, H_target]

or, with Gemma 4's centroid head (`use_ordered_embeddings`, E2B/E4B), logits only for the tokens of
the `centroid_intermediate_top_k` best of `num_centroids` clusters (`centroid_logits`).

Queries carry no K/V of their own: a draft token never becomes a key anywhere, and earlier drafts
reach later ones only through h_prev. So every step of a round attends to the same committed
prefix, at one RoPE position (the last slot with target K/V), and the seed h_prev is the target's
final-norm state there.

Format (what `read` takes and `write` gives): config.json `architectures` Gemma4AssistantForCausalLM
/ Gemma4UnifiedAssistantForCausalLM (published) or FrozenKVMTPForCausalLM (jaxspec's, the same
layout on a Llama-family target), a `text_config` with the draft's geometry, `backbone_hidden_size`;
tensors `pre_projection.weight` [d, 2H], `post_projection.weight` [H, d], `model.norm.weight`,
`model.embed_tokens.weight` [V, d] (the tied LM head) or `lm_head.weight` [Vd, d] with `d2t` (a
reduced draft vocabulary, as EAGLE-3's), and per layer `model.layers.{i}.` input_layernorm,
self_attn.{q_proj, q_norm (optional), o_proj}, post_attention_layernorm, pre_feedforward_layernorm,
mlp.{gate,up,down}_proj, post_feedforward_layernorm (`.weight`) and `layer_scalar`.
Which target layers a Gemma 4 assistant reads follows Gemma 4's `layer_types` (the last sliding and
the last full layer), a rule a Llama target cannot express: jaxspec's config names them,
`target_layer_ids`, and refuses a draft without them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from jaxspec.models.config import ConfigError
from jaxspec.models.heads.config import HeadConfig, check_equal, runtime_matrix
from jaxspec.models.heads.family import HeadFamily, archs, register_family, to_np
from jaxspec.models.layers import apply_rope, linear, rms_norm, rope_inv_freq, rope_tables

PUBLISHED = ("gemma4assistantforcausallm", "gemma4unifiedassistantforcausallm")
ARCH = "FrozenKVMTPForCausalLM"
# HF-layout per-layer key -> tensor name under model.layers.{i}.
LAYER = {
    "attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight", "q_norm": "self_attn.q_norm.weight",
    "wo": "self_attn.o_proj.weight", "post_attn_norm": "post_attention_layernorm.weight",
    "pre_ff_norm": "pre_feedforward_layernorm.weight", "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
    "post_ff_norm": "post_feedforward_layernorm.weight", "layer_scalar": "layer_scalar",
}
MATRICES = ("wq", "wo", "w_gate", "w_up", "w_down")
_MASK = -0.7 * float(np.finfo(np.float32).max)
ACTS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu": lambda x: jax.nn.gelu(x, approximate=False)}


# ---- the math (draft time and training share it) ----------------------------------------------


def frozen_attend(
    q: Float[Array, "B T NH HD"],
    k: Float[Array, "B S KVH HD"],  # the target layer's keys (RoPE applied), gathered from its pages
    v: Float[Array, "B S KVH HD"],
    visible: Bool[Array, "B #T S"],  # which keys each query sees
    scale: float,
) -> Float[Array, "B T NH HD"]:
    b, t, nh, hd = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, nh // kvh, hd)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    s = jnp.where(visible[:, None, None], s, _MASK)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskd->btkgd", p.astype(q.dtype), v.astype(q.dtype), preferred_element_type=jnp.float32)
    return o.reshape(b, t, nh, hd).astype(q.dtype)


def query_scale(hcfg: HeadConfig) -> float:
    return hcfg.query_scale or hcfg.layer.head_dim ** -0.5


def frozen_kv_step(
    own: dict,  # runtime layout (prepare_frozen_kv_params)
    hcfg: HeadConfig,
    shared: dict,  # the target's runtime {"embed": [V, H]}
    tokens: Int[Array, "B T"],  # the token each query drafts after (the root, then its own drafts)
    h: Float[Array, "B T H"],  # h_prev: the target's final-norm state (seed) or the last step's output
    positions: Int[Array, "B T"],  # RoPE positions of the queries
    context: list,  # per draft layer (k [B, S, kvh, hd], v, visible [B, 1 or T, S])
) -> tuple[Float[Array, "B T H"], Float[Array, "B T Vd"]]:
    """One draft step over T queries: (next h_prev, logits over the draft vocabulary, float32)."""
    c = hcfg.layer
    eps, b, t = c.rms_norm_eps, tokens.shape[0], tokens.shape[1]
    act = ACTS[hcfg.hidden_act]
    emb = shared["embed"][tokens].astype(h.dtype)
    if hcfg.input_embedding_scale != 1.0:
        emb = emb * jnp.asarray(hcfg.input_embedding_scale, h.dtype)
    x = linear(jnp.concatenate([emb, h], axis=-1), own["pre"])
    cos, sin = rope_tables(positions, rope_inv_freq(c))
    for lp, (k, v, visible) in zip(own["layers"], context):
        q = linear(rms_norm(x, lp["attn_norm"], eps), lp["wq"]).reshape(b, t, c.num_heads, c.head_dim)
        if "q_norm" in lp:
            q = rms_norm(q, lp["q_norm"], eps)
        o = frozen_attend(apply_rope(q, cos, sin), k, v, visible, query_scale(hcfg))
        x = x + rms_norm(linear(o.reshape(b, t, c.num_heads * c.head_dim), lp["wo"]), lp["post_attn_norm"], eps)
        m = rms_norm(x, lp["pre_ff_norm"], eps)
        m = linear(act(linear(m, lp["w_gate"])) * linear(m, lp["w_up"]), lp["w_down"])
        x = (x + rms_norm(m, lp["post_ff_norm"], eps)) * lp["layer_scalar"].astype(x.dtype)
    y = rms_norm(x, own["norm"], eps)
    logits = centroid_logits(own, hcfg, y) if "centroids" in own else linear(y, own["head"]).astype(jnp.float32)
    return linear(y, own["post"]), logits


def centroid_logits(
    own: dict,  # "centroids" [d, C], "ordering" [C, V / C] int32, "head_rows" [V, d] (the tied table)
    hcfg: HeadConfig,
    y: Float[Array, "B T d"],  # the draft's final-norm state
) -> Float[Array, "B T V"]:
    """Gemma 4's masked embedder (HF `Gemma4AssistantMaskedEmbedder`; vLLM and SGLang agree): the
    tokens of the top-k clusters get y . embedding, the rest the smallest of those minus one (per
    row here; HF takes it over the whole batch, which would make a row depend on its neighbours).
    1. Score the clusters and keep the best k.
    2. Their tokens: k * V / C canonical ids, through the checkpoint's token ordering.
    3. Score those rows of the tied table; scatter into a masked [V] row."""
    b, t, _ = y.shape
    scores = linear(y, own["centroids"]).astype(jnp.float32)  # [B, T, C]
    _, top = jax.lax.top_k(scores, hcfg.centroid_top_k)  # [B, T, k]
    sel = own["ordering"][top].reshape(b, t, -1)  # [B, T, k * V / C]
    s = jnp.einsum("btsd,btd->bts", own["head_rows"][sel].astype(jnp.float32), y.astype(jnp.float32))
    mask = jnp.min(s, axis=-1, keepdims=True) - 1.0
    full = jnp.broadcast_to(mask, (b, t, hcfg.layer.vocab_size))
    bi, ti = jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None]
    return full.at[bi, ti, sel].set(s)


def window_mask(visible: jax.Array, n: jax.Array, hcfg: HeadConfig, layer: int) -> jax.Array:
    """A sliding draft layer sees only the window's newest keys (n [B, ...]: keys before slot n)."""
    if not (hcfg.sliding_layers and hcfg.sliding_layers[layer]):
        return visible
    s = jnp.arange(visible.shape[-1], dtype=jnp.int32)
    return visible & (s >= n[..., None] - hcfg.sliding_window)


def prepare_frozen_kv_params(params: dict, hcfg: HeadConfig, *, native: bool = False) -> dict:
    """Loaded (HF [out, in]) -> runtime ([in, out] matrices; the LM head as `head` [d, Vd])."""
    out = {"pre": runtime_matrix(params["pre"], native), "post": runtime_matrix(params["post"], native),
           "norm": jnp.asarray(params["norm"]),
           "layers": [{k: (runtime_matrix(v, native) if k in MATRICES else jnp.asarray(v)) for k, v in lp.items()}
                      for lp in params["layers"]]}
    if "d2t" in params:
        out["d2t"] = jnp.asarray(params["d2t"])
    if "centroids" in params:  # rows of the tied table are gathered by token id: kept [V, d], unpacked
        c = hcfg.num_centroids
        out.update(centroids=runtime_matrix(params["centroids"], native), head_rows=jnp.asarray(params["lm_head"]),
                   ordering=jnp.asarray(np.asarray(params["token_ordering"]).reshape(c, -1), jnp.int32))
    else:
        out["head"] = runtime_matrix(params["lm_head"], native)
    return out


# ---- the family: format both ways, fresh heads ------------------------------------------------


def detect(cfg: dict) -> str | None:
    names = archs(cfg).split()
    if any(a in names for a in PUBLISHED + (ARCH.lower(),)) or cfg.get("model_type") in ("gemma4_assistant",
                                                                                         "frozen_kv_mtp"):
        return "frozen_kv"
    return None


def is_published(cfg: dict) -> bool:
    return any(a in archs(cfg).split() for a in PUBLISHED) or cfg.get("model_type") == "gemma4_assistant"


def parse(kind: str, cfg: dict, t, convention: str) -> HeadConfig:
    del convention  # target_layer_ids are layer indices, not captured states
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError("FROZEN_KV_MTP draft config.json has no text_config (the draft layers' geometry)")
    published = is_published(cfg)
    centroids = top_k = 0
    if cfg.get("use_ordered_embeddings"):  # HF's defaults: 2048 clusters, the best 32 kept
        centroids, top_k = int(cfg.get("num_centroids", 2048)), int(cfg.get("centroid_intermediate_top_k", 32))
        if centroids < 1 or t.vocab_size % centroids:
            raise ConfigError(f"use_ordered_embeddings: num_centroids {centroids} must divide the vocabulary "
                              f"({t.vocab_size} tokens)")
        if not 0 < top_k <= centroids:
            raise ConfigError(f"use_ordered_embeddings: centroid_intermediate_top_k {top_k} must be in "
                              f"[1, num_centroids {centroids}]")
        if cfg.get("draft_vocab_size") not in (None, t.vocab_size):
            raise ConfigError("use_ordered_embeddings with a reduced draft_vocab_size: the centroid head scores the "
                              "full vocabulary")
    bb = int(cfg.get("backbone_hidden_size") or t.hidden_size)
    check_equal("backbone_hidden_size", bb, t.hidden_size)
    n = int(text.get("num_hidden_layers", 0))
    ids = cfg.get("target_layer_ids")
    if ids is None:
        raise ConfigError(
            "FROZEN_KV_MTP draft config.json names no target_layer_ids: a Gemma 4 assistant reads the last sliding "
            "and the last full-attention layer of a Gemma 4 target (by its layer_types), a rule a Llama-family "
            f"target cannot express; add \"target_layer_ids\": one target layer per draft layer ({n})")
    ids = tuple(int(i) for i in ids)
    if len(ids) != n or n < 1:
        raise ConfigError(f"target_layer_ids {list(ids)} must name one target layer per draft layer "
                          f"(text_config.num_hidden_layers = {n})")
    bad = [i for i in ids if not 0 <= i < t.num_layers]
    if bad:
        raise ConfigError(f"target_layer_ids {list(ids)} has {bad} outside [0, {t.num_layers}) for a target with "
                          f"{t.num_layers} layers")
    check_equal("num_key_value_heads", int(text.get("num_key_value_heads", -1)), t.num_kv_heads)
    hd = int(text.get("head_dim") or 0)
    check_equal("head_dim", hd, t.head_dim)
    check_equal("vocab_size", int(text.get("vocab_size", -1)), t.vocab_size)
    nh = int(text.get("num_attention_heads", 0))
    if nh < 1 or nh % t.num_kv_heads:
        raise ConfigError(f"text_config.num_attention_heads {nh} is not a multiple of the target's "
                          f"{t.num_kv_heads} kv heads")
    act = str(text.get("hidden_activation") or text.get("hidden_act") or ("gelu_pytorch_tanh" if published else "silu"))
    if act not in ACTS:
        raise ConfigError(f"text_config hidden activation {act!r} is not supported; supported: {', '.join(ACTS)}")
    types = list(text.get("layer_types") or ["full_attention"] * n)
    if len(types) != n or any(x not in ("full_attention", "sliding_attention") for x in types):
        raise ConfigError(f"text_config.layer_types {types} must give full_attention or sliding_attention "
                          f"for each of the {n} draft layers")
    window = int(text.get("sliding_window") or 0)
    if "sliding_attention" in types and window < 1:
        raise ConfigError("text_config has sliding_attention layers but no sliding_window")
    # The queries rotate as the target's keys were rotated: the target's RoPE, its kv geometry.
    layer = dataclasses.replace(t, hidden_size=int(text["hidden_size"]), intermediate_size=int(text["intermediate_size"]),
                                num_layers=n, num_heads=nh, rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                                qkv_bias=False, qk_norm=False)
    dv = int(cfg.get("draft_vocab_size") or t.vocab_size)
    if not 0 < dv <= t.vocab_size:
        raise ConfigError(f"draft_vocab_size {dv} is not in [1, target vocab_size {t.vocab_size}]")
    scale = float(cfg.get("query_scale") or (1.0 if published else 0.0))
    embed_scale = float(cfg.get("embed_scale") or (math.sqrt(bb) if published else 1.0))
    return HeadConfig(kind=kind, layer=layer, target_hidden_size=bb, draft_vocab_size=dv, own_head=True,
                      sliding_layers=tuple(x == "sliding_attention" for x in types), sliding_window=window,
                      input_embedding_scale=embed_scale, target_kv_layers=ids, hidden_act=act, query_scale=scale,
                      num_centroids=centroids, centroid_top_k=top_k)


def _name(t, n: str) -> str:
    return n if n in t or "model." + n not in t else "model." + n


def read(t, cfg: dict, hcfg: HeadConfig, target) -> tuple[HeadConfig, dict]:
    c, bb, dv, v = hcfg.layer, hcfg.target_hidden_size, hcfg.draft_vocab_size, target.vocab_size
    d, i, q = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim
    shapes = {"attn_norm": (d,), "wq": (q, d), "q_norm": (c.head_dim,), "wo": (d, q), "post_attn_norm": (d,),
              "pre_ff_norm": (d,), "w_gate": (i, d), "w_up": (i, d), "w_down": (d, i), "post_ff_norm": (d,),
              "layer_scalar": (1,)}
    layers = []
    for j in range(c.num_layers):
        pre = f"model.layers.{j}."
        lp = {}
        for key, name in LAYER.items():
            full = _name(t, pre + name)
            if key == "q_norm" and full not in t:
                continue
            if key == "layer_scalar" and full not in t:  # a buffer that defaults to one
                lp[key] = jnp.ones((1,), jnp.float32)
                continue
            lp[key] = t.get(full, shapes[key]).reshape(shapes[key])
        layers.append(lp)
    params = {"pre": t.get(_name(t, "pre_projection.weight"), (d, 2 * bb)),
              "post": t.get(_name(t, "post_projection.weight"), (bb, d)),
              "norm": t.get(_name(t, "model.norm.weight"), (d,)), "layers": layers}
    if "d2t" in t:
        from jaxspec.models.heads.eagle3 import check_d2t

        params["d2t"] = check_d2t(t.raw("d2t", (dv,)), v, "FROZEN_KV_MTP")
        params["lm_head"] = t.get(_name(t, "lm_head.weight"), (dv, d))
    elif dv != v:
        t.raw("d2t")  # a reduced vocabulary without its map cannot be used
    else:  # the published tie: the LM head is the draft's own embedding table
        head = "lm_head.weight" if "lm_head.weight" in t else _name(t, "model.embed_tokens.weight")
        params["lm_head"] = t.get(head, (v, d))
    if hcfg.num_centroids:
        params["centroids"] = t.get(_name(t, "masked_embedding.centroids.weight"), (hcfg.num_centroids, d))
        order = np.asarray(t.raw(_name(t, "masked_embedding.token_ordering"), (v,))).astype(np.int64)
        if not np.array_equal(np.sort(order), np.arange(v)):
            raise ConfigError(f"masked_embedding.token_ordering is not a permutation of the {v} token ids")
        params["token_ordering"] = order
    return hcfg, params


def fresh(kind: str, target, *, draft_vocab_size: int = 0, target_kv_layers=None, **_) -> HeadConfig:
    ids = tuple(target_kv_layers or (target.num_layers - 2, target.num_layers - 1))
    bad = [i for i in ids if not 0 <= i < target.num_layers]
    if bad:
        raise ValueError(f"target_kv_layers {list(ids)} has {bad} outside [0, {target.num_layers})")
    layer = dataclasses.replace(target, num_layers=len(ids), qk_norm=False, qkv_bias=False)
    return HeadConfig(kind=kind, layer=layer, target_hidden_size=target.hidden_size,
                      draft_vocab_size=min(draft_vocab_size or target.vocab_size, target.vocab_size), own_head=True,
                      target_kv_layers=ids)


def init(hcfg: HeadConfig, seed: int, token_ids=None) -> dict:
    rng = np.random.default_rng(seed)
    c, bb, dv = hcfg.layer, hcfg.target_hidden_size, hcfg.draft_vocab_size
    d, i, q = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim
    mat = lambda out, inp: (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)  # noqa: E731
    ones = lambda n: np.ones((n,), np.float32)  # noqa: E731
    layers = [{"attn_norm": ones(d), "wq": mat(q, d), "wo": mat(d, q), "post_attn_norm": ones(d),
               "pre_ff_norm": ones(d), "w_gate": mat(i, d), "w_up": mat(i, d), "w_down": mat(d, i),
               "post_ff_norm": ones(d), "layer_scalar": ones(1)} for _ in range(c.num_layers)]
    p = {"pre": mat(d, 2 * bb), "post": mat(bb, d), "norm": ones(d), "lm_head": mat(dv, d), "layers": layers}
    if dv != c.vocab_size or token_ids is not None:
        ids = np.arange(dv) if token_ids is None else np.asarray(token_ids)
        p["d2t"] = (ids - np.arange(dv)).astype(np.int32)
    return p


def train_init(p: dict, hcfg: HeadConfig, shared: dict, seed: int, draft_ids=None, head_init: str = "random") -> dict:
    """The LM head at nn.Linear's default scale (near-uniform first predictions, as EAGLE-3's)."""
    del shared, draft_ids, head_init
    rng = np.random.default_rng([seed, 1])
    dv, d = p["lm_head"].shape
    p["lm_head"] = jnp.asarray((rng.standard_normal((dv, d)) / np.sqrt(d)).astype(np.float32))
    return p


def write(params: dict, hcfg: HeadConfig, *, draft_ids=None, target_vocab: int | None = None,
          **_) -> tuple[dict, dict, str]:
    c, dv = hcfg.layer, hcfg.draft_vocab_size
    v = target_vocab or c.vocab_size
    t = {"pre_projection.weight": to_np(params["pre"]), "post_projection.weight": to_np(params["post"]),
         "model.norm.weight": to_np(params["norm"])}
    for j, lp in enumerate(params["layers"]):
        for key, name in LAYER.items():
            if key in lp:
                t[f"model.layers.{j}.{name}"] = to_np(lp[key])
    if draft_ids is None and params.get("d2t") is not None:
        draft_ids = np.arange(dv) + np.asarray(params["d2t"])
    if dv != v or draft_ids is not None:
        ids = np.asarray(draft_ids, np.int64)
        if ids.shape != (dv,) or np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= v:
            raise ValueError(f"draft_ids must be {dv} strictly ascending target ids in [0, {v})")
        t["lm_head.weight"] = to_np(params["lm_head"])
        t["d2t"] = ids - np.arange(dv, dtype=np.int64)
    else:
        t["model.embed_tokens.weight"] = to_np(params["lm_head"])
    if hcfg.num_centroids:
        t["masked_embedding.centroids.weight"] = to_np(params["centroids"])
        t["masked_embedding.token_ordering"] = np.asarray(params["token_ordering"], np.int64)
    cfg = {
        "architectures": [ARCH], "model_type": "frozen_kv_mtp", "backbone_hidden_size": hcfg.target_hidden_size,
        "target_layer_ids": list(hcfg.target_kv_layers), "use_ordered_embeddings": bool(hcfg.num_centroids),
        **({"num_centroids": hcfg.num_centroids, "centroid_intermediate_top_k": hcfg.centroid_top_k}
           if hcfg.num_centroids else {}),
        "query_scale": hcfg.query_scale or None, "embed_scale": hcfg.input_embedding_scale,
        **({"draft_vocab_size": dv} if "d2t" in t else {}),
        "text_config": {
            "model_type": "frozen_kv_mtp_text", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "vocab_size": v,
            "rms_norm_eps": c.rms_norm_eps, "hidden_activation": hcfg.hidden_act,
            "layer_types": ["sliding_attention" if s else "full_attention"
                            for s in (hcfg.sliding_layers or (False,) * c.num_layers)],
            **({"sliding_window": hcfg.sliding_window} if any(hcfg.sliding_layers) else {}),
            "rope_theta": c.rope_theta, "num_kv_shared_layers": c.num_layers, "tie_word_embeddings": "d2t" not in t,
        },
        "torch_dtype": "float32",
    }
    return cfg, t, "model.safetensors"


FAMILY = register_family(HeadFamily(
    "frozen_kv", ("frozen_kv",), detect, parse, read=read, fresh=fresh, init=init, write=write,
    train_init=train_init, loss="jaxspec.train.losses:frozen_kv_loss", train_features=("aux", "final"),
    draft_vocab=True))
