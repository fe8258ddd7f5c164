"""Convert a GGUF file into a float32 Hugging Face directory.

jaxspec runs float32/bfloat16 weights, so a quantized GGUF is dequantized once
and cached as an ordinary HF checkpoint (`config.json`, `model.safetensors`,
tokenizer files). Everything downstream -- jaxspec's loader, and transformers
as an independent reference -- then reads one format.

No torch here: dequantization is the `gguf` package's numpy code, and the
tokenizer is built with transformers' torch-free GGUF tokenizer converter.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from jaxspec.models.config import LoadError

# GGUF `general.architecture` -> (HF architecture, HF model_type). llama.cpp
# writes Mistral as "llama" too; LlamaForCausalLM runs those weights unchanged.
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# Only llama.cpp's LlamaModel converter permutes q/k rows (for its rope
# kernel); its Qwen2/Qwen3 converters write the HF layout as is.
_PERMUTED_QK_ARCHS = {"llama"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


# --------------------------------------------------------------------------- #
# Small pure helpers
# --------------------------------------------------------------------------- #


def hf_tensor_name(gguf_name: str) -> str:
    """The HF state-dict name for a GGUF tensor name."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}"
    if gguf_name == "rope_freqs.weight":
        # llama.cpp bakes Llama-3.1 rope scaling into this tensor; the HF
        # llama3 parameters cannot be recovered from it exactly.
        raise LoadError(
            "GGUF tensor 'rope_freqs.weight' (llama3 rope scaling) is not supported; "
            "load the Hugging Face checkpoint instead"
        )
    raise LoadError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent known to jaxspec")


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (works for weights and biases).

    llama.cpp interleaves the two rotary halves of each head
    (`reshape(n, 2, d/2, ...).swapaxes(1, 2)`); this is the inverse.
    """
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _short_float(x: float) -> float:
    # GGUF stores float32: 1e-5 arrives as 9.999999747e-06. Print the shortest
    # float32 repr so config.json says 1e-05 like the original.
    return float(np.format_float_scientific(np.float32(x), unique=True))


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every scalar/string/array field of a GGUFReader as plain Python values."""
    return {key: field.contents() for key, field in reader.fields.items()}


