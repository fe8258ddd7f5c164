"""HeadConfig: one frozen description of a draft head, parsed from its config.json.

Format detection is by config fields only (the loader then checks the tensors), and parsing is
each family's own (`jaxspec.models.heads.family`). Captured-layer ids are normalised to one
convention, "state entering layer k" (k in [0, L]); checkpoints are written in two
(`feature_layers_from`).

One flat frozen struct for every family, not one per family: it is a static argument of every
jitted step, the drafters read it directly, and the fields a family does not use keep their
defaults (grouped below by family).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.models.config import ConfigError, ModelConfig

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
    # FROZEN_KV_MTP (jaxspec.models.heads.frozen_kv): per draft layer, the target layer whose cached
    # K/V it attends to (read-only); the MLP activation and the query scale (Gemma 4: 1.0, its keys
    # and queries are RMS-normed; a Llama target's are not: head_dim ** -0.5).
    target_kv_layers: tuple[int, ...] = ()
    hidden_act: str = "silu"
    query_scale: float = 0.0
    # Gemma 4's centroid LM head (`use_ordered_embeddings`): score `num_centroids` clusters, keep the
    # best `centroid_top_k`, and score only their tokens (0: the dense head).
    num_centroids: int = 0
    centroid_top_k: int = 0

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


def layer_config(cfg: dict, target: ModelConfig) -> ModelConfig:
    """The head's own decoder-layer geometry; RoPE comes from the head's config, not the target's."""
    fixed = {**cfg, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    fixed.setdefault("vocab_size", target.vocab_size)
    layer = ModelConfig.from_hf_dict(fixed)
    # EAGLE's cnets1 reads `qkv_bias`; SpecForge/vLLM `attention_bias`.
    bias = bool(cfg.get("qkv_bias", cfg.get("attention_bias", False)))
    return dataclasses.replace(layer, num_layers=1, qkv_bias=bias, qk_norm=False)


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default captured layers (state entering layer k), as the heads' config reads them."""
    return (2, num_layers // 2, num_layers - 3)


def check_equal(what: str, head: int, target: int) -> None:
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
    """The HeadConfig of a head directory's config.json, parsed by the family of its kind."""
    from jaxspec.models.heads.family import detect_format, family_of

    if aux_layer_convention not in CONVENTIONS:
        raise ConfigError(f"aux_layer_convention must be one of {CONVENTIONS}, got {aux_layer_convention!r}")
    kind = detect_format(config_json)
    return family_of(kind).parse(kind, config_json, target_cfg, aux_layer_convention)
