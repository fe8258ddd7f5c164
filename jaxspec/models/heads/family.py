"""Head families: one module per family of draft heads, each registering what it knows in one place.

A family (EAGLE-1 and MTP; EAGLE-3; Medusa; MLP speculator; the DFLASH / DSPARK block drafters) owns
its published format both ways and its training recipe:

    detect(config.json) -> kind | None     which of its kinds a head directory holds
    parse(kind, config.json, target, convention) -> HeadConfig
    read(tensors, config.json, hcfg, target) -> (hcfg, params)      a head directory's safetensors
    fresh(kind, target, **opts) -> HeadConfig   a new head for a target (training, benchmarks)
    init(hcfg, seed, token_ids) -> params       random weights in the loaders' (HF) layout
    write(params, hcfg, **kw) -> (config.json, tensors, file name)  the export, what `read` reads back
    train_init(params, hcfg, shared, seed, draft_ids, head_init) -> params   the recipe's own init
    loss: "module:function"                     the training loss; the trainer imports it, so
                                                models/ never imports train/

`parse_head_config`, `load_draft_head`, `head_config` / `init_head_params` and `export_head` dispatch
through `family_of(kind)`; adding a family is one module here plus its `register_family` call (and
its import in the package's __init__; a family from outside registers from its own module).
The math each family runs at draft time stays beside it (attn_head.py, medusa.py, ...).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models.config import ConfigError

# HF-layout key -> tensor name inside a decoder layer; the input norm is named per family.
LAYER_TENSORS = {
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight", "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
}
# The families in detection order (an EAGLE-3 config is also a one-layer Llama config, so EAGLE-3 is
# asked before EAGLE-1; a FROZEN_KV_MTP config has draft_vocab_size too, so it is asked before EAGLE-3).
# The package's __init__ imports their modules, which register.
MODULES = ("mlp_speculator", "medusa", "block", "frozen_kv", "eagle3", "eagle")


@dataclasses.dataclass(frozen=True)
class HeadFamily:
    name: str
    kinds: tuple[str, ...]
    detect: Callable[[dict], str | None]
    parse: Callable[..., Any]
    read: Callable[..., Any] | None = None
    tensor_prefix: str = ""  # a wrapper some exporters put before every tensor name
    fresh: Callable[..., Any] | None = None
    init: Callable[..., dict] | None = None
    write: Callable[..., tuple[dict, dict, str]] | None = None
    train_init: Callable[..., dict] | None = None
    loss: str = ""
    # The target states its training data captures: "aux" (the layers it reads), "final" (final-norm state).
    train_features: tuple[str, ...] = ("final",)
    trains: tuple[str, ...] | None = None  # the kinds the trainer makes fresh (None: all, given a loss)
    # A reduced draft vocabulary (EAGLE-3's d2t): the trainer picks its ids from token counts.
    draft_vocab: bool = False

    def loss_fn(self) -> Callable:
        if not self.loss:
            raise ValueError(f"no training loss for {self.name} heads; trainable: {', '.join(trainable_kinds())}")
        module, _, fn = self.loss.partition(":")
        return getattr(importlib.import_module(module), fn)


_FAMILIES: list[HeadFamily] = []


def register_family(family: HeadFamily) -> HeadFamily:
    taken = [k for f in _FAMILIES for k in f.kinds if k in family.kinds]
    if taken:
        raise ValueError(f"head kinds {taken} are registered already")
    _FAMILIES.append(family)
    return family


def families() -> tuple[HeadFamily, ...]:
    """Every family, in detection order."""
    order = {m: i for i, m in enumerate(MODULES)}
    return tuple(sorted(_FAMILIES, key=lambda f: order.get(f.name, len(order))))


def kinds() -> tuple[str, ...]:
    return tuple(k for f in families() for k in f.kinds)


def trainable_kinds() -> tuple[str, ...]:
    return tuple(k for f in families() if f.loss and f.write and f.fresh for k in (f.trains or f.kinds))


def family_of(kind: str) -> HeadFamily:
    for f in families():
        if kind in f.kinds:
            return f
    raise ValueError(f"unknown head kind {kind!r}; kinds: {', '.join(kinds())}")


def detect_format(config_json: dict[str, Any]) -> str:
    """The head kind a config.json describes; ConfigError naming the fields seen otherwise."""
    for f in families():
        kind = f.detect(config_json)
        if kind is not None:
            return kind
    seen = {k: config_json.get(k) for k in ("architectures", "model_type", "num_hidden_layers")}
    raise ConfigError(
        f"unknown draft-head format: config.json has {seen} and none of draft_vocab_size, "
        f"eagle_config, medusa_num_heads, n_predict/emb_dim (mlp_speculator), num_nextn_predict_layers"
    )


# ---- fresh heads -----------------------------------------------------------------------------------
# Where no trained head exists yet: the speed benchmarks (a head's cost does not depend on its weights)
# and the start of drafter training. Each family writes its own (`fresh`, `init` in its module); scales
# keep activations O(1) so timings see realistic numerics (no denormals, no NaN).


def head_config(kind: str, target, **opts):
    """The HeadConfig of a fresh `kind` head shaped for `target` (what a published checkpoint of that
    kind would parse to). `opts` are the family's own (draft_vocab_size, feature_layers for EAGLE-3;
    num_heads for Medusa and the MLP speculator; num_layers, block_size, mask_token_id, markov_rank for
    the block drafters); others are ignored."""
    family = family_of(kind)
    if family.fresh is None:
        raise ValueError(f"no fresh head of kind {kind!r}")
    return family.fresh(kind, target, **opts)


def init_head_params(hcfg, seed: int = 0, *, token_ids=None, dtype=jnp.float32) -> dict:
    """Random params (HF layout, as `load_draft_head` returns them). `token_ids`: the
    target ids of an EAGLE-3 draft vocabulary, ascending (default: the first ones)."""
    family = family_of(hcfg.kind)
    if family.init is None:
        raise ValueError(f"no fresh head of kind {hcfg.kind!r}")
    p = family.init(hcfg, seed, token_ids)
    return jax.tree.map(lambda x: jnp.asarray(x) if np.asarray(x).dtype.kind in "ib" else jnp.asarray(x, dtype), p)


def archs(config_json: dict) -> str:
    """The config's architectures, lowercased and joined (what detection reads)."""
    return " ".join(str(a) for a in (config_json.get("architectures") or [])).lower()


