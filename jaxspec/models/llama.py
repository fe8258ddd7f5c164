"""The Llama-family decoder as a pure function over the params pytree.

Layers are stacked and run under `lax.scan`, so compile time does not grow with
depth. The KV cache rides in the scan carry and is updated in place; the caller
donates it to the jitted step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxspec.cache.attention import attention_with_block_ref, paged_attention
from jaxspec.cache.paged import KVCache, slot_to_page, write_layer_kv
from jaxspec.models.config import LoadError, ModelConfig
from jaxspec.models.layers import apply_rope, linear, rms_norm, rope_inv_freq, rope_tables
from jaxspec.native.block_matmul import BlockWeight
from jaxspec.native.packed_matmul import PackedWeight, pack_weight, quantize_int8
from jaxspec.native.paged_attention import MAX_QUERIES, paged_attention_native


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardOutput:
    logits: jax.Array  # [B, K, V] at the requested positions (K = T when all)
    cache: KVCache
    # Captured hidden states at every block position [B, T, F], when asked for:
    # the residual stream entering each of `capture_layers`, then (with
    # capture_final) the final-norm state, concatenated on the last axis.
    features: jax.Array | None = None
    # With write_cache=False: the block's K and V per layer, each [L, B, T, kvh, hd].
    new_kv: tuple[jax.Array, jax.Array] | None = None


def _attention_block(cfg, lp, x, cos, sin, cache_k, cache_v, layer, pages, offsets, attn_args, write_cache=True):
    """One layer's attention: project, rotate, write K/V, attend over the paged cache.

    Returns (output, cache_k, cache_v, (k, v) of the block)."""
    b, t, _ = x.shape
    if "wqkv" in lp:  # native CPU params: one kernel call streams all three projections
        q, k, v = jnp.split(linear(x, lp["wqkv"]), [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
    else:
        q, k, v = linear(x, lp["wq"]), linear(x, lp["wk"]), linear(x, lp["wv"])
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
    k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    page_table, q_start, kv_len, tree_mask = attn_args
    if write_cache:
        cache_k, cache_v = write_layer_kv(cache_k, cache_v, layer, pages, offsets, k, v)
    if isinstance(lp["wo"], (PackedWeight, BlockWeight)) and t <= MAX_QUERIES:
        # Native CPU params: attention reads the whole cache in place (no per-layer
        # slice copy); without a cache write it reads the block's K/V directly.
        block = {} if write_cache else dict(k_block=k, v_block=v)
        out = paged_attention_native(
            q, cache_k, cache_v, layer, page_table, q_start, kv_len if write_cache else q_start + t, tree_mask,
            scale=cfg.head_dim**-0.5, **block,
        )
    elif write_cache:
        out = paged_attention(
            q, cache_k[layer], cache_v[layer], page_table, q_start, kv_len, tree_mask,
            scale=cfg.head_dim**-0.5,
        )
    else:
        out = attention_with_block_ref(
            q, cache_k[layer], cache_v[layer], page_table, q_start, k, v, tree_mask, scale=cfg.head_dim**-0.5,
        )
    return linear(out.reshape(b, t, cfg.q_size), lp["wo"]), cache_k, cache_v, (k, v)


def forward(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,  # [B, T] int32
    positions: jax.Array,  # [B, T] int32 RoPE positions (tree nodes share depth positions)
    cache: KVCache,
    page_table: jax.Array,  # [B, max_pages] int32
    q_start: jax.Array,  # [B] int32 cache slot of tokens[:, 0]
    kv_len: jax.Array,  # [B] int32 = q_start + number of valid tokens in the block
    tree_mask: jax.Array | None = None,  # [B, T, T] bool; None = causal block
    logits_index: jax.Array | None = None,  # [B, K] int32 positions to project; None = all
    capture_layers: tuple[int, ...] = (),
    capture_final: bool = False,
    write_cache: bool = True,
) -> ForwardOutput:
    """Run the decoder over a block of T new tokens per sequence.

    Token t of sequence b is written to cache slot q_start[b] + t; tokens at or past
    kv_len[b] are padding and write to the null page. With write_cache=False the
    cache is only read (the block attends to itself directly) and the block's
    K/V come back in `new_kv` for the caller to write (jnp attention only).
    `capture_layers` (state entering layer k, k in [0, L]) and `capture_final`
    return features for drafters that read the target's hidden states, at all
    T positions whatever `logits_index` is: a prefill needs every position's.
    """
    if "head" not in params:
        raise ValueError("forward() needs runtime params: call prepare_params(params, cfg) on loaded weights")
    b, t = tokens.shape
    # 1. Embedding and RoPE tables, shared by every layer.
    x = params["embed"][tokens]
    cos, sin = rope_tables(positions, rope_inv_freq(cfg))
    slots = q_start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    pages, offsets = slot_to_page(page_table, slots, cache.page_size)
    # Padding tokens write to the null page, never over a live slot.
    pages = jnp.where(slots < kv_len[:, None], pages, 0)
    attn_args = (page_table, q_start, kv_len, tree_mask)
    for k in capture_layers:
        if not 0 <= k <= cfg.num_layers:
            raise ValueError(f"capture layer {k} is outside [0, {cfg.num_layers}] for a {cfg.num_layers}-layer model")
    # Entering layer k = output of layer k - 1; only those outputs leave the scan.
    want_out = sorted({k - 1 for k in capture_layers if k >= 1})
    want = jnp.array(want_out, jnp.int32) if want_out else None

    # 2. The decoder stack under lax.scan; the cache is part of the carry.
    def layer_step(carry, xs):
        h, ck, cv = carry
        lp, layer = xs
        a, ck, cv, kv = _attention_block(
            cfg, lp, rms_norm(h, lp["attn_norm"], cfg.rms_norm_eps), cos, sin, ck, cv,
            layer, pages, offsets, attn_args, write_cache,
        )
        h = h + a
        m = rms_norm(h, lp["mlp_norm"], cfg.rms_norm_eps)
        if "w_gate_up" in lp:
            gate, up = jnp.split(linear(m, lp["w_gate_up"]), 2, axis=-1)
        else:
            gate, up = linear(m, lp["w_gate"]), linear(m, lp["w_up"])
        h = h + linear(jax.nn.silu(gate) * up, lp["w_down"])
        return (h, ck, cv), (h if want is not None else None, None if write_cache else kv)

    x_embed = x

    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        # Unstacked layers (see `unstack_layers`): a Python loop with static
        # layer indices, so each weight is its own buffer fed straight to the dot.
        carry, outs = (x, cache.k, cache.v), []
        for i, lp in enumerate(layers):
            carry, ys = layer_step(carry, (lp, i))
            outs.append(ys)
        (x, ck, cv) = carry
        per_layer, new_kv = jax.tree.map(lambda *xs: jnp.stack(xs), *outs) if outs else (None, None)
    else:
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, ck, cv), (per_layer, new_kv) = jax.lax.scan(layer_step, (x, cache.k, cache.v), (layers, layer_ids))

    # 3. Captured features (every position), then the final norm and LM head
    #    only at the positions the caller needs.
    feats = []
    if want is not None:
        picked = per_layer[want]
        outs_by_layer = {k: picked[i] for i, k in enumerate(want_out)}
    for k in capture_layers:
        feats.append(x_embed if k == 0 else outs_by_layer[k - 1])
    if capture_final:
        feats.append(rms_norm(x, params["final_norm"], cfg.rms_norm_eps))
    if logits_index is not None:
        x = jnp.take_along_axis(x, logits_index[:, :, None], axis=1)
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    logits = linear(x, params["head"]).astype(jnp.float32)
    return ForwardOutput(
        logits=logits,
        cache=KVCache(k=ck, v=cv),
        features=jnp.concatenate(feats, axis=-1) if feats else None,
        new_kv=new_kv,
    )


MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def default_unstack() -> bool:
    """Unstacked layers pay off on XLA:CPU (see `prepare_params`); scan elsewhere."""
    return jax.default_backend() == "cpu"


def prepare_params(params: dict, cfg: ModelConfig, *, unstack: bool | None = None, native: bool = False,
                   quantize: str = "none") -> dict:
    """Loaded (Hugging Face layout, stacked) params -> the runtime layout `forward` reads.

    * Matrices become [in, out] and the LM head a separate `head` [hidden, vocab]
      (a transposed copy of the embedding when tied): `x @ W` is the faster
      contraction on XLA:CPU for multi-row shapes and the usual layout on TPU.
    * With `unstack` (default on CPU) the layers become a list of per-layer
      dicts run by a Python loop instead of `lax.scan`. On XLA:CPU a scan slices
      each layer's weights out of the stack with a dynamic-slice that is copied
      before every dot, which costs ~1.6x per forward (measured 45 -> 28 ms at
      T=1, 90 -> 56 ms at T=8 on SmolLM2). The price is compile time that grows
      with depth (~0.5 s -> ~4 s for 30 layers).
    * With `native` (XLA:CPU, float32; see `jaxspec.native.build.use_native_kernels`)
      every matrix and the LM head become `PackedWeight` column tiles for the
      native matmul, so a verify block or batch of up to ~8 rows costs about one
      row's weight traffic; packed weights also route short-block attention to
      the native paged-attention kernel (`_attention_block`). Q, K and V become one
      `wqkv` and gate and up one `w_gate_up`, as vLLM's fused QKV / gate-up linears:
      each kernel call has a fixed cost (thread wake-up, a pass over x), and a
      layer makes 4 calls instead of 7. Every column's sum is unchanged, bit for bit.
    * With `quantize = "int8"` every matrix and the LM head are weight-only int8 with a float32
      scale per output column (`native.packed_matmul.quantize_int8`): packed int8 tiles with
      `native`, else `layers.Int8Weight` for XLA's dot. A W8A16 checkpoint's own int8 weights
      (`params["int8"]`, `models.compressed`) are used as they are, not quantized again.
    * With `quantize = "gguf"` (native only) every matrix, and the LM head when the GGUF stores it
      in blocks, computes on the GGUF's own Q4_0 / Q4_1 / Q8_0 blocks (`params["gguf"]`, from
      `load_model(..., gguf_blocks=True)`; `native.block_matmul`). The embedding lookup stays float32.
    """
    if "head" in params:
        return params
    if quantize not in ("none", "int8", "gguf"):
        raise ValueError(f"quantize must be none, int8 or gguf, got {quantize!r}")
    if quantize == "gguf" and not native:
        raise LoadError("engine.quantize = gguf runs on the native CPU kernels only (float32, one CPU device, "
                         "engine.cpu_kernels auto or native); use int8 elsewhere")
    if quantize == "gguf" and "gguf" not in params:
        raise LoadError("engine.quantize = gguf computes on a GGUF file's own blocks, and this model was not "
                         "loaded from a GGUF (use int8)")
    if quantize == "gguf":  # the block type names are for people, not for the program
        params = {**params, "gguf": {k: v for k, v in params["gguf"].items() if k != "types"}}
    else:  # blocks loaded but not asked for stay on the host
        params = {k: v for k, v in params.items() if k != "gguf"}
    unstack = default_unstack() if unstack is None else unstack
    # One jitted program, not ~600 eager ops (swaps, pads, 30 x 9 layer slices): 4.5 s of every
    # CLI start went to dispatching them; the program comes from the persistent compilation cache.
    return _prepare(params, cfg.tie_word_embeddings, cfg.num_layers, unstack, native, quantize)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _prepare(params: dict, tie: bool, num_layers: int, unstack: bool, native: bool, quantize: str) -> dict:
    int8 = quantize == "int8"
    layers = {k: (jnp.swapaxes(v, -1, -2) if k in MATRICES else v) for k, v in params["layers"].items()}
    head = params["embed"] if tie else params["lm_head"]
    out = {"embed": params["embed"], "final_norm": params["final_norm"], "head": jnp.asarray(head.T)}
    fused = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}
    if quantize == "gguf":  # (q, d, m) [L, N, ...] in row order: fused by concatenating rows, then tiled
        from jaxspec.native.block_matmul import pack_blocks

        blocks = dict(params["gguf"]["layers"])
        for name, parts in fused.items():
            fuse = [blocks.pop(k) for k in parts]
            blocks[name] = tuple(None if x[0] is None else jnp.concatenate(x, axis=-2) for x in zip(*fuse))
        layers = {k: v for k, v in layers.items() if k not in MATRICES}
        layers.update({k: pack_blocks(*v) for k, v in blocks.items()})
        own = params["gguf"].get("embed" if tie else "lm_head")
        out["head"] = pack_blocks(*own) if own is not None else out["head"]
    if int8:  # (q [..., in, out], scale [..., out]) per matrix: the checkpoint's own, else quantized here
        pre = params.get("int8", {})
        own = lambda k: (jnp.swapaxes(pre[k][0], -1, -2), pre[k][1])  # noqa: E731
        layers = {k: (own(k) if k in pre else quantize_int8(v)) if k in MATRICES else v for k, v in layers.items()}
        out["head"] = own("lm_head") if "lm_head" in pre and not tie else quantize_int8(out["head"])
    if native and quantize != "gguf":
        for name, parts in fused.items():  # int8: per-column scales concatenate with their columns
            fuse = [layers.pop(k) for k in parts]
            layers[name] = (tuple(jnp.concatenate(x, axis=-1) for x in zip(*fuse)) if int8
                            else jnp.concatenate(fuse, axis=-1))
        layers = {k: (pack_weight(v, int8) if k in MATRICES + tuple(fused) else v) for k, v in layers.items()}
    if native and isinstance(out["head"], (jax.Array, tuple)):  # not GGUF blocks already
        out["head"] = pack_weight(out["head"], int8)
    elif int8:
        from jaxspec.models.layers import Int8Weight

        layers = {k: (Int8Weight(*v) if k in MATRICES else v) for k, v in layers.items()}
        out["head"] = Int8Weight(*out["head"])
    if unstack:
        out["layers"] = [jax.tree.map(lambda x, i=i: x[i], layers) for i in range(num_layers)]
    else:
        out["layers"] = layers
    return out
