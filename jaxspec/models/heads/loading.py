"""Load draft heads from safetensors (numpy; no torch) into the HF-layout params of each head module.

`load_draft_head` reads a head directory through its family's `read` (`family.py`);
`load_mtp_head` reads the MTP layers stored inside a target checkpoint. Every mismatch is a
one-line ConfigError / LoadError naming both sides, or the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxspec.models.config import ConfigError, LoadError, ModelConfig
from jaxspec.models.heads.config import HeadConfig, parse_head_config
from jaxspec.models.heads.family import LAYER_TENSORS, family_of
from jaxspec.models.loading import checkpoint_files


@dataclasses.dataclass
class LoadedHead:
    config: HeadConfig
    params: dict  # HF layout; prepare_head_params makes the runtime layout
    path: Path


class _Tensors:
    """Name -> file over one or more safetensors files, read lazily with shape checks."""

    def __init__(self, files: dict[str, Path], where: Path, dtype: Any):
        self.files, self.where, self.dtype = files, where, np.dtype(dtype)
        self._handles: dict[Path, Any] = {}

    @property
    def names(self) -> set[str]:
        return set(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def raw(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        from safetensors import safe_open

        if name not in self.files:
            raise LoadError(f"draft head checkpoint {self.where} is missing tensor {name!r}")
        file = self.files[name]
        try:
            if file not in self._handles:
                self._handles[file] = safe_open(str(file), framework="numpy")
            got = tuple(self._handles[file].get_slice(name).get_shape())
            if shape is not None and got != tuple(shape):
                raise LoadError(f"tensor {name!r} in {self.where} has shape {list(got)}, the head expects "
                                f"{list(shape)} (draft head and target disagree)")
            return self._handles[file].get_tensor(name)
        except LoadError:
            raise
        except Exception as e:  # safetensors' own errors: a truncated or corrupted file
            raise LoadError(f"draft head file {file}: cannot read tensor {name!r} ({type(e).__name__}: {e}); "
                            "the file is truncated or corrupted") from None

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> jnp.ndarray:
        x = self.raw(name, shape)
        if x.dtype.kind == "f" or x.dtype.name == "bfloat16":
            if not np.isfinite(np.asarray(x, np.float32)).all():
                raise LoadError(f"draft head file {self.files[name]}: tensor {name!r} holds NaN or Inf")
        return jnp.asarray(x.astype(self.dtype, copy=False))


def _head_files(path: Path) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for f in sorted(path.glob("*.safetensors")):
        from safetensors import safe_open

        try:
            with safe_open(str(f), framework="numpy") as h:
                for name in h.keys():
                    files.setdefault(name, f)
        except Exception as e:  # a truncated file or a corrupted header
            raise LoadError(f"draft head file {f}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if not files:
        other = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {other}: convert them to safetensors; torch files are not read)" if other else ""
        raise LoadError(f"no *.safetensors files in draft head directory {path}{hint}")
    return files


def _strip_prefix(files: dict[str, Path], prefix: str) -> dict[str, Path]:
    # Some exporters write "model." before everything but lm_head; names are matched bare.
    body = [n for n in files if not n.startswith("lm_head")]
    if body and all(n.startswith(prefix) for n in body):
        return {(n[len(prefix):] if n.startswith(prefix) else n): f for n, f in files.items()}
    return files


def _read_config(path: Path) -> dict:
    if not path.exists():
        raise ConfigError(f"draft head directory {path} does not exist")
    if not path.is_dir():
        raise ConfigError(f"draft head {path} is not a directory (a head is a directory with config.json and "
                          "*.safetensors)")
    try:
        return json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config.json in draft head directory {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path / 'config.json'} is not valid JSON: {e}") from None


def _layer_shapes(c: ModelConfig, w_in: int) -> dict[str, tuple[int, ...]]:
    d, i, q, kv, hd = c.hidden_size, c.intermediate_size, c.q_size, c.kv_size, c.head_dim
    return {"wq": (q, w_in), "wk": (kv, w_in), "wv": (kv, w_in), "wo": (d, q), "bq": (q,), "bk": (kv,),
            "bv": (kv,), "q_norm": (hd,), "k_norm": (hd,), "mlp_norm": (d,), "w_gate": (i, d), "w_up": (i, d),
            "w_down": (d, i)}


def read_layer(t: _Tensors, prefix: str, c: ModelConfig, w_in: int) -> dict:
    keys = ["wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    keys += ["bq", "bk", "bv"] if c.qkv_bias else []
    keys += ["q_norm", "k_norm"] if c.qk_norm else []
    shapes = _layer_shapes(c, w_in)
    return {k: t.get(prefix + LAYER_TENSORS[k], shapes[k]) for k in keys}


def check_embed(t: _Tensors, name: str, hcfg: HeadConfig, target: ModelConfig, params: dict) -> HeadConfig:
    """An own embedding if the checkpoint has one; otherwise the target's, whose width must fit."""
    h = hcfg.layer.hidden_size
    if name in t:
        params["embed"] = t.get(name, (target.vocab_size, h))
        return dataclasses.replace(hcfg, own_embed=True)
    if h != target.hidden_size:
        raise LoadError(f"draft head hidden_size {h} != target hidden_size {target.hidden_size} and the head has "
                        f"no {name!r} of its own to embed tokens with")
    return hcfg