def hf_config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """A HF `config.json` dict from GGUF metadata (llama.cpp's key names)."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise LoadError(
            f"unknown GGUF architecture {arch!r}; jaxspec converts {sorted(GGUF_ARCHITECTURES)}"
        )
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]

    def need(key: str) -> Any:
        full = f"{arch}.{key}"
        if full not in meta:
            raise LoadError(f"GGUF metadata is missing {full!r}")
        return meta[full]

    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise LoadError("GGUF metadata is missing 'tokenizer.ggml.tokens' (needed for vocab size)")
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    theta = _short_float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": len(tokens),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "rms_norm_eps": _short_float(need("attention.layer_norm_rms_epsilon")),
        # transformers 5 reads rope_parameters; older readers read rope_theta.
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "hidden_act": "silu",
        "dtype": "float32",
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        factor = float(meta[f"{arch}.rope.scaling.factor"])
        cfg["rope_parameters"] = {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    elif scaling not in (None, "none"):
        raise LoadError(f"GGUF rope scaling type {scaling!r} is not supported")
    for hf_key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        if f"tokenizer.ggml.{gguf_key}" in meta:
            cfg[hf_key] = int(meta[f"tokenizer.ggml.{gguf_key}"])
    return cfg


def dequantize_tensor(tensor: Any, arch: str, cfg: dict[str, Any]) -> np.ndarray:
    """One GGUF tensor as a float32 array in HF layout (rows permuted back)."""
    from gguf.quants import dequantize

    # gguf lists dims fastest-first; numpy wants them the other way round.
    shape = tuple(int(d) for d in reversed(tensor.shape))
    w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
    if arch in _PERMUTED_QK_ARCHS:
        kind = _BLOCK_RE.match(tensor.name)
        part = kind.group(2) if kind else ""
        if part.startswith("attn_q."):
            w = unpermute_rows(w, cfg["num_attention_heads"])
        elif part.startswith("attn_k."):
            w = unpermute_rows(w, cfg["num_key_value_heads"])
    return np.ascontiguousarray(w)


# GGUF tensor (in a block) -> the runtime matrix it becomes (models.llama.MATRICES).
_MATRIX_KEYS = {"attn_q.weight": "wq", "attn_k.weight": "wk", "attn_v.weight": "wv", "attn_output.weight": "wo",
                "ffn_gate.weight": "w_gate", "ffn_up.weight": "w_up", "ffn_down.weight": "w_down"}


def read_blocks(gguf_path: str | Path) -> dict[str, Any]:
    """A GGUF's matrices as their own blocks, for `engine.quantize = "gguf"` (params["gguf"]).

    {"layers": {key: (q [L, N, K], d [L, N, K/32], m or None)}, "lm_head" or "embed": (q, d, m),
    "types": {key: "Q4_1", ...}}, in Hugging Face's [out, in] row order (llama's q/k rows
    un-permuted: the same bits), decoded by `native.block_matmul.decode_blocks`. Every layer matrix
    must be Q4_0, Q4_1 or Q8_0, one type per matrix across layers; the LM head may be any type
    (a float one stays float)."""
    from gguf import GGUFReader

    from jaxspec.native.block_matmul import BLOCK_BYTES, decode_blocks

    try:
        reader = GGUFReader(str(gguf_path))
    except (ValueError, OSError) as e:
        raise LoadError(f"{gguf_path} is not a readable GGUF file: {e}") from None
    meta = read_metadata(reader)
    cfg = hf_config_from_gguf(meta, {t.name for t in reader.tensors})
    permuted = meta["general.architecture"] in _PERMUTED_QK_ARCHS
    heads = {"wq": cfg["num_attention_heads"], "wk": cfg["num_key_value_heads"]}
    # The LM head: output.weight, else the tied embedding (which is then read as blocks too).
    head_name = "output.weight" if any(t.name == "output.weight" for t in reader.tensors) else "token_embd.weight"
    # 1. Which tensors, and their types.
    found: dict[str, list] = {}
    out: dict[str, Any] = {"layers": {}}
    for t in reader.tensors:
        kind = _BLOCK_RE.match(t.name)
        key = _MATRIX_KEYS.get(kind.group(2)) if kind else (
            {"output.weight": "lm_head", "token_embd.weight": "embed"}[t.name] if t.name == head_name else None)
        if key is None:
            continue
        ttype = t.tensor_type.name
        if ttype not in BLOCK_BYTES:
            if kind:
                raise LoadError(f"engine.quantize = gguf computes on {', '.join(sorted(BLOCK_BYTES))} blocks; "
                                f"{gguf_path} stores {t.name} as {ttype} (use --quantize int8 or none)")
            continue  # a float (or other) LM head keeps the float path
        found.setdefault(key, []).append((int(kind.group(1)) if kind else 0, ttype, t))
    # 2. Decode, un-permute, stack.
    for key, items in found.items():
        kinds = {ttype for _, ttype, _ in items}
        if len(kinds) > 1:
            raise LoadError(f"engine.quantize = gguf needs one block type per matrix; {gguf_path} stores {key} "
                            f"as {sorted(kinds)} in different layers (use --quantize int8 or none)")
        parts = []
        for _, ttype, t in sorted(items, key=lambda x: x[0]):
            q, d, m = decode_blocks(np.asarray(t.data).reshape(int(t.shape[1]), -1), ttype)
            if permuted and key in heads:
                q, d, m = (None if a is None else unpermute_rows(a, heads[key]) for a in (q, d, m))
            parts.append((q, d, m))
        stacked = tuple(None if a[0] is None else np.stack(a) for a in zip(*parts))
        if key in ("lm_head", "embed"):
            out[key] = tuple(None if a is None else a[0] for a in stacked)
        elif len(items) != cfg["num_hidden_layers"]:
            raise LoadError(f"{gguf_path}: {key} is in {len(items)} of {cfg['num_hidden_layers']} layers")
        else:
            out["layers"][key] = stacked
    out["types"] = {key: items[0][1] for key, items in found.items()}  # what runs, for the start-up line
    return out


# --------------------------------------------------------------------------- #
# Tokenizer
# --------------------------------------------------------------------------- #


def tokenizer_from_gguf(meta: dict[str, Any]) -> Any:
    """A transformers fast tokenizer rebuilt from GGUF `tokenizer.*` metadata.

    Mirrors transformers' `get_gguf_tokenizer`, which we cannot call because
    its reader imports torch; the conversion itself is transformers' own.
    """
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError as e:
        raise LoadError(f"this transformers version has no GGUF tokenizer converter: {e}") from None

    # 1. Group the metadata the way transformers' converter expects it.
    grouped = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tok_dict, tok_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if "tokens" not in tok_dict:
        raise LoadError("GGUF metadata is missing 'tokenizer.ggml.tokens'")
    if tok_dict.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS for sentencepiece vocabularies that do not say otherwise.
        tok_config.setdefault("add_bos_token", True)

    # 2. Special tokens by string, as tokenizer_config.json stores them.
    tokens = tok_dict["tokens"]
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            tok_config[name] = tokens[int(token_id)]

    # 3. Build the backend and wrap it.
    try:
        backend, extra = convert_gguf_tokenizer(meta["general.architecture"], tok_dict)
    except ValueError as e:
        raise LoadError(f"cannot convert the GGUF tokenizer: {e}") from None
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tok_config, **extra)


# --------------------------------------------------------------------------- #
# The conversion
# --------------------------------------------------------------------------- #


def _write_hf_dir(reader: Any, meta: dict[str, Any], out: Path, progress: bool) -> None:
    from safetensors.numpy import save_file
    from tqdm.auto import tqdm

    # 1. Config (validates the architecture before any heavy work).
    names = {t.name for t in reader.tensors}
    cfg = hf_config_from_gguf(meta, names)
    arch = meta["general.architecture"]

    # 2. Tokenizer next: after the config it is what an odd file most likely breaks.
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json.
    tokenizer_from_gguf(meta).save_pretrained(out, save_jinja_files=False)

    # 3. Dequantize every tensor into HF names and layout.
    state: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor", disable=not progress):
        state[hf_tensor_name(t.name)] = dequantize_tensor(t, arch, cfg)
    rows = state.get("model.embed_tokens.weight")
    if rows is not None and rows.shape[0] != cfg["vocab_size"]:
        raise LoadError(
            f"GGUF token_embd has {rows.shape[0]} rows but the vocabulary lists {cfg['vocab_size']} tokens"
        )

    # 4. Weights and config. transformers refuses safetensors without format=pt.
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Convert `gguf_path` into a float32 HF directory at `out_dir`; return it.

    Writes into a temporary sibling and renames it into place, so an
    interrupted conversion never leaves a half-written `out_dir`. If another
    process finishes the same `out_dir` first, its result is kept.
    """
    from gguf import GGUFReader

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    # 1. Check inputs.
    if not gguf_path.is_file():
        raise LoadError(f"no such GGUF file: {gguf_path}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise LoadError(f"refusing to convert into non-empty directory {out_dir}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    # 2. Parse the file (metadata walk dominates for big vocabularies).
    if progress:
        print(f"jaxspec: converting {gguf_path.name} (first use only; cached afterwards)", file=sys.stderr)
    try:
        reader = GGUFReader(str(gguf_path))
    except (ValueError, OSError) as e:
        raise LoadError(f"{gguf_path} is not a readable GGUF file: {e}") from None
    meta = read_metadata(reader)

    # 3. Write into a temp dir beside the target, then rename atomically.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_hf_dir(reader, meta, tmp, progress)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the published dir is ordinary
        _publish(tmp, out_dir)
    except OSError as e:
        raise LoadError(f"writing the conversion of {gguf_path.name} to {out_dir} failed: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left after a successful rename
    return out_dir


def _publish(tmp: Path, out_dir: Path) -> None:
    """Rename the finished temp dir to `out_dir`, keeping a concurrent winner."""
    try:
        if out_dir.exists():  # an empty dir the caller made: rename cannot replace it
            out_dir.rmdir()
        os.rename(tmp, out_dir)
    except OSError:
        if (out_dir / "config.json").is_file():  # another process converted the same file
            return
        raise
