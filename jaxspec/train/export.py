"""Write a trained head in its published format: safetensors + config.json.

Each family writes its own (`write` in `jaxspec/models/heads/<family>.py`, beside the `read` that
loads it back): EAGLE-3 as SpecForge / SGLang / vLLM's LlamaForCausalLMEagle3, EAGLE-1 as SafeAILab's,
Medusa as FasterDecoding's medusa_lm_head.safetensors, DFLASH as z-lab/dflash's DFlashDraftModel and
DSPARK as the same with its Markov and confidence heads (jaxspec's own). tests/test_train.py holds
the logits of the reloaded head equal to the exported one's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxspec.models.heads.config import HeadConfig
from jaxspec.models.heads.family import family_of, trainable_kinds


def _write(out_dir, config: dict, tensors: dict, file: str = "model.safetensors") -> Path:
    from safetensors.numpy import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / file), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def cast_head(out_dir, dtype: str = "bfloat16") -> Path:
    """Rewrite an exported head's float32 tensors in `dtype` ("bfloat16" | "float16" | "float32";
    integer maps such as d2t / t2d stay) and set config.json's torch_dtype: what ships is half the
    size, and the loaders cast back to the engine's dtype."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    kinds = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
    if dtype not in kinds:
        raise ValueError(f"dtype must be one of {', '.join(kinds)}, got {dtype!r}")
    out = Path(out_dir)
    files = sorted(out.glob("*.safetensors"))
    if not files or not (out / "config.json").is_file():
        raise FileNotFoundError(f"{out}: no exported head (config.json + *.safetensors)")
    for f in files:
        t = load_file(str(f))
        save_file({k: v.astype(kinds[dtype]) if v.dtype == np.float32 else v for k, v in t.items()}, str(f),
                  metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def export_head(params: dict, hcfg: HeadConfig, out_dir, *, draft_ids=None, extra: dict | None = None,
                num_target_layers: int | None = None) -> Path:
    """Write `params` (HF layout, as trained) of a `hcfg.kind` head to `out_dir`, in its family's
    published format (`write` in the family's module); `extra` entries go into config.json."""
    family = family_of(hcfg.kind)
    if family.write is None:
        raise ValueError(f"no exporter for head kind {hcfg.kind!r}; kinds: {', '.join(trainable_kinds())}")
    cfg, tensors, file = family.write(params, hcfg, draft_ids=draft_ids, num_target_layers=num_target_layers)
    cfg.update(extra or {})
    if cfg.get("num_target_layers", 0) is None:
        cfg.pop("num_target_layers")
    return _write(out_dir, cfg, tensors, file)
