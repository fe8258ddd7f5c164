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
import numpy as np
from jaxtyping import Array, Float

from jaxspec.models.config import ConfigError, LoadError
from jaxspec.models.heads.config import HeadConfig, check_equal, runtime_matrix
from jaxspec.models.heads.family import HeadFamily, archs, register_family, to_np
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


# ---- the family: format both ways, fresh heads, the training recipe's init -------------------------


def detect(cfg: dict) -> str | None:
    return "medusa" if (cfg.get("model_type") == "medusa" or "medusa_num_heads" in cfg or "medusa" in archs(cfg)) \
        else None


def parse(kind: str, cfg: dict, t, convention: str) -> HeadConfig:
    heads = int(cfg.get("medusa_num_heads") or cfg.get("num_heads") or 0)
    layers = int(cfg.get("medusa_num_layers") or cfg.get("num_hidden_layers") or 1)
    if heads <= 0:
        raise ConfigError("medusa config.json has no medusa_num_heads / num_heads")
    for what, key in (("hidden_size", "hidden_size"), ("vocab_size", "vocab_size")):
        # FasterDecoding's config carries neither (they are the base model's); vLLM's has both.
        if key in cfg and cfg.get("model_type") == "medusa":
            check_equal(what, int(cfg[key]), getattr(t, key))
    trunc = cfg.get("truncated_vocab_size")
    if trunc is not None and int(trunc) != t.vocab_size:
        raise ConfigError(f"medusa truncated_vocab_size {trunc} != target vocab_size {t.vocab_size}: "
                          "token_map heads are not supported")
    return HeadConfig(kind=kind, layer=dataclasses.replace(t, num_layers=1), target_hidden_size=t.hidden_size,
                      draft_vocab_size=t.vocab_size, num_heads=heads, num_medusa_layers=layers,
                      medusa_version=str(cfg.get("version", "1")), own_head=True)


def fresh(kind: str, target, *, num_heads: int = 4, medusa_head: str = "own", **_) -> HeadConfig:
    """`medusa_head`: "own" LM heads (version 1) or "target" (version 2: the target's is reused)."""
    layer = dataclasses.replace(target, num_layers=1, qk_norm=False, qkv_bias=False)
    own = medusa_head != "target"
    return HeadConfig(kind=kind, layer=layer, target_hidden_size=target.hidden_size,
                      draft_vocab_size=target.vocab_size, num_heads=num_heads, own_head=own,
                      medusa_version="1" if own else "2")


def init(hcfg: HeadConfig, seed: int, token_ids=None) -> dict:
    rng = np.random.default_rng(seed)
    h, v, n = hcfg.layer.hidden_size, hcfg.layer.vocab_size, hcfg.num_heads
    mat = lambda out, inp, gain: (rng.standard_normal((out, inp)) * gain / np.sqrt(inp)).astype(np.float32)  # noqa: E731
    return {"res_w": [[mat(h, h, 0.1)] for _ in range(n)], "res_b": [[np.zeros(h, np.float32)] for _ in range(n)],
            "lm_head": [mat(v, h, 4.0) for _ in range(n)]}


def train_init(p: dict, hcfg: HeadConfig, shared: dict, seed: int, draft_ids=None, head_init: str = "random") -> dict:
    """Medusa's own init: every head's LM head a copy of the target's, ResBlocks at zero (so each head
    starts as the target's next-token prediction)."""
    head = np.asarray(shared["head"], np.float32)  # [H, V]
    if hcfg.own_head:
        p["lm_head"] = [jnp.asarray(head.T) for _ in p["lm_head"]]
    else:
        del p["lm_head"]
    p["res_w"] = [[jnp.zeros_like(w) for w in ws] for ws in p["res_w"]]
    return p


def write(params: dict, hcfg: HeadConfig, *, base_model: str = "", **_) -> tuple[dict, dict, str]:
    """FasterDecoding's layout: medusa_lm_head.safetensors ({i}.{j}.linear.*, {i}.{L}.weight)."""
    n, L = len(params["res_w"]), len(params["res_w"][0])
    t = {}
    for i in range(n):
        for j in range(L):
            t[f"{i}.{j}.linear.weight"] = to_np(params["res_w"][i][j])
            t[f"{i}.{j}.linear.bias"] = to_np(params["res_b"][i][j])
        if "lm_head" in params:
            t[f"{i}.{L}.weight"] = to_np(params["lm_head"][i])
    cfg = {"medusa_num_heads": n, "medusa_num_layers": L, "base_model_name_or_path": base_model,
           "hidden_size": hcfg.hidden_size, "vocab_size": hcfg.layer.vocab_size}
    if "lm_head" not in params:
        cfg["version"] = "2"
    return cfg, t, "medusa_lm_head.safetensors"


FAMILY = register_family(HeadFamily(
    "medusa", ("medusa",), detect, parse, read=lambda t, cfg, hcfg, target: read_medusa(t, cfg, hcfg), tensor_prefix="medusa_heads.", fresh=fresh, init=init,
    write=write, train_init=train_init, loss="jaxspec.train.losses:medusa_loss"))
