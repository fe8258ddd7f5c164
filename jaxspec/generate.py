"""`python -m jaxspec.generate`: the main CLI, built on `jaxspec.LLM` (jaxspec/api.py).

    python -m jaxspec.generate --prompt "Write a haiku about TPUs."
    python -m jaxspec.generate --prompts in.jsonl --output out.jsonl --batch-size 8

Input lines: {"messages": [...]} (chat template applied), {"prompt": "raw text"}
or {"prompt_ids": [...]}; a line may also carry its own max_new_tokens,
temperature, top_p, top_k, seed, logprobs and prompt_logprobs. Output lines: {"prompt_ids",
"output_ids", "text", "finish_reason"}, and "logprobs" / "prompt_logprobs" when the line asked for
them (N: each generated / prompt token's log-probability and the N likeliest at its position,
{token id: [logprob, rank]}).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

# (CLI flag dest, config key): flags override the --config file, which overrides defaults.
FLAG_KEYS = {
    "model": "model.path",
    "dtype": "model.dtype",
    "cache_dir": "model.cache_dir",
    "page_size": "engine.page_size",
    "num_pages": "engine.num_pages",
    "batch_size": "engine.max_batch_size",
    "max_context": "engine.max_context",
    "logprobs_mode": "engine.logprobs_mode",
    "quantize": "engine.quantize",
    "prefix_cache": "engine.prefix_cache",
    "max_new_tokens": "sampling.max_new_tokens",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "seed": "sampling.seed",
    "ignore_eos": "sampling.ignore_eos",
    "adaptive_spec": "spec.adaptive",
    "adaptive_lengths": "spec.adaptive_lengths",
}


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="configs/*.toml file; flags override it")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key, e.g. --set engine.length_buckets=64,128")
    p.add_argument("--model", help="'default' (embedded SmolLM2), a Hugging Face dir or a .gguf file")
    p.add_argument("--dtype", choices=["float32", "bfloat16"])
    p.add_argument("--cache-dir", help="where converted GGUF checkpoints are cached")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--page-size", type=int)
    p.add_argument("--num-pages", type=int)
    p.add_argument("--max-context", type=int)
    p.add_argument("--logprobs-mode", choices=["raw", "processed"],
                   help="log-probabilities of the target's raw distribution (default) or of the one each "
                        "request samples from (temperature, top-k, top-p)")
    p.add_argument("--quantize", choices=["none", "int8", "gguf"],
                   help="target weights: as loaded (default), weight-only int8 quantized at load (the native "
                        "CPU kernels, else XLA's dot), or gguf: a GGUF's own Q4_0/Q4_1/Q8_0 blocks (native CPU "
                        "kernels)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="share full KV pages between requests with equal prefixes (default on; "
                        "--no-prefix-cache recomputes every prompt)")


def section_flags(section_cls) -> dict[str, tuple[str, dict]]:
    """{dest: (flag, argparse keywords)} of a config section's fields that have one (`config.opt`)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(section_cls)
    out = {}
    for f in dataclasses.fields(section_cls):
        meta = f.metadata
        if "help" not in meta or meta["flag"] == "-":
            continue
        flag = meta["flag"] or f.name.replace("_", "-")
        kind = hints[f.name]
        kw: dict[str, Any] = {"help": meta["help"]}
        if kind in (int, float):
            kw["type"] = kind
        if meta["choices"]:
            kw["choices"] = list(meta["choices"])
        if meta["metavar"]:
            kw["metavar"] = meta["metavar"]
        out[flag.replace("-", "_")] = (flag, kw)
    return out


