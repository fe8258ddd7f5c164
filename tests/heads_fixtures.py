"""Writers of small draft-head checkpoints in each published layout (tensor by tensor, numpy).

`target` is a transformers model or a jaxspec ModelConfig. Weights are random, scaled so each
projection keeps activations O(1) and the LM heads give sharp (not near-uniform) logits, as
tests/conftest.py's make_tiny_hf does for targets.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file


@dataclasses.dataclass(frozen=True)
class Geom:
    hidden: int
    vocab: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    theta: float
    qkv_bias: bool


def geom(target) -> Geom:
    if hasattr(target, "config") and not hasattr(target, "hidden_size"):  # a transformers model
        c = target.config
        rope = getattr(c, "rope_parameters", None) or {}
        theta = getattr(c, "rope_theta", None) or rope.get("rope_theta", 10000.0)
        return Geom(c.hidden_size, c.vocab_size, c.num_hidden_layers, c.num_attention_heads,
                    c.num_key_value_heads, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                    c.intermediate_size, c.rms_norm_eps, float(theta),
                    c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False)))
    t = target
    return Geom(t.hidden_size, t.vocab_size, t.num_layers, t.num_heads, t.num_kv_heads, t.head_dim,
                t.intermediate_size, t.rms_norm_eps, t.rope_theta, t.qkv_bias)


class _Rand:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def mat(self, out: int, inp: int, scale: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal((out, inp)) * scale / np.sqrt(inp)).astype(np.float32)

    def norm(self, n: int) -> np.ndarray:
        return (1.0 + 0.2 * self.rng.standard_normal(n)).astype(np.float32)

    def vec(self, n: int, scale: float = 0.1) -> np.ndarray:
        return (scale * self.rng.standard_normal(n)).astype(np.float32)


def _layer(r: _Rand, g: Geom, prefix: str, w_in: int, *, input_norm: str | None, qkv_bias: bool) -> dict:
    q, kv = g.heads * g.head_dim, g.kv_heads * g.head_dim
    t = {
        f"{prefix}self_attn.q_proj.weight": r.mat(q, w_in), f"{prefix}self_attn.k_proj.weight": r.mat(kv, w_in),
        f"{prefix}self_attn.v_proj.weight": r.mat(kv, w_in), f"{prefix}self_attn.o_proj.weight": r.mat(g.hidden, q),
        f"{prefix}post_attention_layernorm.weight": r.norm(g.hidden),
        f"{prefix}mlp.gate_proj.weight": r.mat(g.inter, g.hidden), f"{prefix}mlp.up_proj.weight": r.mat(g.inter, g.hidden),
        f"{prefix}mlp.down_proj.weight": r.mat(g.hidden, g.inter),
    }
    if qkv_bias:
        for n, size in (("q", q), ("k", kv), ("v", kv)):
            t[f"{prefix}self_attn.{n}_proj.bias"] = r.vec(size)
    if input_norm:
        t[prefix + input_norm] = r.norm(g.hidden)
    return t


def _llama_config(g: Geom, **extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": g.hidden,
        "intermediate_size": g.inter, "num_attention_heads": g.heads, "num_key_value_heads": g.kv_heads,
        "head_dim": g.head_dim, "num_hidden_layers": 1, "vocab_size": g.vocab, "rms_norm_eps": g.eps,
        # A theta unlike the target's: the head must use its own RoPE settings.
        "rope_theta": 5000.0, "hidden_act": "silu", "max_position_embeddings": 512, **extra,
    }


def _write(d: Path, config: dict, tensors: dict, file: str = "model.safetensors") -> Path:
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(d / file), metadata={"format": "pt"})
    return d


def write_eagle_head(d, target, *, seed=0, bias=True, with_embed=False) -> Path:
    """EAGLE-1 (SafeAILab cnets1.py): fc [H, 2H] (+bias), layers.0.* without input_layernorm."""
    g, r = geom(target), _Rand(seed)
    t = {"fc.weight": r.mat(g.hidden, 2 * g.hidden)}
    if bias:
        t["fc.bias"] = r.vec(g.hidden)
    t.update(_layer(r, g, "layers.0.", g.hidden, input_norm=None, qkv_bias=False))
    if with_embed:
        t["embed_tokens.weight"] = r.mat(g.vocab, g.hidden, np.sqrt(g.hidden))
    return _write(d, _llama_config(g, bias=bias), t)


def write_eagle3_head(d, target, *, seed=0, draft_vocab_size=64, layer_ids=None, convention="output",
                      with_embed=False) -> Path:
    """EAGLE-3 (SpecForge llama3_eagle.py): midlayer.* with 2H-wide q/k/v, fc [H, 3H], norm, lm_head, d2t, t2d.

    `layer_ids` are the "state entering layer k" ids the test wants; they are WRITTEN in
    `convention` ("output": k - 1, as SpecForge does; "input": k, as vLLM reads them).
    None leaves eagle_aux_hidden_state_layer_ids out (the default [2, L//2, L-3] applies).
    """
    g, r = geom(target), _Rand(seed)
    h = g.hidden
    used = np.sort(r.rng.choice(g.vocab, draft_vocab_size, replace=False))
    t = {
        "fc.weight": r.mat(h, 3 * h),
        "midlayer.input_layernorm.weight": r.norm(h), "midlayer.hidden_norm.weight": r.norm(h),
        "norm.weight": r.norm(h), "lm_head.weight": r.mat(draft_vocab_size, h, 8.0),
        "d2t": (used - np.arange(draft_vocab_size)).astype(np.int64),
        "t2d": np.isin(np.arange(g.vocab), used),
    }
    t.update(_layer(r, g, "midlayer.", 2 * h, input_norm=None, qkv_bias=False))
    if with_embed:
        t["embed_tokens.weight"] = r.mat(g.vocab, h, np.sqrt(h))
    cfg = _llama_config(g, draft_vocab_size=draft_vocab_size, target_hidden_size=h)
    cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    if layer_ids is not None:
        written = [k - 1 for k in layer_ids] if convention == "output" else list(layer_ids)
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": written, "use_aux_hidden_state": True}
    return _write(d, cfg, t)


def write_medusa_head(d, target, *, num_heads=3, num_layers=1, version="1", layout="medusa", seed=0) -> Path:
    """Medusa: FasterDecoding's medusa_lm_head.safetensors, or vLLM's blocks/lm_heads layout (same values)."""
    g, r = geom(target), _Rand(seed)
    blocks = [[(r.mat(g.hidden, g.hidden, 0.5), r.vec(g.hidden)) for _ in range(num_layers)] for _ in range(num_heads)]
    heads = [r.mat(g.vocab, g.hidden, 8.0) for _ in range(num_heads)]
    t = {}
    if layout == "medusa":
        for i in range(num_heads):
            for j, (w, b) in enumerate(blocks[i]):
                t[f"{i}.{j}.linear.weight"], t[f"{i}.{j}.linear.bias"] = w, b
            if version != "2":
                t[f"{i}.{num_layers}.weight"] = heads[i]
        cfg = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "version": version,
               "base_model_name_or_path": "tiny-target"}
        return _write(d, cfg, t, "medusa_lm_head.safetensors")
    if layout != "vllm" or version == "2":
        raise ValueError(f"layout {layout!r} with version {version!r} has no published form")
    for i in range(num_heads):
        for j, (w, b) in enumerate(blocks[i]):
            t[f"blocks.{i}.layers.{j}.weight"], t[f"blocks.{i}.layers.{j}.bias"] = w, b
        t[f"lm_heads.{i}.weight"] = heads[i]
    cfg = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": g.hidden,
           "vocab_size": g.vocab, "num_heads": num_heads, "num_hidden_layers": num_layers, "medusa_fc_bias": True}
    return _write(d, cfg, t)


def write_mlp_speculator(d, target, *, n_predict=3, inner_dim=96, seed=0, scale_input=True) -> Path:
    """IBM MLP speculator (vLLM mlp_speculator.py): emb.i, proj.i, head.i, ln.i.{weight,bias}; ln0 has no tensors."""
    g, r = geom(target), _Rand(seed)
    t = {}
    for i in range(n_predict):
        t[f"emb.{i}.weight"] = r.mat(g.vocab, inner_dim, np.sqrt(inner_dim))
        t[f"proj.{i}.weight"] = r.mat(inner_dim, g.hidden if i == 0 else inner_dim)
        t[f"head.{i}.weight"] = r.mat(g.vocab, inner_dim, 8.0)
        t[f"ln.{i}.weight"], t[f"ln.{i}.bias"] = r.norm(inner_dim), r.vec(inner_dim)
    cfg = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
           "vocab_size": g.vocab, "emb_dim": g.hidden, "inner_dim": inner_dim, "n_predict": n_predict,
           "top_k_tokens_per_head": [1] * n_predict, "n_candidates": 1, "tie_weights": False,
           "scale_input": scale_input}
    return _write(d, cfg, t)


def add_mtp_layers(target_dir, *, kind="deepseek", num_layers=1, seed=0) -> Path:
    """Add MTP layers to a saved tiny target (model.safetensors, rewritten in place).

    deepseek: model.layers.{L + k}.{enorm, hnorm, eh_proj, shared_head.{norm, head}, embed_tokens} + block.
    mimo: model.mtp_layers.{k}.{token_layernorm, hidden_layernorm, input_proj, final_layernorm} + block.
    """
    target_dir = Path(target_dir)
    cfg = json.loads((target_dir / "config.json").read_text())
    L = int(cfg["num_hidden_layers"])
    rope = cfg.get("rope_parameters") or {}
    g = Geom(cfg["hidden_size"], cfg["vocab_size"], L, cfg["num_attention_heads"],
             cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
             cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"], cfg["intermediate_size"],
             cfg.get("rms_norm_eps", 1e-6), float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)),
             cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)))
    r, h = _Rand(seed), g.hidden
    file = target_dir / "model.safetensors"
    t = dict(load_file(str(file)))
    for k in range(num_layers):
        if kind == "deepseek":
            p = f"model.layers.{L + k}."
            t.update({p + "enorm.weight": r.norm(h), p + "hnorm.weight": r.norm(h), p + "eh_proj.weight": r.mat(h, 2 * h),
                      p + "shared_head.norm.weight": r.norm(h), p + "shared_head.head.weight": r.mat(g.vocab, h, 8.0),
                      p + "embed_tokens.weight": t["model.embed_tokens.weight"].copy()})
        elif kind == "mimo":
            p = f"model.mtp_layers.{k}."
            t.update({p + "token_layernorm.weight": r.norm(h), p + "hidden_layernorm.weight": r.norm(h),
                      p + "input_proj.weight": r.mat(h, 2 * h), p + "final_layernorm.weight": r.norm(h)})
        else:
            raise ValueError(f"kind must be 'deepseek' or 'mimo', got {kind!r}")
        t.update(_layer(r, g, p, h, input_norm="input_layernorm.weight", qkv_bias=g.qkv_bias))
    save_file(t, str(file), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = num_layers
    (target_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    return target_dir


def write_block_head(d, target, *, kind="dflash", num_layers=2, block_size=8, layer_ids=(0, 1), mask_token_id=None,
                     sliding_window=0, markov_rank=8, seed=0, prefix="") -> Path:
    """DFlash (z-lab/dflash DFlashDraftModel: Qwen3 layers with q/k norms, fc [H, n*H], hidden_norm,
    norm; no embedding or LM head) or DSpark (the same plus markov_head.w{1,2} and confidence_head).

    `layer_ids` are written as z-lab does: the OUTPUT of target layer i (hidden_states[i + 1]).
    `sliding_window` > 0 makes the last layer a sliding_attention layer with that window.
    """
    g, r = geom(target), _Rand(seed)
    h = g.hidden
    mask = g.vocab - 1 if mask_token_id is None else mask_token_id
    t = {"fc.weight": r.mat(h, len(layer_ids) * h), "hidden_norm.weight": r.norm(h), "norm.weight": r.norm(h)}
    for i in range(num_layers):
        t.update(_layer(r, g, f"layers.{i}.", h, input_norm="input_layernorm.weight", qkv_bias=False))
        t[f"layers.{i}.self_attn.q_norm.weight"] = r.norm(g.head_dim)
        t[f"layers.{i}.self_attn.k_norm.weight"] = r.norm(g.head_dim)
    sub = {"mask_token_id": mask, "target_layer_ids": list(layer_ids), "block_size": block_size}
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": h,
           "intermediate_size": g.inter, "num_attention_heads": g.heads, "num_key_value_heads": g.kv_heads,
           "head_dim": g.head_dim, "num_hidden_layers": num_layers, "vocab_size": g.vocab, "rms_norm_eps": g.eps,
           "rope_theta": g.theta, "hidden_act": "silu", "max_position_embeddings": 512, "attention_bias": False,
           "num_target_layers": g.layers, "block_size": block_size, "dflash_config": sub, "tie_word_embeddings": False}
    if sliding_window:
        cfg["layer_types"] = ["full_attention"] * (num_layers - 1) + ["sliding_attention"]
        cfg["sliding_window"] = sliding_window
    if kind == "dspark":
        cfg["architectures"] = ["DSparkDraftModel"]
        cfg["dspark_config"] = {**cfg.pop("dflash_config"), "markov_rank": markov_rank, "markov_type": "vanilla",
                                "confidence": True}
        t["markov_head.w1.weight"] = r.mat(g.vocab, markov_rank, np.sqrt(markov_rank))
        t["markov_head.w2.weight"] = r.mat(g.vocab, markov_rank, 2.0)
        t["confidence_head.weight"] = r.mat(1, h + 1, 2.0)  # over [h, log p of the draft]
        t["confidence_head.bias"] = r.vec(1, 1.0)
    if prefix:
        t = {prefix + k: v for k, v in t.items()}
    return _write(d, cfg, t)


def feature_heads_v8(d, hf) -> dict:
    """EAGLE-1, EAGLE-3 (draft vocabulary 5, "input" layer ids), Medusa (3 heads), MLP speculator and
    FROZEN_KV_MTP heads for the V = 8 two-layer target of tests/test_loop_distribution.py."""
    d = Path(d)
    return {
        "eagle": write_eagle_head(d / "eagle", hf),
        # "input" ids [0, 1, 2]: the embeddings and the states entering layers 1 and 2 of the 2-layer target.
        "eagle3": write_eagle3_head(d / "eagle3", hf, draft_vocab_size=5, layer_ids=[0, 1, 2], convention="input"),
        "medusa": write_medusa_head(d / "medusa", hf, num_heads=3),
        "mlp_speculator": write_mlp_speculator(d / "mlp", hf, n_predict=3),
        # Both target layers' K/V, a reduced vocabulary of 5 (3 target tokens only from the residual).
        "frozen_kv_mtp": write_frozen_kv_head(d / "frozen_kv", hf, draft_vocab_size=5),
    }


def block_heads_v8(d, hf) -> dict:
    """DFLASH and DSPARK heads for the same target (output of layer 0: its last layer's HF hidden
    state is post-norm), and a falling SPS table that makes DSPARK's planner cut rows."""
    from tests.test_block_drafters import falling_table

    d = Path(d)
    return {
        "dflash": write_block_head(d / "dflash", hf, kind="dflash", block_size=4, layer_ids=(0,), mask_token_id=7),
        "dspark": write_block_head(d / "dspark", hf, kind="dspark", block_size=3, layer_ids=(0,), mask_token_id=7,
                                   markov_rank=4, seed=3),
        "table": falling_table(d / "falling.json"),
    }


def write_frozen_kv_head(d, target, *, seed=0, layer_ids=None, published=False, draft_vocab_size=0, hidden=None,
                         heads=None, sliding=False, window=3, centroids=0, centroid_top_k=4) -> Path:
    """FROZEN_KV_MTP in Gemma 4's assistant layout (HF gemma4_assistant): pre/post_projection, model.norm,
    model.layers.{i}.{input_layernorm, self_attn.q_proj, self_attn.q_norm, self_attn.o_proj,
    post_attention_layernorm, pre_feedforward_layernorm, mlp.*, post_feedforward_layernorm, layer_scalar}.

    `published`: Gemma4AssistantForCausalLM (GELU-tanh, query scale 1, embed scale sqrt(H), the LM head
    tied to model.embed_tokens); else jaxspec's FrozenKVMTPForCausalLM (SiLU, head_dim ** -0.5), with a
    reduced vocabulary (lm_head + d2t) when `draft_vocab_size`. `layer_ids` default: the last two target
    layers (one per draft layer); `sliding` makes the first draft layer a sliding-window one.
    `centroids` > 0: Gemma 4's centroid LM head (use_ordered_embeddings): masked_embedding.centroids
    [C, d] and a random token_ordering permutation, the best `centroid_top_k` clusters kept."""
    g, r = geom(target), _Rand(seed)
    ids = list(layer_ids if layer_ids is not None else [g.layers - 2, g.layers - 1][-min(2, g.layers):])
    d_model, nh = hidden or g.hidden, heads or g.heads
    q = nh * g.head_dim
    t = {"pre_projection.weight": r.mat(d_model, 2 * g.hidden), "post_projection.weight": r.mat(g.hidden, d_model),
         "model.norm.weight": r.norm(d_model)}
    for i in range(len(ids)):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": r.norm(d_model), p + "self_attn.q_proj.weight": r.mat(q, d_model),
                  p + "self_attn.o_proj.weight": r.mat(d_model, q), p + "post_attention_layernorm.weight": r.norm(d_model),
                  p + "pre_feedforward_layernorm.weight": r.norm(d_model),
                  p + "mlp.gate_proj.weight": r.mat(g.inter, d_model), p + "mlp.up_proj.weight": r.mat(g.inter, d_model),
                  p + "mlp.down_proj.weight": r.mat(d_model, g.inter),
                  p + "post_feedforward_layernorm.weight": r.norm(d_model),
                  p + "layer_scalar": np.asarray([0.5 + 0.5 * r.rng.random()], np.float32)})
        if published:
            t[p + "self_attn.q_norm.weight"] = r.norm(g.head_dim)
    types = ["sliding_attention" if (sliding and i == 0) else "full_attention" for i in range(len(ids))]
    text = {"model_type": "gemma4_text", "hidden_size": d_model, "intermediate_size": g.inter,
            "num_hidden_layers": len(ids), "num_attention_heads": nh, "num_key_value_heads": g.kv_heads,
            "head_dim": g.head_dim, "vocab_size": g.vocab, "rms_norm_eps": g.eps, "layer_types": types,
            "num_kv_shared_layers": len(ids), "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh" if published else "silu"}
    if sliding:
        text["sliding_window"] = window
    cfg = {"model_type": "gemma4_assistant" if published else "frozen_kv_mtp",
           "architectures": ["Gemma4AssistantForCausalLM" if published else "FrozenKVMTPForCausalLM"],
           "backbone_hidden_size": g.hidden, "use_ordered_embeddings": False, "text_config": text,
           "target_layer_ids": ids}
    if draft_vocab_size:
        used = np.sort(r.rng.choice(g.vocab, draft_vocab_size, replace=False))
        t["lm_head.weight"] = r.mat(draft_vocab_size, d_model, 8.0)
        t["d2t"] = (used - np.arange(draft_vocab_size)).astype(np.int64)
        cfg["draft_vocab_size"] = draft_vocab_size
    else:
        t["model.embed_tokens.weight"] = r.mat(g.vocab, d_model, 8.0)
    if centroids:
        t["masked_embedding.centroids.weight"] = r.mat(centroids, d_model, 8.0)
        t["masked_embedding.token_ordering"] = r.rng.permutation(g.vocab).astype(np.int64)
        cfg.update(use_ordered_embeddings=True, num_centroids=centroids, centroid_intermediate_top_k=centroid_top_k)
    return _write(d, cfg, t)
