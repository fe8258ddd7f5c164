"""`python -m jaxspec.bench lower --platform tpu|cuda [--dump DIR]`: every jitted entry point lowered for
an accelerator from this host, with the custom calls each one contains.

Nothing runs and no accelerator is needed. Each entry point (prefill, the plain decode loop, the
speculative loop for n-gram and standalone drafting, chain and tree, for the feature drafters (EAGLE
chain, EAGLE-3 and Medusa trees, on fresh random heads: a head's weights change no kernel choice),
and the server's buckets) is
traced with kernels chosen for the target platform (`jaxspec.pallas.lowering_for`, the same
dispatch rule as on the device) and lowered with `lowering_platforms=(platform,)`. That runs the
Pallas Triton / Mosaic lowering rules, which reject ops and shapes they cannot lower, but not the
Triton or Mosaic compilers nor XLA's backend passes: "lowers" is not "compiles" and says nothing of
speed.

Per entry point the report lists the Pallas kernels it contains, by kind: Mosaic TPU
(`tpu_custom_call`), Triton (`__gpu$xla.gpu.triton`), Mosaic GPU (`mosaic_gpu*`), with their kernel
names. An entry point with no kernel of the platform runs as plain HLO there; its most frequent ops
are listed. `--dump DIR` writes each entry point's StableHLO text to DIR/<name>.mlir and the report
to DIR/report.json. `--mesh DPxTP` lowers the sharded programs instead (kernels under shard_map, as
on the device), over this host's devices.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import sys
from pathlib import Path

# --platform -> jax's lowering-platform name.
PLATFORMS = {"tpu": "tpu", "cuda": "cuda"}
# Custom-call targets of Pallas kernels, by kind; anything else is XLA's own (sharding marks, ...).
KERNEL_KINDS = (("tpu_custom_call", "Mosaic TPU"), ("__gpu$xla.gpu.triton", "Triton"), ("mosaic_gpu", "Mosaic GPU"))
# Which kernel kinds count as "this platform's kernels".
NATIVE_KINDS = {"tpu": ("Mosaic TPU",), "cuda": ("Triton", "Mosaic GPU")}
_CALL = re.compile(r"stablehlo\.custom_call @([\w$.]+)")
_KERNEL_NAME = re.compile(r'\b(?:kernel_name|name) = "([^"]+)"')
_OP = re.compile(r"(?:=|^)\s*\"?((?:stablehlo|chlo|sdy|mhlo)\.[a-z_]+)")
# The ops that carry the work where no kernel runs (matmuls, paged gathers, cache scatters, loops).
HEAVY_OPS = ("dot_general", "gather", "scatter", "dynamic_slice", "dynamic_update_slice", "reduce", "sort", "while")
# Which kernel does which job, by the kernel names in jaxspec/pallas/.
ROLES = {"attention": "attention", "verify": "verify", "tree_build": "build_tree"}


@dataclasses.dataclass
class Case:
    """One engine configuration and the entry-point names its buckets get."""

    spec: dict | None  # SpecSection fields; None = plain decoding
    prefill: str | None  # entry name of its prefill (None: the same as another case's)
    decode: str
    draft_layers: int = 0  # standalone: the target's first N layers as the draft model
    head: str | None = None  # a feature drafter: a fresh random head of this kind (`models.heads.family.head_config`)
    head_kw: dict = dataclasses.field(default_factory=dict)


CASES = (
    Case(None, "prefill", "decode_plain"),
    Case({"algorithm": "ngram", "num_draft_tokens": 4}, None, "spec_ngram_chain"),
    Case({"algorithm": "ngram", "topk": 2, "num_steps": 3, "num_draft_tokens": 6}, None, "spec_ngram_tree"),
    Case({"algorithm": "standalone", "num_draft_tokens": 4}, "prefill_standalone", "spec_standalone_chain", 1),
    Case({"algorithm": "standalone", "topk": 2, "num_steps": 2, "num_draft_tokens": 5}, None,
         "spec_standalone_tree", 1),
    Case({"algorithm": "eagle", "num_steps": 3, "num_draft_tokens": 4}, None, "spec_eagle_chain", head="eagle"),
    # The prefill of a multi-layer feature drafter: the target's features feed the head's prefill.
    Case({"algorithm": "eagle3", "topk": 2, "num_steps": 2, "num_draft_tokens": 5}, "prefill_eagle3",
         "spec_eagle3_tree", head="eagle3"),
    Case({"algorithm": "medusa", "topk": 2, "num_steps": 3, "num_draft_tokens": 6}, None, "spec_medusa_tree",
         head="medusa", head_kw={"num_heads": 3}),
    # Block drafters: one forward per block; DSPARK's planner and ragged verify widths inside the loop.
    Case({"algorithm": "dflash", "num_draft_tokens": 8}, "prefill_dflash", "spec_dflash_chain", head="dflash"),
    Case({"algorithm": "dspark", "num_draft_tokens": 8}, None, "spec_dspark_chain", head="dspark"),
)


def kernel_kind(target: str) -> str | None:
    for prefix, kind in KERNEL_KINDS:
        if target.startswith(prefix):
            return kind
    return None


_INT8_OP = re.compile(r"stablehlo\.(?:convert|dot_general)\b[^\n]*tensor<[0-9x]*xi8>")


def analyze(name: str, text: str, platform: str) -> dict:
    """The report row of one lowered entry point, from its StableHLO text alone."""
    calls = collections.Counter(_CALL.findall(text))
    kernels = collections.defaultdict(list)  # kind -> kernel names, one per call site
    for line in text.splitlines():
        m = _CALL.search(line)
        kind = kernel_kind(m.group(1)) if m else None
        if kind:
            names = _KERNEL_NAME.findall(line)
            kernels[kind].append(names[0] if names else "?")
    ops = collections.Counter(op.split(".", 1)[1] for op in _OP.findall(text))
    native = [n for k in NATIVE_KINDS[platform] for n in kernels.get(k, ())]
    return {
        "name": name, "platform": platform, "custom_calls": dict(calls),
        "kernels": {k: sorted(set(v)) for k, v in kernels.items()},
        "kernel_calls": {k: len(v) for k, v in kernels.items()},
        "platform_kernels": len(native),
        "roles": {role: any(key in n for n in native) for role, key in ROLES.items()},
        "hlo_ops": sum(ops.values()), "heavy_ops": {op: ops[op] for op in HEAVY_OPS if ops[op]},
        # Weight-only int8 (--quantize int8): the ops reading an int8 tensor (the converts XLA fuses into its dots).
        "int8_ops": len(_INT8_OP.findall(text)),
        "stablehlo_chars": len(text),
    }


def _engine_cfg(args):
    from jaxspec.config import EngineSection

    # Scan over stacked layers and XLA's own ops: the accelerator layout, whatever this host is.
    return EngineSection(max_batch_size=args.batch, batch_buckets=(args.batch,), max_context=args.context,
                         length_buckets=(args.prompt_len, args.context), page_size=args.page_size,
                         layer_loop="scan", cpu_kernels="xla", quantize=args.quantize)


def fresh_head(model, kind: str, **kw):
    """(params, HeadConfig) of a random `kind` head for `model`, in the model's dtype.

    EAGLE-3 reads the states entering layers (2, L // 2, L - 3) by default, which a target of
    fewer than 4 layers (--model tiny) lacks: there it reads (0, L // 2, L). Its draft
    vocabulary is half the target's, so the d2t mapping is lowered too."""
    from jaxspec.models.heads.family import head_config, init_head_params

    cfg = model.config
    L = cfg.num_layers
    if kind in ("dflash", "dspark"):  # a one-layer block of 8 (dflash) or gamma 7
        kw = {"num_layers": 1, "block_size": 8 if kind == "dflash" else 7, "markov_rank": 16,
              "feature_layers": (2, L // 2, L - 3) if L >= 4 else (1, L), **kw}
    if kind == "eagle3":
        kw = {"draft_vocab_size": cfg.vocab_size // 2, **kw}
        if cfg.num_layers < 4:
            kw.setdefault("feature_layers", (0, cfg.num_layers // 2, cfg.num_layers))
    hcfg = head_config(kind, cfg, **kw)
    return init_head_params(hcfg, dtype=model.params["embed"].dtype), hcfg


def _build_engine(model, case: Case, args, mesh=None, split_pages: bool = True):
    from jaxspec.config import SpecSection
    from jaxspec.engine import Engine
    from jaxspec.speculative.drafters.standalone import truncate_layers

    spec = SpecSection(**case.spec) if case.spec else None
    if case.head:
        draft = fresh_head(model, case.head, **case.head_kw)
    elif case.draft_layers:
        draft = truncate_layers(model.params, model.config, case.draft_layers)
    else:
        draft = None
    return Engine(model.params, model.config, _engine_cfg(args), progress=False, spec=spec, draft=draft, mesh=mesh,
                  split_pages=split_pages)


def engine_entry_points(model, args, mesh=None):
    """(name, traced) per engine case: its prefill bucket (when named) and its decode loop."""
    for case in CASES:
        engine = _build_engine(model, case, args, mesh)
        if case.prefill:
            yield case.prefill, lambda e=engine: e.trace(("prefill", args.batch, args.prompt_len, args.context))
        yield case.decode, lambda e=engine: e.trace(("decode", args.batch, args.context))


def serve_entry_points(model, args, mesh=None):
    """The server's buckets (`ModelRunner.all_keys`): chunked prefill, and decode per draft length k (0 = plain)."""
    from jaxspec.config import SpecSection
    from jaxspec.engine.runner import ModelRunner

    # One page pool, as `build_server` makes it.
    runner = ModelRunner(model.params, model.config, _engine_cfg(args), progress=False,
                         spec=SpecSection(algorithm="ngram", num_draft_tokens=4), mesh=mesh, split_pages=False,
                         steps_candidates=(0, 3), steps_per_call=4, context_buckets=(args.context,),
                         prefill_chunk=args.prompt_len, max_prefill_batch=args.batch)
    for key in runner.all_keys():
        if key[0] == "prefill":
            name = f"serve_prefill_b{key[1]}_c{key[2]}_ctx{key[3]}"
        else:
            name = f"serve_decode_k{key[1]}_b{key[2]}_ctx{key[3]}"
        yield name, lambda k=key: runner.trace(k)


def lower_all(model, args) -> list[dict]:
    """Trace every entry point for `args.platform`, lower it, and analyze (and dump) its StableHLO."""
    from jaxspec.mesh import make_mesh
    from jaxspec.pallas import lowering_for

    platform = PLATFORMS[args.platform]
    mesh = make_mesh(args.mesh) if args.mesh else None
    dump = Path(args.dump) if args.dump else None
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
    rows = []
    for source in (engine_entry_points, serve_entry_points):
        for name, trace in source(model, args, mesh):
            with lowering_for(platform):
                text = trace().lower(lowering_platforms=(platform,)).as_text()
            rows.append({**analyze(name, text, args.platform), "mesh": args.mesh})
            if dump:
                (dump / f"{name}.mlir").write_text(text)
    if dump:
        (dump / "report.json").write_text(json.dumps(rows, indent=1))
    return rows


def load(args):
    """The model to lower: "tiny" (random, shapes only), "default" (embedded SmolLM2), or a path."""
    import jax.numpy as jnp

    from jaxspec.bench.gpu import TINY, random_model
    from jaxspec.models.loading import LoadedModel, load_model

    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    if args.model == "tiny":
        cfg, params = random_model(TINY, dtype)
        return LoadedModel(params=params, config=cfg, tokenizer=None, path=None)
    return load_model(args.model, dtype=dtype, progress=False)


def print_report(rows: list[dict], platform: str) -> None:
    from jaxspec.bench.common import print_table

    kinds = NATIVE_KINDS[platform]
    table = []
    for r in rows:
        found = "; ".join(f"{k}: {', '.join(names)} ({r['kernel_calls'][k]} call sites)"
                          for k, names in r["kernels"].items())
        other = ", ".join(f"{c} x{n}" for c, n in r["custom_calls"].items() if kernel_kind(c) is None)
        table.append([r["name"], found or "none", other or "-", r["hlo_ops"],
                      ", ".join(f"{op} {n}" for op, n in r["heavy_ops"].items()),
                      f"{r['stablehlo_chars'] / 1e3:.0f} k"])
    print_table(["entry point", f"Pallas kernels ({' / '.join(kinds)} expected)", "other custom calls", "HLO ops",
                 "heavy HLO ops", "StableHLO"], table)
    print()
    for line in role_summary(rows):
        print(line)
    if any(r["int8_ops"] for r in rows):
        print(f"int8 weights: read by {sum(r['int8_ops'] for r in rows)} converts / dots in "
              f"{sum(bool(r['int8_ops']) for r in rows)} of {len(rows)} entry points")
    print("Lowered, not compiled or timed: the Triton / Mosaic compilers and XLA's backend did not run.")


def role_summary(rows: list[dict]) -> list[str]:
    """Per kernel job, which entry points that need it got the platform's kernel and which fell back to HLO."""
    # Every decode program is the loop (plain decoding is its k = 0 plan, a one-node verify).
    loops = [r for r in rows if r["name"].startswith(("spec_", "serve_decode", "decode_plain"))]
    need = {"attention": rows, "verify": loops, "tree_build": [r for r in loops if "tree" in r["name"]]}
    out = []
    for role, group in need.items():
        if not group:
            continue
        missing = [r["name"] for r in group if not r["roles"][role]]
        line = f"{role}: kernel in {len(group) - len(missing)} of {len(group)} entry points that need it"
        out.append(line + (f"; jnp reference (plain HLO) in {', '.join(missing)}" if missing else ""))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench lower", description=__doc__.split("\n\n")[0])
    p.add_argument("--platform", required=True, choices=sorted(PLATFORMS), help="lower for this platform")
    p.add_argument("--dump", metavar="DIR", help="write DIR/<entry point>.mlir (StableHLO) and DIR/report.json")
    p.add_argument("--model", default="default", help='"default" (embedded SmolLM2), "tiny" (random) or a path')
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--batch", type=int, default=4, help="batch bucket (default 4)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt / prefill-chunk bucket (default 32)")
    p.add_argument("--context", type=int, default=256, help="context bucket (default 256)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--quantize", default="none", choices=("none", "int8"),
                   help="target weights as engine.quantize (int8: XLA's dot on int8 weights, layers.Int8Weight)")
    p.add_argument("--mesh", metavar="DPxTP", help="lower sharded over a data x model mesh of this host's devices "
                   "(e.g. 4x2 with XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return p


def _check(args) -> None:
    for flag in ("batch", "prompt_len", "context", "page_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.prompt_len >= args.context:
        raise ValueError(f"--prompt-len {args.prompt_len} must be below --context {args.context}")


def main(argv=None) -> int:
    from jaxspec.models.config import ConfigError, LoadError
    from jaxspec.mesh import MeshError, make_mesh

    args = build_parser().parse_args(argv)
    try:
        _check(args)
        if args.mesh:
            make_mesh(args.mesh)  # a bad or too-large mesh fails before loading
        model = load(args)
    except (ValueError, ConfigError, LoadError, OSError, MeshError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = lower_all(model, args)
    print_report(rows, args.platform)
    return 0


if __name__ == "__main__":
    sys.exit(main())
