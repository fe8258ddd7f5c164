"""Write a trained head in its published format: safetensors + config.json.

  eagle3  SpecForge / SGLang / vLLM (LlamaForCausalLMEagle3): fc, midlayer.*, norm, lm_head,
          d2t (int64 offsets: target = draft + d2t[draft]), t2d (bool over the target vocabulary);
          eagle_config.eagle_aux_hidden_state_layer_ids in SpecForge's "output" convention (the
          output of layer i = the state entering layer i + 1).
  eagle   SafeAILab EAGLE-1: fc (+fc.bias), layers.0.* without input_layernorm; a one-layer
          Llama config with `bias`.
  medusa  FasterDecoding: medusa_lm_head.safetensors ({i}.{j}.linear.*, {i}.{L}.weight) and a
          config with medusa_num_heads / medusa_num_layers.
  dflash  z-lab/dflash / SpecForge (DFlashDraftModel): layers.{i}.* (Qwen3, q/k norms), fc,
          hidden_norm, norm, dflash_config {mask_token_id, target_layer_ids (output convention)};
  dspark  the same as DSparkDraftModel with markov_head.w{1,2} and confidence_head (jaxspec's own).

`jaxspec.models.heads.loading.load_draft_head` reads all three back (tests/test_train.py holds
the logits of the reloaded head equal to the exported one's).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxspec.models.config import ModelConfig
from jaxspec.models.heads.config import HeadConfig

# HF-layout key -> tensor name inside the head's decoder layer (loading._LAYER, inverted).
_LAYER = {
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias", "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight",
}


def _np(x, dtype=np.float32) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x).astype(dtype))


def llama_fields(c: ModelConfig) -> dict:
    """The Llama config.json fields of a head's one-layer geometry."""
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


def _layer_tensors(params: dict, prefix: str) -> dict:
    return {prefix + name: _np(params[k]) for k, name in _LAYER.items() if k in params}


def _write(out_dir, config: dict, tensors: dict, file: str = "model.safetensors") -> Path:
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / file), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def export_eagle3(params: dict, hcfg: HeadConfig, out_dir, *, draft_ids, target_vocab: int | None = None,
                  extra: dict | None = None) -> Path:
    """`draft_ids` [Vd]: the target id of each draft id (ascending)."""
    ids = np.asarray(draft_ids, np.int64)
    dv = hcfg.draft_vocab_size
    v = target_vocab or hcfg.layer.vocab_size
    if ids.shape != (dv,):
        raise ValueError(f"draft_ids has shape {ids.shape}, the head's draft vocabulary is {dv}")
    if np.any(np.diff(ids) <= 0) or ids[0] < 0 or ids[-1] >= v:
        raise ValueError(f"draft_ids must be strictly ascending target ids in [0, {v})")
    t = {
        "fc.weight": _np(params["fc"]), "midlayer.input_layernorm.weight": _np(params["enorm"]),
        "midlayer.hidden_norm.weight": _np(params["hnorm"]), "norm.weight": _np(params["norm"]),
        "lm_head.weight": _np(params["lm_head"]),
        "d2t": ids - np.arange(dv, dtype=np.int64), "t2d": np.isin(np.arange(v), ids),
    }
    t.update(_layer_tensors(params, "midlayer."))
    if "embed" in params:
        t["embed_tokens.weight"] = _np(params["embed"])
    cfg = llama_fields(hcfg.layer)
    cfg.update({
        "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": dv,
        "target_hidden_size": hcfg.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in hcfg.feature_layers],
                         "use_aux_hidden_state": True},
    })
    if any(k < 1 for k in hcfg.feature_layers):
        raise ValueError(f"feature layers {hcfg.feature_layers} include the embedding (0), which the output "
                         "convention cannot write")
    cfg.update(extra or {})
    return _write(out_dir, cfg, t)


def export_eagle(params: dict, hcfg: HeadConfig, out_dir, *, extra: dict | None = None) -> Path:
    t = {"fc.weight": _np(params["fc"])}
    if "fc_bias" in params:
        t["fc.bias"] = _np(params["fc_bias"])
    t.update(_layer_tensors(params, "layers.0."))
    if "embed" in params:
        t["embed_tokens.weight"] = _np(params["embed"])
    cfg = llama_fields(hcfg.layer)
    cfg["bias"] = "fc_bias" in params
    cfg.update(extra or {})
    return _write(out_dir, cfg, t)


def export_medusa(params: dict, hcfg: HeadConfig, out_dir, *, base_model: str = "", extra: dict | None = None) -> Path:
    n, L = len(params["res_w"]), len(params["res_w"][0])
    t = {}
    for i in range(n):
        for j in range(L):
            t[f"{i}.{j}.linear.weight"] = _np(params["res_w"][i][j])
            t[f"{i}.{j}.linear.bias"] = _np(params["res_b"][i][j])
        if "lm_head" in params:
            t[f"{i}.{L}.weight"] = _np(params["lm_head"][i])
    cfg = {"medusa_num_heads": n, "medusa_num_layers": L, "base_model_name_or_path": base_model,
           "hidden_size": hcfg.hidden_size, "vocab_size": hcfg.layer.vocab_size}
    if "lm_head" not in params:
        cfg["version"] = "2"
    cfg.update(extra or {})
    return _write(out_dir, cfg, t, "medusa_lm_head.safetensors")