def spec_flag_keys() -> dict[str, str]:
    """(CLI flag dest, config key) of the [spec] flags, generated from the section's fields."""
    import dataclasses

    from jaxspec.config import SpecSection

    names = {(f.metadata.get("flag") or f.name).replace("-", "_"): f.name for f in dataclasses.fields(SpecSection)}
    return {dest: f"spec.{names[dest]}" for dest in section_flags(SpecSection)}


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """The [spec] flags, one per field of `SpecSection` (its metadata has the help); --spec lists the
    registered algorithms."""
    from jaxspec.config import SpecSection
    from jaxspec.speculative.drafters import registrations, valid_names

    sp = p.add_argument_group("speculative decoding")
    for dest, (flag, kw) in section_flags(SpecSection).items():
        if dest == "spec":  # each registered algorithm with its description
            algs = "; ".join(f"{r.name}{' (' + ', '.join(r.aliases) + ')' if r.aliases else ''}: {r.info.description}"
                             for r in registrations())
            kw = {**kw, "metavar": "|".join(valid_names()), "help": f"{kw['help']}. {algs}"}
        sp.add_argument(f"--{flag}", dest=dest, **kw)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxspec.generate", description=__doc__.split("\n")[0])
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message (chat template applied when the model has one)")
    src.add_argument("--prompts", metavar="FILE.jsonl", help="one JSON object per line")
    p.add_argument("--raw", action="store_true", help="with --prompt: no chat template")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int, help="base seed; request i gets seed+i unless its line sets one")
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument("--batch-size", type=int)
    add_engine_args(p)
    p.add_argument("--output", metavar="FILE.jsonl")
    add_spec_args(p)
    p.add_argument("--adaptive-spec", choices=["auto", "on", "off"],
                   help="per batch bucket, plain decoding or the draft shape, whichever measures faster; auto "
                        "(default): on unless a shape flag (--num-draft-tokens, --num-steps, --topk, "
                        "--tree-choices) changes the default shape")
    p.add_argument("--adaptive-lengths", metavar="K1,K2,...",
                   help="shorter draft chains the adaptive policy may also choose (default 1; '' = none)")
    p.add_argument("--profile-phases", action="store_true",
                   help="rerun the first batch with draft/verify/other timed apart and print the split")
    p.add_argument("--quiet", action="store_true", help="no progress bars, no text on stdout")
    from jaxspec.mesh import add_mesh_args

    add_mesh_args(p)
    return p


def config_from_args(args, *, base=None, extra_keys: dict[str, str] | None = None) -> Any:
    """Defaults (or `base`) < --config file < --set < flags."""
    from jaxspec.config import ConfigValueError, load_config

    overrides: dict[str, Any] = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigValueError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        overrides[key.strip()] = value
    for dest, key in {**FLAG_KEYS, **spec_flag_keys(), **(extra_keys or {})}.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides[key] = value
    return load_config(args.config, overrides, base=base)


def with_model_sampling(cfg, rebuild, quiet: bool = False):
    """`cfg` rebuilt over the model's generation_config.json sampling defaults (vLLM's
    --generation-config auto): config defaults < the model's < --config < --set < flags."""
    from jaxspec.config import apply_overrides, load_config
    from jaxspec.models.loading import sampling_overrides

    gen = sampling_overrides(cfg.model.path, cfg.model.cache_dir or None)
    if not gen:
        return cfg
    if not quiet:
        print("sampling defaults from the model's generation_config.json: "
              + ", ".join(f"{k.split('.')[1]}={v}" for k, v in gen.items()), file=sys.stderr)
    return rebuild(apply_overrides(load_config(None), gen))


INPUT_FIELDS = frozenset({"messages", "prompt", "prompt_ids", "_where"})
# SamplingParams fields a JSONL line may set beyond ENGINE_FIELDS (checked by SamplingParams itself).
LINE_FIELDS = ("prompt_logprobs", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
               "logit_bias", "min_tokens", "stop_token_ids", "structured_outputs")


def line_sampling(entry: dict, s, i: int):
    """The SamplingParams of input line i: its own max_new_tokens, temperature, top_p, top_k and
    seed over the [sampling] defaults (request i's seed is seed+i), and any LINE_FIELDS.
    PromptError naming the line."""
    from jaxspec.prompts import PromptError
    from jaxspec.sampling_params import ENGINE_FIELDS, SamplingError, SamplingParams, check_value

    where = entry.get('_where', f'prompt {i}')
    known = set(ENGINE_FIELDS) | set(LINE_FIELDS)
    unknown = sorted(k for k in entry if k not in INPUT_FIELDS and k not in known)
    if unknown and INPUT_FIELDS & set(entry) - {"_where"}:  # (no prompt at all: encode_entry says so) a field that would be silently ignored (say repetition_penalty) changes the output unseen
        raise PromptError(f"{where}: unknown field {unknown[0]!r}; an input line may hold "
                          f"{', '.join(sorted(INPUT_FIELDS - {'_where'}) + sorted(known))}")
    values = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
              "top_k": s.top_k, "seed": (s.seed + i) % 2**32}
    for key, field in ENGINE_FIELDS.items():
        if key in entry:
            try:
                values[key] = check_value(field, entry[key], key)
            except SamplingError as e:
                raise PromptError(f"{where}: {e}") from None
    try:
        return SamplingParams(max_tokens=values.pop("max_new_tokens"), ignore_eos=s.ignore_eos, **values,
                              **{k: entry[k] for k in LINE_FIELDS if entry.get(k) is not None})
    except SamplingError as e:
        raise PromptError(f"{where}: {e}") from None


