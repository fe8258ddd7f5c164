"""The EAGLE-3 family: SpecForge / SGLang / vLLM `LlamaForCausalLMEagle3` heads.

Format: `fc.weight` [H, 3H], `midlayer.*` (2H-wide q/k/v; `layers.0.*` also read), `norm`,
`lm_head` [draft_vocab, H], `d2t` (int64 offsets: target = draft + d2t[draft]), `t2d` (bool over the
target vocabulary), optional `embed_tokens`; `eagle_config.eagle_aux_hidden_state_layer_ids` in
SpecForge's "output" convention (written so; read in either, see `feature_layers_from`).
The draft-time math is `attn_head.py`'s, shared with EAGLE-1.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxspec.models.config import ConfigError, LoadError
from jaxspec.models.heads.config import HeadConfig, check_equal, eagle3_layers, feature_layers_from, layer_config
from jaxspec.models.heads.family import HeadFamily, archs, layer_tensors, llama_fields, random_layer, register_family, to_np


def detect(cfg: dict) -> str | None:
    return "eagle3" if ("eagle3" in archs(cfg) or "draft_vocab_size" in cfg or "eagle_config" in cfg) else None


def parse(kind: str, cfg: dict, t, convention: str) -> HeadConfig:
    layer = layer_config(cfg, t)
    check_equal("vocab_size", layer.vocab_size, t.vocab_size)
    th = int(cfg.get("target_hidden_size") or layer.hidden_size)
    check_equal("target_hidden_size", th, t.hidden_size)
    for flag, ok in (("fc_norm", False), ("norm_output", True)):
        if flag in cfg and bool(cfg[flag]) != ok:
            raise ConfigError(f"EAGLE-3 config field {flag}={cfg[flag]!r} is not supported")
    eagle_cfg = cfg.get("eagle_config") or {}
    if eagle_cfg.get("use_aux_hidden_state", True) is False:
        raise ConfigError("EAGLE-3 config has eagle_config.use_aux_hidden_state=false (no fc): not supported")
    ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
    L = t.num_layers
    feats = (feature_layers_from(ids, L, convention) if ids is not None
             else feature_layers_from(eagle3_layers(L), L, "input"))
    if len(feats) != 3:
        raise ConfigError(f"EAGLE-3 captures 3 target layers, eagle_aux_hidden_state_layer_ids has {list(ids)}")
    dv = int(cfg.get("draft_vocab_size") or t.vocab_size)
    if not 0 < dv <= t.vocab_size:
        raise ConfigError(f"draft_vocab_size {dv} is not in [1, target vocab_size {t.vocab_size}]")
    return HeadConfig(kind=kind, layer=layer, target_hidden_size=th, draft_vocab_size=dv, feature_layers=feats,
                      own_head=True, norm_before_residual=bool(cfg.get("norm_before_residual", False)))


def check_d2t(raw, v: int, what: str) -> jnp.ndarray:
    """A reduced vocabulary's offsets (target id = draft id + d2t) as int32, checked in range and
    injective: two draft ids on one target id would drop q mass, a lossy rejection."""
    d2t = np.asarray(raw).astype(np.int64)
    ids = np.arange(d2t.shape[0]) + d2t
    bad = np.flatnonzero((ids < 0) | (ids >= v))
    if bad.size:
        raise LoadError(f"{what} d2t maps draft ids {bad[:4].tolist()} to target ids {ids[bad[:4]].tolist()} "
                        f"outside the target vocabulary [0, {v})")
    uniq, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        dup = uniq[counts > 1][:4]
        raise LoadError(f"{what} d2t maps several draft ids to one target id (target ids {dup.tolist()}); "
                        "the map must be injective")
    return jnp.asarray(d2t.astype(np.int32))


def read(t, cfg: dict, hcfg: HeadConfig, target) -> tuple[HeadConfig, dict]:
    from jaxspec.models.heads.loading import check_embed, read_layer

    c, h, dv, v = hcfg.layer, hcfg.layer.hidden_size, hcfg.draft_vocab_size, target.vocab_size
    pre = "midlayer." if "midlayer.self_attn.q_proj.weight" in t else "layers.0."
    params = {
        "fc": t.get("fc.weight", (h, hcfg.feature_width)),
        "enorm": t.get(pre + "input_layernorm.weight", (h,)),
        "hnorm": t.get(pre + "hidden_norm.weight", (h,)),
        "norm": t.get("norm.weight", (h,)),
        "lm_head": t.get("lm_head.weight", (dv, h)),
    }
    params.update(read_layer(t, pre, c, 2 * h))
    if "d2t" in t:
        params["d2t"] = check_d2t(t.raw("d2t", (dv,)), v, "EAGLE-3")
    elif dv != v:
        t.raw("d2t")  # a reduced vocabulary without its map cannot be used
    if "t2d" in t:
        params["t2d"] = jnp.asarray(t.raw("t2d", (v,)).astype(bool))
    return check_embed(t, "embed_tokens.weight", hcfg, target, params), params


def fresh(kind: str, target, *, draft_vocab_size: int = 0, feature_layers=None, **_) -> HeadConfig:
    layer = dataclasses.replace(target, num_layers=1, qk_norm=False, qkv_bias=False)
    return HeadConfig(kind=kind, layer=layer, target_hidden_size=target.hidden_size,
                      draft_vocab_size=min(draft_vocab_size or target.vocab_size, target.vocab_size),
                      feature_layers=tuple(feature_layers or eagle3_layers(target.num_layers)), own_head=True)


def init(hcfg: HeadConfig, seed: int, token_ids=None) -> dict:
    """`token_ids`: the target ids of the draft vocabulary, ascending (default: the first ones)."""
    rng = np.random.default_rng(seed)
    h, dv = hcfg.layer.hidden_size, hcfg.draft_vocab_size
    mat = lambda out, inp, gain=1.0: (rng.standard_normal((out, inp)) * gain / np.sqrt(inp)).astype(np.float32)  # noqa: E731
    ids = np.arange(dv) if token_ids is None else np.asarray(token_ids)
    ones = np.ones((h,), np.float32)
    fc = mat(h, hcfg.feature_width)
    head = mat(dv, h, 4.0)
    return {"fc": fc, "enorm": ones, "hnorm": ones, "norm": ones, "lm_head": head,
            **random_layer(rng, hcfg.layer, 2 * h), "d2t": (ids - np.arange(dv)).astype(np.int32)}


def train_init(p: dict, hcfg: HeadConfig, shared: dict, seed: int, draft_ids=None, head_init: str = "random") -> dict:
    """lm_head at the scale of a default nn.Linear (std 1/sqrt(H): near-uniform first predictions, as
    SpecForge starts; a copy of the target's LM head rows, `head_init = "target"`, trained worse on the
    tests' corpus)."""
    rng = np.random.default_rng([seed, 1])
    dv, h = p["lm_head"].shape
    p["lm_head"] = jnp.asarray((rng.standard_normal((dv, h)) / np.sqrt(h)).astype(np.float32))
    if head_init == "target":
        ids = np.arange(dv) if draft_ids is None else np.asarray(draft_ids)
        p["lm_head"] = jnp.asarray(np.asarray(shared["head"], np.float32)[:, ids].T)  # [Vd, H]
        p["norm"] = jnp.asarray(np.asarray(shared["final_norm"], np.float32))
    return p


def write(params: dict, hcfg: HeadConfig, *, draft_ids=None, target_vocab: int | None = None,
          **_) -> tuple[dict, dict, str]:
    """`draft_ids` [Vd]: the target id of each draft id, ascending (default: from params['d2t'])."""
    dv = hcfg.draft_vocab_size
    if draft_ids is None:
        if params.get("d2t") is None:
            raise ValueError("export of an EAGLE-3 head needs draft_ids (or params['d2t'])")
        draft_ids = np.arange(dv) + np.asarray(params["d2t"])
    ids = np.asarray(draft_ids, np.int64)
    v = target_vocab or hcfg.layer.vocab_size
    if ids.shape != (dv,):
        raise ValueError(f"draft_ids has shape {ids.shape}, the head's draft vocabulary is {dv}")
    if np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= v:
        raise ValueError(f"draft_ids must be strictly ascending target ids in [0, {v})")
    if any(k < 1 for k in hcfg.feature_layers):
        raise ValueError(f"feature layers {hcfg.feature_layers} include the embedding (0), which the output "
                         "convention cannot write")
    t = {
        "fc.weight": to_np(params["fc"]), "midlayer.input_layernorm.weight": to_np(params["enorm"]),
        "midlayer.hidden_norm.weight": to_np(params["hnorm"]), "norm.weight": to_np(params["norm"]),
        "lm_head.weight": to_np(params["lm_head"]),
        "d2t": ids - np.arange(dv, dtype=np.int64), "t2d": np.isin(np.arange(v), ids),
    }
    t.update(layer_tensors(params, "midlayer."))
    if "embed" in params:
        t["embed_tokens.weight"] = to_np(params["embed"])
    cfg = llama_fields(hcfg.layer)
    cfg.update({
        "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": dv,
        "target_hidden_size": hcfg.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in hcfg.feature_layers],
                         "use_aux_hidden_state": True},
    })
    return cfg, t, "model.safetensors"


FAMILY = register_family(HeadFamily(
    "eagle3", ("eagle3",), detect, parse, read=read, fresh=fresh, init=init, write=write, train_init=train_init,
    loss="jaxspec.train.losses:eagle3_loss", train_features=("aux", "final"), draft_vocab=True))
