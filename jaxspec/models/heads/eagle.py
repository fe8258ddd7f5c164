"""The EAGLE-1 family: SafeAILab EAGLE-1 heads, and DeepSeek / MiMo MTP layers driven the same way.

Format (EAGLE-1): `fc.weight` [H, 2H] (+ `fc.bias` per the config's `bias`), `layers.0.*` without
`input_layernorm` (cnets1.py skips it), optional `embed_tokens.weight`; a one-layer Llama config.
MTP layers live inside the target's checkpoint (`loading.load_mtp_head`) and share its geometry.
The draft-time math is `attn_head.py`'s, shared with EAGLE-3.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxspec.models.config import ConfigError, LoadError
from jaxspec.models.heads.config import HeadConfig, check_equal, layer_config
from jaxspec.models.heads.family import HeadFamily, archs, layer_tensors, llama_fields, random_layer, register_family, to_np

MTP_KINDS = ("mtp_deepseek", "mtp_mimo")


def detect(cfg: dict) -> str | None:
    joined = archs(cfg)
    if int(cfg.get("num_nextn_predict_layers") or 0) > 0:
        return "mtp_mimo" if cfg.get("model_type") == "mimo" or "mimo" in joined else "mtp_deepseek"
    if "eagle" in joined or cfg.get("model_type") == "eagle":
        return "eagle"
    # EAGLE-1's own configs are plain Llama configs with one layer (eagle/train/*_config.json).
    if int(cfg.get("num_hidden_layers") or 0) == 1 and "hidden_size" in cfg:
        return "eagle"
    return None


def parse(kind: str, cfg: dict, t, convention: str) -> HeadConfig:
    if kind in MTP_KINDS:  # the MTP block lives in the target checkpoint and shares its geometry
        return HeadConfig(kind=kind, layer=dataclasses.replace(t, num_layers=1), target_hidden_size=t.hidden_size,
                          draft_vocab_size=t.vocab_size)
    layer = layer_config(cfg, t)
    check_equal("vocab_size", layer.vocab_size, t.vocab_size)
    # fc(cat(emb, h)) with the target's embedding and LM head: widths must match.
    check_equal("hidden_size", layer.hidden_size, t.hidden_size)
    return HeadConfig(kind=kind, layer=layer, target_hidden_size=t.hidden_size, draft_vocab_size=t.vocab_size,
                      fc_bias=bool(cfg.get("bias", True)))


def read(t, cfg: dict, hcfg: HeadConfig, target) -> tuple[HeadConfig, dict]:
    from jaxspec.models.heads.loading import check_embed, read_layer

    if hcfg.kind in MTP_KINDS:
        raise ConfigError(f"{t.where} is a target with MTP layers: load it with load_mtp_head")
    c, h = hcfg.layer, hcfg.layer.hidden_size
    params = {"fc": t.get("fc.weight", (h, 2 * h))}
    if "fc.bias" in t:
        params["fc_bias"] = t.get("fc.bias", (h,))
    elif cfg.get("bias") is True:
        t.raw("fc.bias")  # config says bias: a missing tensor is an error, not a silent zero
    hcfg = dataclasses.replace(hcfg, fc_bias="fc_bias" in params)
    params.update(read_layer(t, "layers.0.", c, h))
    if "layers.0.input_layernorm.weight" in t:
        raise LoadError("EAGLE-1 head has layers.0.input_layernorm.weight, which its layer 0 does not use "
                        "(cnets1.py skips it): not an EAGLE-1 checkpoint?")
    return check_embed(t, "embed_tokens.weight", hcfg, target, params), params


def fresh(kind: str, target, **_) -> HeadConfig:
    if kind != "eagle":
        raise ValueError(f"no fresh {kind} head: MTP layers are part of their target's checkpoint")
    layer = dataclasses.replace(target, num_layers=1, qk_norm=False, qkv_bias=False)
    return HeadConfig(kind=kind, layer=layer, target_hidden_size=target.hidden_size,
                      draft_vocab_size=target.vocab_size)


def init(hcfg: HeadConfig, seed: int, token_ids=None) -> dict:
    rng = np.random.default_rng(seed)
    h = hcfg.layer.hidden_size
    fc = (rng.standard_normal((h, 2 * h)) / np.sqrt(2 * h)).astype(np.float32)
    return {"fc": fc, **random_layer(rng, hcfg.layer, h)}


def write(params: dict, hcfg: HeadConfig, **_) -> tuple[dict, dict, str]:
    t = {"fc.weight": to_np(params["fc"])}
    if "fc_bias" in params:
        t["fc.bias"] = to_np(params["fc_bias"])
    t.update(layer_tensors(params, "layers.0."))
    if "embed" in params:
        t["embed_tokens.weight"] = to_np(params["embed"])
    cfg = llama_fields(hcfg.layer)
    cfg["bias"] = "fc_bias" in params
    return cfg, t, "model.safetensors"


FAMILY = register_family(HeadFamily(
    "eagle", ("eagle",) + MTP_KINDS, detect, parse, read=read, fresh=fresh, init=init, write=write,
    loss="jaxspec.train.losses:eagle_loss", trains=("eagle",)))
