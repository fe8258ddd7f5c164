"""Pre-quantized W8A16 checkpoints in the compressed-tensors layout (what llm-compressor writes and
vLLM serves): weight-only int8, symmetric, one scale per output channel.

The layout, per quantized Linear `X` (`X.weight` is absent):
- "pack-quantized": `X.weight_packed` int32 [out, ceil(in / 4)], four int8 values per word, value
  j of a row in bits 8 (j % 4) of word j // 4, each stored as q + 128 (unsigned); `X.weight_shape`
  [2] holds [out, in];
- "int-quantized" / "naive-quantized": `X.weight` int8 [out, in];
- both: `X.weight_scale` [out, 1] (float16, bfloat16 or float32). The weight is q * scale.
`config.json`'s `quantization_config` says so; modules it leaves out (its `ignore`, usually
lm_head) keep a float `X.weight`.

Loading gives the float params every path reads (q * scale, in float32), plus the checkpoint's own
q and scale under `params["int8"]`: with `engine.quantize = "int8"`, `llama.prepare_params` computes
on those, not on a re-quantization of the dequantized weights (ours puts the channel's largest |q|
at 127; the checkpoint's observer may put it at 128, so re-quantizing would round a second time).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxspec.models.config import LoadError

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")


def w8a16_format(path: Path) -> str | None:
    """The compressed-tensors format of a W8A16 checkpoint, None for an unquantized one; an error
    naming the config field for any other quantization (it would otherwise load as garbage)."""
    qc = json.loads((path / "config.json").read_text()).get("quantization_config")
    if not qc:
        return None
    where = "config.json quantization_config"
    if qc.get("quant_method") != "compressed-tensors":
        raise LoadError(f"{where}.quant_method is {qc.get('quant_method')!r}: only compressed-tensors "
                        "W8A16 checkpoints are read (weight-only int8, a scale per output channel)")
    if qc.get("format") not in FORMATS:
        raise LoadError(f"{where}.format is {qc.get('format')!r}; supported: {', '.join(FORMATS)}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise LoadError(f"{where}.config_groups is empty")
    want = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    for name, group in groups.items():
        weights = group.get("weights") or {}
        for key, value in want.items():
            if weights.get(key) != value:
                raise LoadError(f"{where}.config_groups.{name}.weights.{key} is {weights.get(key)!r}; "
                                f"only W8A16 ({key} = {value!r}) is supported")
        for key in ("input_activations", "output_activations"):
            if group.get(key):
                raise LoadError(f"{where}.config_groups.{name}.{key} is set: activation quantization "
                                "is not supported (weight-only W8A16 is)")
    return qc["format"]


def logical_names(names: set[str]) -> set[str]:
    """Tensor names as the float planner expects them: each quantized `X` as `X.weight`."""
    out = set()
    for n in names:
        base, _, part = n.rpartition(".")
        if part in _PARTS:
            if part == "weight_scale":
                out.add(base + ".weight")
        elif not (part == "weight" and base + ".weight_scale" in names):
            out.add(n)
    return out


def is_quantized(name: str, files: dict) -> bool:
    """`name` (an `X.weight` of `logical_names`) is stored quantized."""
    return name.removesuffix(".weight") + ".weight_scale" in files


def read_int8(read, name: str, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(q [out, in] int8, scale [out] float32) of the quantized `name`; `read(tensor_name)` gives a
    stored tensor as numpy."""
    base = name.removesuffix(".weight")
    scale = np.asarray(read(base + ".weight_scale"), np.float32).reshape(-1)
    packed = read(base + ".weight_packed", optional=True)
    if packed is None:
        q = np.asarray(read(base + ".weight"))
        if q.dtype != np.int8:
            raise LoadError(f"tensor {base}.weight is {q.dtype}, expected int8 (int-quantized)")
    else:
        q = unpack_int8(np.asarray(packed), shape[1])
    if q.shape != tuple(shape) or scale.shape != (shape[0],):
        raise LoadError(f"tensor {base}: int8 {list(q.shape)} with {scale.size} scales, config expects "
                        f"{list(shape)} with one scale per output channel")
    return q, scale


def unpack_int8(packed: np.ndarray, cols: int) -> np.ndarray:
    """int32 [rows, ceil(cols / 4)] -> int8 [rows, cols] (see the module docstring for the bit layout)."""
    if packed.dtype != np.int32:
        raise LoadError(f"weight_packed is {packed.dtype}, expected int32")
    words = packed.view(np.uint32)
    values = np.stack([(words >> (8 * i)) & 0xFF for i in range(4)], axis=-1).reshape(packed.shape[0], -1)
    return (values[:, :cols].astype(np.int16) - 128).astype(np.int8)