def write_outputs(outputs, args, simulated: bool, has_tokenizer: bool) -> None:
    """JSONL lines to --output, or the texts on stdout (unless --quiet)."""
    out_file = open(args.output, "w", encoding="utf-8") if args.output else None
    try:
        for res in outputs:
            line = {"prompt_ids": res.prompt_token_ids, "output_ids": res.token_ids, "text": res.text,
                    "finish_reason": res.finish_reason}
            if res.accept_lengths is not None:
                line["accept_lengths"] = res.accept_lengths
            table = lambda e: None if e is None else {str(t): [lp.logprob, lp.rank] for t, lp in e.items()}  # noqa: E731
            if res.prompt_logprobs is not None:  # [null, {token id: [logprob, rank]}, ...]
                line["prompt_logprobs"] = [table(e) for e in res.prompt_logprobs]
            if res.outputs[0].logprobs is not None:
                line["logprobs"] = [table(e) for e in res.outputs[0].logprobs]
                if simulated:
                    line["exact"] = False
            if out_file:
                out_file.write(json.dumps(line) + "\n")
            elif not args.quiet:
                print(res.text if has_tokenizer else json.dumps(res.token_ids))
                print("-" * 40)
    finally:
        if out_file:
            out_file.close()


def run(args) -> int:
    from jaxspec.api import LLM
    from jaxspec.config import ConfigValueError
    from jaxspec.mesh import setup_mesh
    from jaxspec.prompts import read_jsonl
    from jaxspec.speculative.drafters import algorithm_info

    mesh = setup_mesh(args)  # multi-host init must come before anything touches devices
    cfg = config_from_args(args)
    cfg = with_model_sampling(cfg, lambda base: config_from_args(args, base=base), args.quiet)
    spec_on = algorithm_info(cfg.spec.algorithm).speculative
    if args.profile_phases and not spec_on:
        raise ConfigValueError("--profile-phases times the phases of speculative decoding: it needs --spec")
    if args.prompt is not None:
        entries = [{"prompt": args.prompt} if args.raw else {"messages": [{"role": "user", "content": args.prompt}]}]
    else:
        entries = read_jsonl(args.prompts)
    sampling = [line_sampling(e, cfg.sampling, i) for i, e in enumerate(entries)]  # before minutes of loading

    t0 = time.perf_counter()
    # benchmark=True: --simulate-accept-length is allowed, its output labelled non-exact.
    llm = LLM.from_config(cfg, mesh=mesh, progress=not args.quiet, benchmark=True, corpus_label="--ngram-corpus")
    if args.prompt is not None and not args.raw and not getattr(llm.tokenizer, "chat_template", None):
        entries = [{"prompt": args.prompt}]
    llm.compile(entries, sampling)  # so load+compile and generation are timed apart
    t_ready = time.perf_counter()
    outputs = llm.generate(entries, sampling)
    write_outputs(outputs, args, bool(cfg.spec.simulate_accept_length), llm.tokenizer is not None)

    t = llm.spec_stats()
    tok_s = t["decode_tok_s"] or float("nan")
    print(
        f"prompts={len(outputs)} new_tokens={t['new_tokens']} load+compile={t_ready - t0:.1f}s "
        f"prefill={t['prefill_s']:.2f}s decode={t['decode_s']:.2f}s decode_tok/s={tok_s:.1f}",
        file=sys.stderr,
    )
    if spec_on:
        label = f"spec[{cfg.spec.algorithm}]" + (" SIMULATED, output not exact" if cfg.spec.simulate_accept_length else "")
        print(llm.metrics.summary_line(label), file=sys.stderr)
        if llm.engine.adaptive is not None:
            print(llm.engine.adaptive.summary(), file=sys.stderr)
        if args.profile_phases:
            split = llm.profile_phases(entries, sampling)
            sec, tot = split["seconds"], split["total_s"] or float("nan")
            print("time split (phases timed apart, first batch): " + " ".join(
                f"{k}={v:.2f}s ({100 * v / tot:.0f}%)" for k, v in sec.items()), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from jaxspec.config import ConfigValueError
    from jaxspec.engine import RequestError
    from jaxspec.models.config import ConfigError
    from jaxspec.models.loading import LoadError
    from jaxspec.mesh import MeshError
    from jaxspec.prompts import PromptError
    from jaxspec.sampling_params import SamplingError
    from jaxspec.cache.paged import CacheMemoryError, OutOfPagesError
    from jaxspec.speculative.algorithm import SpecConfigError
    from jaxspec.native.build import NativeKernelError

    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ConfigValueError, SpecConfigError, RequestError, ConfigError, LoadError, PromptError, SamplingError,
            OutOfPagesError, CacheMemoryError, MeshError, NativeKernelError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
