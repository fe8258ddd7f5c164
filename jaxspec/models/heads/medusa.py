"""Medusa heads (FasterDecoding/Medusa medusa_model.py; vLLM medusa.py) and their static trees.

Head i (0-based) reads the target's final-norm state at position t and predicts the token at
t + i + 2 (train_legacy.py: logits[i, :, :-(2 + i)] against labels[..., 2 + i:]):
  x = h;  x = x + SiLU(W_ij x + b_ij) for each of the head's ResBlocks;  logits_i = lm_head_i(x)
Version "2" heads have no LM head of their own and reuse the target's.

Two layouts are read: FasterDecoding's medusa_lm_head.safetensors ({i}.{j}.linear.weight/bias,
{i}.{L}.weight) and vLLM's (blocks.{i}.layers.{j}.weight/bias, lm_heads.{i}.weight).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxspec.models.config import LoadError
from jaxspec.models.heads.config import HeadConfig, runtime_matrix
from jaxspec.models.layers import linear

# Loaded params (HF layout): res_w [heads][layers] -> [H, H] (out, in); res_b [heads][layers] -> [H]
# (zeros when the checkpoint has no bias); lm_head [heads] -> [V, H] (version 1 only).


def read_medusa(t, cfg_json: dict, hcfg: HeadConfig) -> tuple[HeadConfig, dict]:
    h, v, n, L = hcfg.layer.hidden_size, hcfg.layer.vocab_size, hcfg.num_heads, hcfg.num_medusa_layers
    vllm = any(name.startswith("blocks.") for name in t.names)
    res_w, res_b, heads = [], [], []
    for i in range(n):
        ws, bs = [], []
        for j in range(L):
            w = f"blocks.{i}.layers.{j}." if vllm else f"{i}.{j}.linear."
            ws.append(t.get(w + "weight", (h, h)))
            bs.append(t.get(w + "bias", (h,)) if w + "bias" in t else jnp.zeros((h,), t.dtype))
        res_w.append(ws)
        res_b.append(bs)
        if vllm:
            # vLLM's `original_lm_head`: one head (lm_heads.0) serves every Medusa head.
            shared = bool(cfg_json.get("original_lm_head", False))
            name = "lm_heads.0.weight" if shared else f"lm_heads.{i}.weight"
        else:
            name = f"{i}.{L}.weight"
        if hcfg.medusa_version == "2":
            if name in t:
                raise LoadError(f"medusa config says version 2 (target LM head) but {t.where} has {name!r}")
        else:
            heads.append(t.get(name, (v, h)))
    params = {"res_w": res_w, "res_b": res_b}
    if heads:
        params["lm_head"] = heads
    return dataclasses.replace(hcfg, own_head=bool(heads)), params


def prepare_medusa_params(params: dict, hcfg: HeadConfig, *, native: bool = False) -> dict:
    out = {
        "res_w": [[runtime_matrix(w, native) for w in ws] for ws in params["res_w"]],
        "res_b": [[jnp.asarray(b) for b in bs] for bs in params["res_b"]],
    }
    if "lm_head" in params:
        out["heads"] = [runtime_matrix(w, native) for w in params["lm_head"]]
    return out


def medusa_logits(
    params: dict,  # runtime layout (prepare_head_params)
    hcfg: HeadConfig,
    shared: dict,  # the target's runtime params; "head" [H, V] is used by version-2 heads
    h: Float[Array, "B H"],  # target final-norm state
) -> Float[Array, "B NH V"]:
    out = []
    for i in range(hcfg.num_heads):
        x = h
        for w, b in zip(params["res_w"][i], params["res_b"][i]):
            x = x + jax.nn.silu(linear(x, w) + b.astype(x.dtype))
        head = params["heads"][i] if "heads" in params else shared["head"]
        out.append(linear(x, head).astype(jnp.float32))
    return jnp.stack(out, axis=1)


def medusa_tree_from_choices(choices) -> tuple[list[int], list[int], list[int]]:
    """A Medusa choices list -> (parents [N], ranks [N], depths [N]); node 0 = root (parent -1).

    Nodes follow Medusa's own order (utils.py generate_medusa_buffers: sorted by (depth, path)),
    so a parent always precedes its children. A node at depth d takes the rank-th most likely
    token of Medusa head d - 1; the root is the target's own next token.
    """
    paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda p: (len(p), p))
    index = {(): 0}
    parents, ranks, depths = [-1], [0], [0]
    for p in paths:
        if not p or any(r < 0 for r in p):
            raise ValueError(f"medusa choice {list(p)} must be a non-empty list of ranks >= 0")
        if p[:-1] not in index:
            raise ValueError(f"medusa choice {list(p)} has no parent {list(p[:-1])} in the list")
        index[p] = len(parents)
        parents.append(index[p[:-1]])
        ranks.append(p[-1])
        depths.append(len(p))
    return parents, ranks, depths