def export_block(params: dict, hcfg: HeadConfig, out_dir, *, num_target_layers: int | None = None,
                 extra: dict | None = None) -> Path:
    """The DFlash format (z-lab/dflash, SpecForge): Qwen3 config with `block_size` and
    `dflash_config {mask_token_id, target_layer_ids}` (the OUTPUT convention, z-lab's
    hidden_states[i + 1]); DSpark adds `dspark_config {markov_rank, ...}` and its heads."""
    c = hcfg.layer
    if any(k < 1 for k in hcfg.feature_layers):
        raise ValueError(f"feature layers {hcfg.feature_layers} include the embedding (0), which the output "
                         "convention cannot write")
    names = {"attn_norm": "input_layernorm.weight", "wq": "self_attn.q_proj.weight",
             "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
             "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
             "mlp_norm": "post_attention_layernorm.weight", "w_gate": "mlp.gate_proj.weight",
             "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight"}
    t = {"fc.weight": _np(params["fc"]), "hidden_norm.weight": _np(params["hidden_norm"]),
         "norm.weight": _np(params["norm"])}
    for i, layer in enumerate(params["layers"]):
        t.update({f"layers.{i}.{names[k]}": _np(v) for k, v in layer.items()})
    sub = {"mask_token_id": hcfg.mask_token_id, "target_layer_ids": [k - 1 for k in hcfg.feature_layers],
           "block_size": hcfg.block_size}
    cfg = {**llama_fields(c), "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
           "num_hidden_layers": c.num_layers, "block_size": hcfg.block_size, "dflash_config": sub,
           "num_target_layers": num_target_layers}
    if hcfg.kind == "dspark":
        cfg["architectures"] = ["DSparkDraftModel"]
        cfg["dspark_config"] = {**cfg.pop("dflash_config"), "markov_rank": hcfg.markov_rank,
                                "markov_type": "vanilla", "confidence": bool(hcfg.confidence)}
        t["markov_head.w1.weight"] = _np(params["markov_w1"])
        t["markov_head.w2.weight"] = _np(params["markov_w2"])
        if hcfg.confidence:
            t["confidence_head.weight"] = _np(params["conf_w"])
            t["confidence_head.bias"] = _np(params["conf_b"])
    cfg.update(extra or {})
    if cfg.get("num_target_layers") is None:
        cfg.pop("num_target_layers")
    return _write(out_dir, cfg, t)


def cast_head(out_dir, dtype: str = "bfloat16") -> Path:
    """Rewrite an exported head's float32 tensors in `dtype` ("bfloat16" | "float16" | "float32";
    integer maps such as d2t / t2d stay) and set config.json's torch_dtype: what ships is half the
    size, and the loaders cast back to the engine's dtype."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    kinds = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
    if dtype not in kinds:
        raise ValueError(f"dtype must be one of {', '.join(kinds)}, got {dtype!r}")
    out = Path(out_dir)
    files = sorted(out.glob("*.safetensors"))
    if not files or not (out / "config.json").is_file():
        raise FileNotFoundError(f"{out}: no exported head (config.json + *.safetensors)")
    for f in files:
        t = load_file(str(f))
        save_file({k: v.astype(kinds[dtype]) if v.dtype == np.float32 else v for k, v in t.items()}, str(f),
                  metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def export_head(params: dict, hcfg: HeadConfig, out_dir, *, draft_ids=None, extra: dict | None = None,
                num_target_layers: int | None = None) -> Path:
    """Write `params` (HF layout, as trained) of a `hcfg.kind` head to `out_dir`."""
    if hcfg.kind in ("dflash", "dspark"):
        return export_block(params, hcfg, out_dir, num_target_layers=num_target_layers, extra=extra)
    if hcfg.kind == "eagle3":
        if draft_ids is None:
            d2t = params.get("d2t")
            if d2t is None:
                raise ValueError("export of an EAGLE-3 head needs draft_ids (or params['d2t'])")
            draft_ids = np.arange(hcfg.draft_vocab_size) + np.asarray(d2t)
        return export_eagle3(params, hcfg, out_dir, draft_ids=draft_ids, extra=extra)
    if hcfg.kind == "eagle":
        return export_eagle(params, hcfg, out_dir, extra=extra)
    if hcfg.kind == "medusa":
        return export_medusa(params, hcfg, out_dir, extra=extra)
    raise ValueError(f"no exporter for head kind {hcfg.kind!r}; kinds: eagle3, eagle, medusa, dflash, dspark")
