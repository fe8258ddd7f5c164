"""Exact zero-padding of attention heads and MLP columns, so any tensor-parallel size fits any model.

Tensor parallelism gives each "model" shard whole heads and whole MLP columns,
so TP must divide the head counts and `intermediate_size`. SmolLM2-135M has 9
query and 3 KV heads: no TP > 1 divides both. Rather than refusing, the model
is grown by heads and columns whose weights are zero, which changes no logit:

* a padded KV head has zero k/v rows (and zero bias), so its keys and values
  are 0 (RMS-norm and RoPE keep 0 at 0);
* a padded query head has zero q rows and zero output-projection columns, so
  whatever it attends to, it adds exactly 0 to the residual stream;
* a padded MLP column has zero gate/up rows and zero down-projection columns:
  silu(0) * 0 = 0.

GQA grouping: query head h reads KV head h // group. Padding keeps `group`
and appends whole groups (KV heads K..K'-1 with their query heads
K*group..K'*group-1) at the end, so every original query head keeps its
original KV head, and a contiguous split of K' KV heads over TP shards lines
up with the split of K'*group query heads. Padding inside a group would not
help: the group is already whole on one shard.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxspec.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class HeadPadding:
    """What `padded_config` added; `none` when the model already divides."""

    tp: int
    heads: tuple[int, int]  # query heads (before, after)
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]

    @property
    def none(self) -> bool:
        return self.heads[0] == self.heads[1] and self.intermediate[0] == self.intermediate[1]

    def summary(self, what: str = "model") -> str:
        """One start-up line saying how many heads / columns were added and what they cost."""
        if self.none:
            return f"{what}: no padding needed for tensor-parallel size {self.tp}"
        parts = []
        if self.heads[0] != self.heads[1]:
            (h0, h1), (k0, k1) = self.heads, self.kv_heads
            parts.append(f"+{h1 - h0} query heads ({h0} -> {h1}) and +{k1 - k0} KV heads ({k0} -> {k1}), "
                         f"attention and KV cache x{k1 / k0:.2f}")
        if self.intermediate[0] != self.intermediate[1]:
            i0, i1 = self.intermediate
            parts.append(f"+{i1 - i0} MLP columns ({i0} -> {i1})")
        return (f"{what}: tensor-parallel size {self.tp} pads " + "; ".join(parts)
                + " (zero weights: outputs unchanged)")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def padded_config(cfg: ModelConfig, tp: int) -> tuple[ModelConfig, HeadPadding]:
    """The config whose head counts and MLP width TP divides, padded as little as the grouping allows."""
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {tp}")
    group = cfg.num_heads // cfg.num_kv_heads
    kv = _round_up(cfg.num_kv_heads, tp)
    inter = _round_up(cfg.intermediate_size, tp)
    padded = dataclasses.replace(cfg, num_kv_heads=kv, num_heads=kv * group, intermediate_size=inter)
    info = HeadPadding(tp=tp, heads=(cfg.num_heads, padded.num_heads), kv_heads=(cfg.num_kv_heads, kv),
                       intermediate=(cfg.intermediate_size, inter))
    return padded, info


def _pad_axis(x, axis: int, new: int):
    """Append zeros along `axis` up to length `new` (the identity when already there)."""
    extra = new - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def pad_params(params: dict, cfg: ModelConfig, padded: ModelConfig) -> dict:
    """Loaded (Hugging Face layout: [L, out, in] matrices) params of `cfg` -> params of `padded`.

    Appended rows/columns are zero, so original heads keep their indices (see the module doc)."""
    if padded == cfg:
        return params
    hd = cfg.head_dim
    q, kv, inter = padded.num_heads * hd, padded.num_kv_heads * hd, padded.intermediate_size
    # (new length, axis counted from the end) per leaf; norms and embeddings are untouched.
    plan = {"wq": (q, -2), "bq": (q, -1), "wk": (kv, -2), "bk": (kv, -1), "wv": (kv, -2), "bv": (kv, -1),
            "wo": (q, -1), "w_gate": (inter, -2), "w_up": (inter, -2), "w_down": (inter, -1)}
    layers = dict(params["layers"])
    for name, (new, axis) in plan.items():
        if name in layers:
            layers[name] = _pad_axis(layers[name], layers[name].ndim + axis, new)
    # A W8A16 checkpoint's own int8 matrices (models.compressed) are not padded: quantize = "int8"
    # then re-quantizes the padded float ones. GGUF blocks (quantize = "gguf") run unsharded only.
    return {**{k: v for k, v in params.items() if k not in ("int8", "gguf")}, "layers": layers}