# ---- writing (the inverse of the loaders) ----------------------------------------------------------


def to_np(x, dtype=np.float32) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x).astype(dtype))


def layer_tensors(params: dict, prefix: str) -> dict:
    """A decoder layer's tensors under `prefix` (the norms a family names itself are its own)."""
    skip = ("q_norm", "k_norm")
    return {prefix + name: to_np(params[k]) for k, name in LAYER_TENSORS.items() if k in params and k not in skip}


def llama_fields(c) -> dict:
    """The Llama config.json fields of a head's one-layer geometry (`c`: its ModelConfig)."""
    out = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "num_hidden_layers": 1,
        "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": bool(c.qkv_bias), "torch_dtype": "float32",
    }
    r = c.rope_scaling
    if r.rope_type != "default":
        out["rope_scaling"] = {"rope_type": r.rope_type, "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                               "high_freq_factor": r.high_freq_factor,
                               "original_max_position_embeddings": r.original_max_position_embeddings}
    if c.bos_token_id is not None:
        out["bos_token_id"] = c.bos_token_id
    if c.eos_token_ids:
        out["eos_token_id"] = list(c.eos_token_ids) if len(c.eos_token_ids) > 1 else c.eos_token_ids[0]
    return out


def random_layer(rng: np.random.Generator, c, w_in: int) -> dict:
    """A decoder layer's random HF-layout weights (projections at 1/sqrt(fan-in), norms at one)."""
    h, i, q, kv = c.hidden_size, c.intermediate_size, c.q_size, c.kv_size
    mat = lambda out, inp: (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)  # noqa: E731
    return {"wq": mat(q, w_in), "wk": mat(kv, w_in), "wv": mat(kv, w_in), "wo": mat(h, q),
            "mlp_norm": np.ones((h,), np.float32), "w_gate": mat(i, h), "w_up": mat(i, h), "w_down": mat(h, i)}
