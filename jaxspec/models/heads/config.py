"""HeadConfig: one frozen description of a draft head, parsed from its config.json.

Format detection is by config fields only (the loader then checks the tensors). The
EAGLE-3 captured-layer ids are normalised to one convention, "state entering layer k"
(k in [0, L]); checkpoints are written in two (see `parse_head_config`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.models.config import ConfigError, ModelConfig

KINDS = ("eagle", "eagle3", "mtp_deepseek", "mtp_mimo", "medusa", "mlp_speculator", "dflash", "dspark")
BLOCK_KINDS = ("dflash", "dspark")
CONVENTIONS = ("output", "input")


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    kind: str
    layer: ModelConfig  # the head's decoder-layer geometry; vocab_size = TARGET vocab, num_layers = 1
    target_hidden_size: int
    draft_vocab_size: int  # eagle3: its reduced vocabulary; everyone else: the target vocab
    # Target layers whose INPUT residual stream is captured (k = L: last layer's output,
    # before the final norm). Empty: the head reads the target's final-norm hidden state.
    feature_layers: tuple[int, ...] = ()
    fc_bias: bool = False
    own_embed: bool = False
    own_head: bool = False
    num_heads: int = 1  # medusa: medusa heads; mlp_speculator: n_predict
    num_medusa_layers: int = 1
    medusa_version: str = "1"  # "2": no per-head LM head, the target's is reused
    # EAGLE-3 (vLLM's `norm_before_residual`): the residual is hidden_norm(h), not h.
    norm_before_residual: bool = False
    mtp_layer: int = 0
    # mlp_speculator
    emb_dim: int = 0
    inner_dim: int = 0
    tie_weights: bool = False
    scale_input: bool = False
    # Block drafters (dflash, dspark; jaxspec.models.heads.block). `layer.num_layers` is the
    # drafter's depth; block_size is the checkpoint's (dflash: root + drafts; dspark: gamma).
    block_size: int = 0
    mask_token_id: int = -1
    sliding_layers: tuple[bool, ...] = ()  # per draft layer: causal sliding-window attention
    sliding_window: int = 0
    input_embedding_scale: float = 1.0
    markov_rank: int = 0  # dspark: rank of the Markov bias W2 . W1[t_prev]
    confidence: bool = False  # dspark: a per-position confidence head

    @property
    def feature_width(self) -> int:
        n = len(self.feature_layers)
        return n * self.target_hidden_size if n else self.target_hidden_size

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


def runtime_matrix(w, native: bool):
    """HF [out, in] -> the runtime [in, out] that `layers.linear` takes; a PackedWeight when native."""
    import jax.numpy as jnp

    w = jnp.asarray(w).T
    if not native:
        return w
    from jaxspec.native.packed_matmul import pack_weight

    if w.dtype != jnp.float32:
        raise TypeError(f"native packed weights are float32 only, got {w.dtype}")
    return pack_weight(w)


def _archs(cfg: dict) -> list[str]:
    return [str(a) for a in (cfg.get("architectures") or [])]


def detect_format(config_json: dict[str, Any]) -> str:
    """The head kind a config.json describes; ConfigError naming the fields seen otherwise."""
    archs = _archs(config_json)
    model_type = str(config_json.get("model_type") or "")
    joined = " ".join(archs).lower()
    if model_type == "mlp_speculator" or "mlpspeculator" in joined:
        return "mlp_speculator"
    if model_type == "medusa" or "medusa_num_heads" in config_json or "medusa" in joined:
        return "medusa"
    if "dspark" in joined or "dspark_config" in config_json:
        return "dspark"
    if "dflash" in joined or "dflash_config" in config_json:
        return "dflash"
    if "eagle3" in joined or "draft_vocab_size" in config_json or "eagle_config" in config_json:
        return "eagle3"
    if int(config_json.get("num_nextn_predict_layers") or 0) > 0:
        return "mtp_mimo" if model_type == "mimo" or "mimo" in joined else "mtp_deepseek"
    if "eagle" in joined or model_type == "eagle":
        return "eagle"
    # EAGLE-1's own configs are plain Llama configs with one layer (eagle/train/*_config.json).
    if int(config_json.get("num_hidden_layers") or 0) == 1 and "hidden_size" in config_json:
        return "eagle"
    seen = {k: config_json.get(k) for k in ("architectures", "model_type", "num_hidden_layers")}
    raise ConfigError(
        f"unknown draft-head format: config.json has {seen} and none of draft_vocab_size, "
        f"eagle_config, medusa_num_heads, n_predict/emb_dim (mlp_speculator), num_nextn_predict_layers"
    )


def _layer_config(cfg: dict, target: ModelConfig) -> ModelConfig:
    """The head's own decoder-layer geometry; RoPE comes from the head's config, not the target's."""
    fixed = {**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    fixed.setdefault("vocab_size", target.vocab_size)
    layer = ModelConfig.from_hf_dict(fixed)
    # EAGLE's cnets1 reads `qkv_bias`; SpecForge/vLLM `attention_bias`.
    bias = bool(cfg.get("qkv_bias", cfg.get("attention_bias", False)))
    return dataclasses.replace(layer, num_layers=1, qkv_bias=bias, qk_norm=False)


def _check(what: str, head: int, target: int) -> None:
    if head != target:
        raise ConfigError(f"draft head {what} {head} != target {what} {target}")


def feature_layers_from(ids, num_target_layers: int, convention: str,
                        field: str = "eagle_aux_hidden_state_layer_ids") -> tuple[int, ...]:
    """Captured-layer ids as written in a checkpoint -> "entering layer k" ids, range-checked;
    `field` is the config field the message names."""
    if convention not in CONVENTIONS:
        raise ConfigError(f"aux_layer_convention must be one of {CONVENTIONS}, got {convention!r}")
    L = num_target_layers
    ids = [int(i) for i in ids]
    # "output": id i is the output of layer i (SpecForge writes it, SGLang adds one); "input": vLLM.
    lo, hi = (0, L - 1) if convention == "output" else (0, L)
    bad = [i for i in ids if not lo <= i <= hi]
    if bad:
        raise ConfigError(
            f"{field} {ids} ({convention} convention) has {bad} outside "
            f"[{lo}, {hi}] for a target with {L} layers"
        )
    return tuple(i + 1 for i in ids) if convention == "output" else tuple(ids)


def parse_head_config(
    config_json: dict[str, Any], target_cfg: ModelConfig, *, aux_layer_convention: str = "output"
) -> HeadConfig:
    if aux_layer_convention not in CONVENTIONS:
        raise ConfigError(f"aux_layer_convention must be one of {CONVENTIONS}, got {aux_layer_convention!r}")
    kind = detect_format(config_json)
    t = target_cfg
    if kind in ("mtp_deepseek", "mtp_mimo"):
        # The MTP block lives in the target checkpoint and shares its geometry.
        return HeadConfig(kind=kind, layer=dataclasses.replace(t, num_layers=1), target_hidden_size=t.hidden_size,
                          draft_vocab_size=t.vocab_size)
    if kind == "medusa":
        heads = int(config_json.get("medusa_num_heads") or config_json.get("num_heads") or 0)
        layers = int(config_json.get("medusa_num_layers") or config_json.get("num_hidden_layers") or 1)
        if heads <= 0:
            raise ConfigError("medusa config.json has no medusa_num_heads / num_heads")
        for what, key in (("hidden_size", "hidden_size"), ("vocab_size", "vocab_size")):
            # FasterDecoding's config carries neither (they are the base model's); vLLM's has both.
            if key in config_json and config_json.get("model_type") == "medusa":
                _check(what, int(config_json[key]), getattr(t, key))
        trunc = config_json.get("truncated_vocab_size")
        if trunc is not None and int(trunc) != t.vocab_size:
            raise ConfigError(f"medusa truncated_vocab_size {trunc} != target vocab_size {t.vocab_size}: "
                              "token_map heads are not supported")
        return HeadConfig(kind=kind, layer=dataclasses.replace(t, num_layers=1), target_hidden_size=t.hidden_size,
                          draft_vocab_size=t.vocab_size, num_heads=heads, num_medusa_layers=layers,
                          medusa_version=str(config_json.get("version", "1")), own_head=True)
    if kind == "mlp_speculator":
        emb = int(config_json.get("emb_dim") or 0)
        inner = int(config_json.get("inner_dim") or 0) or emb
        n = int(config_json.get("n_predict") or 0)
        if emb <= 0 or n <= 0:
            raise ConfigError(f"mlp_speculator config.json needs emb_dim and n_predict, got {emb} and {n}")
        _check("emb_dim (hidden size)", emb, t.hidden_size)
        _check("vocab_size", int(config_json.get("vocab_size", t.vocab_size)), t.vocab_size)
        return HeadConfig(kind=kind, layer=dataclasses.replace(t, num_layers=1), target_hidden_size=t.hidden_size,
                          draft_vocab_size=t.vocab_size, num_heads=n, emb_dim=emb, inner_dim=inner,
                          tie_weights=bool(config_json.get("tie_weights", False)),
                          scale_input=bool(config_json.get("scale_input", False)), own_head=True, own_embed=True)

    if kind in BLOCK_KINDS:
        return parse_block_config(kind, config_json, t, aux_layer_convention)
    layer = _layer_config(config_json, t)
    _check("vocab_size", layer.vocab_size, t.vocab_size)
    if kind == "eagle":
        # fc(cat(emb, h)) with the target's embedding and LM head: widths must match.
        _check("hidden_size", layer.hidden_size, t.hidden_size)
        return HeadConfig(kind=kind, layer=layer, target_hidden_size=t.hidden_size, draft_vocab_size=t.vocab_size,
                          fc_bias=bool(config_json.get("bias", True)))
    # eagle3
    th = int(config_json.get("target_hidden_size") or layer.hidden_size)
    _check("target_hidden_size", th, t.hidden_size)
    for flag, ok in (("fc_norm", False), ("norm_output", True)):
        if flag in config_json and bool(config_json[flag]) != ok:
            raise ConfigError(f"EAGLE-3 config field {flag}={config_json[flag]!r} is not supported")
    eagle_cfg = config_json.get("eagle_config") or {}
    if eagle_cfg.get("use_aux_hidden_state", True) is False:
        raise ConfigError("EAGLE-3 config has eagle_config.use_aux_hidden_state=false (no fc): not supported")
    ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
    L = t.num_layers
    feats = (feature_layers_from(ids, L, aux_layer_convention) if ids is not None
             else feature_layers_from([2, L // 2, L - 3], L, "input"))
    if len(feats) != 3:
        raise ConfigError(f"EAGLE-3 captures 3 target layers, eagle_aux_hidden_state_layer_ids has {list(ids)}")
    dv = int(config_json.get("draft_vocab_size") or t.vocab_size)
    if not 0 < dv <= t.vocab_size:
        raise ConfigError(f"draft_vocab_size {dv} is not in [1, target vocab_size {t.vocab_size}]")
    return HeadConfig(kind=kind, layer=layer, target_hidden_size=th, draft_vocab_size=dv, feature_layers=feats,
                      own_head=True, norm_before_residual=bool(config_json.get("norm_before_residual", False)))


def parse_block_config(kind: str, cfg: dict, t: ModelConfig, convention: str = "output") -> HeadConfig:
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
    _check("hidden_size", layer.hidden_size, t.hidden_size)
    _check("vocab_size", layer.vocab_size, t.vocab_size)
    ids = get("target_layer_ids")
    if not ids:
        raise ConfigError(f"{kind} config.json has no {kind}_config.target_layer_ids")
    n_target = int(cfg.get("num_target_layers") or t.num_layers)
    _check("num_target_layers", n_target, t.num_layers)
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
