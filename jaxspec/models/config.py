"""Model configuration, parsed from a Hugging Face `config.json`.

One frozen dataclass covers the Llama family: Llama 2/3, SmolLM2, Mistral,
Qwen2/2.5 (qkv bias) and Qwen3 (q/k RMSNorm). Architecture differences are
flags, not subclasses, so one jitted forward serves them all.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class ConfigError(ValueError):
    """A model config that jaxspec cannot run; the message names the field."""


class LoadError(ValueError):
    """A model that cannot be loaded; the message names the file or tensor.

    Defined here, beside ConfigError, rather than in loading.py: gguf_convert
    raises it and loading imports gguf_convert, so it must live below both.
    `jaxspec.models.loading.LoadError` is the same class, re-exported.
    """


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    # "default" (none), "linear" or "llama3".
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2/2.5
    qk_norm: bool = False  # Qwen3
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        kind = None
        for a in archs:
            kind = SUPPORTED_ARCHITECTURES.get(a, kind)
        if kind is None and model_type in SUPPORTED_ARCHITECTURES.values():
            kind = model_type
        if kind is None:
            raise ConfigError(
                f"unknown architecture {archs or model_type!r}; jaxspec supports "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            layers = int(cfg["num_hidden_layers"])
            inter = int(cfg["intermediate_size"])
            vocab = int(cfg["vocab_size"])
        except KeyError as e:
            raise ConfigError(f"config.json is missing required field {e.args[0]!r}") from None
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ConfigError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        # transformers 5 moved rope settings into `rope_parameters`; older files
        # keep `rope_theta` + `rope_scaling` at top level. Accept both.
        rope_params = dict(cfg.get("rope_parameters") or {})
        legacy_scaling = cfg.get("rope_scaling") or {}
        theta = cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
        scaling_src = {**legacy_scaling, **rope_params}
        rope_type = scaling_src.get("rope_type") or scaling_src.get("type") or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise ConfigError(
                f"unsupported rope_scaling type {rope_type!r}; supported: default, linear, llama3"
            )
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(scaling_src.get("factor", 1.0)),
            low_freq_factor=float(scaling_src.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling_src.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                scaling_src.get("original_max_position_embeddings", 8192)
            ),
        )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=kind,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", kind == "qwen2")),
            qk_norm=kind == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(data)


# The params pytree as loaders produce it (Hugging Face layout). Jitted entry
# points take the runtime layout made from it by `models.llama.prepare_params`
# ([in, out] matrices, a separate `head`, optionally unstacked layers).
# Matrices keep the Hugging Face (out, in) layout: on XLA:CPU the contraction
# over the last (contiguous) axis is the fast, bandwidth-bound matrix-vector path.
#
#   embed       [vocab, hidden]
#   final_norm  [hidden]
#   lm_head     [vocab, hidden]                (absent when tie_word_embeddings)
#   layers:     every leaf stacked on a leading [num_layers] axis for lax.scan
#     attn_norm [L, hidden]
#     wq        [L, num_heads*head_dim, hidden]
#     wk, wv    [L, num_kv_heads*head_dim, hidden]
#     wo        [L, hidden, num_heads*head_dim]
#     bq        [L, num_heads*head_dim]        (qkv_bias only)
#     bk, bv    [L, num_kv_heads*head_dim]     (qkv_bias only)
#     q_norm    [L, head_dim]                  (qk_norm only)
#     k_norm    [L, head_dim]                  (qk_norm only)
#     mlp_norm  [L, hidden]
#     w_gate    [L, intermediate, hidden]
#     w_up      [L, intermediate, hidden]
#     w_down    [L, hidden, intermediate]
HF_LAYER_KEYS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


def layer_keys(cfg: ModelConfig) -> list[str]:
    keys = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    if cfg.qkv_bias:
        keys += ["bq", "bk", "bv"]
    if cfg.qk_norm:
        keys += ["q_norm", "k_norm"]
    return keys