def load_draft_head(path, target_cfg: ModelConfig, *, aux_layer_convention: str = "output",
                    dtype=jnp.float32) -> LoadedHead:
    path = Path(path)
    cfg_json = _read_config(path)
    hcfg = parse_head_config(cfg_json, target_cfg, aux_layer_convention=aux_layer_convention)
    family = family_of(hcfg.kind)
    if family.read is None:
        raise ConfigError(f"{path}: {hcfg.kind} heads are parsed but not read from a head directory")
    t = _Tensors(_strip_prefix(_head_files(path), "model."), path, dtype)
    if family.tensor_prefix:
        t.files = _strip_prefix(t.files, family.tensor_prefix)
    hcfg, params = family.read(t, cfg_json, hcfg, target_cfg)
    return LoadedHead(config=hcfg, params=params, path=path)


# --------------------------------------------------------------------------- #
# MTP layers inside a target checkpoint
# --------------------------------------------------------------------------- #

_MIMO = re.compile(r"^model\.mtp_layers\.(\d+)\.")


def _mtp_names(target_dir: Path, target_cfg: ModelConfig | None = None) -> tuple[str | None, dict[str, Path]]:
    files = checkpoint_files(target_dir)
    if any(_MIMO.match(n) for n in files):
        return "mtp_mimo", files
    L = target_cfg.num_layers if target_cfg is not None else _num_layers(target_dir)
    if f"model.layers.{L}.eh_proj.weight" in files:
        return "mtp_deepseek", files
    return None, files


def _num_layers(target_dir: Path) -> int:
    return int(json.loads((Path(target_dir) / "config.json").read_text())["num_hidden_layers"])


def load_mtp_head(target_dir, target_cfg: ModelConfig, *, layer: int = 0, dtype=jnp.float32) -> LoadedHead:
    """MTP layer `layer` of a target checkpoint (DeepSeek-style or MiMo), Llama/Qwen2 blocks, no MoE."""
    target_dir = Path(target_dir)
    kind, files = _mtp_names(target_dir, target_cfg)
    if kind is None:
        raise LoadError(f"{target_dir} has no MTP layers: neither model.layers.{target_cfg.num_layers}.eh_proj "
                        "(DeepSeek) nor model.mtp_layers.N.* (MiMo) tensors")
    c = dataclasses.replace(target_cfg, num_layers=1)
    hcfg = HeadConfig(kind=kind, layer=c, target_hidden_size=c.hidden_size, draft_vocab_size=c.vocab_size)
    t = _Tensors(files, target_dir, dtype)
    h = c.hidden_size
    if kind == "mtp_deepseek":
        pre = f"model.layers.{target_cfg.num_layers + layer}."
        if pre + "eh_proj.weight" not in t:
            raise LoadError(f"{target_dir} has no DeepSeek MTP layer {layer} (no {pre}eh_proj.weight)")
        if any(n.startswith(pre + "mlp.experts.") for n in t.names):
            raise LoadError(f"{target_dir}: MTP layer {layer} is a MoE block, which is not supported")
        names = {"fc": "eh_proj.weight", "enorm": "enorm.weight", "hnorm": "hnorm.weight",
                 "norm": "shared_head.norm.weight"}
        head_name, embed_name = pre + "shared_head.head.weight", pre + "embed_tokens.weight"
    else:
        pre = f"model.mtp_layers.{layer}."
        if pre + "input_proj.weight" not in t:
            raise LoadError(f"{target_dir} has no MiMo MTP layer {layer} (no {pre}input_proj.weight)")
        names = {"fc": "input_proj.weight", "enorm": "token_layernorm.weight", "hnorm": "hidden_layernorm.weight",
                 "norm": "final_layernorm.weight"}
        head_name = embed_name = None  # MiMo uses the target's embedding and LM head (vllm mimo_mtp.py)
    shapes = {"fc": (h, 2 * h), "enorm": (h,), "hnorm": (h,), "norm": (h,)}
    params = {k: t.get(pre + n, shapes[k]) for k, n in names.items()}
    params["attn_norm"] = t.get(pre + "input_layernorm.weight", (h,))
    params.update(read_layer(t, pre, c, h))
    if head_name and head_name in t:
        params["lm_head"] = t.get(head_name, (c.vocab_size, h))
        hcfg = dataclasses.replace(hcfg, own_head=True)
    if embed_name and embed_name in t:
        params["embed"] = t.get(embed_name, (c.vocab_size, h))
        hcfg = dataclasses.replace(hcfg, own_embed=True)
    return LoadedHead(config=hcfg, params=params, path=target_dir)
