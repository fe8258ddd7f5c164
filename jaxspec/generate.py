"""`python -m jaxspec.generate`: the main CLI. Scripts and benchmarks build on it.

    python -m jaxspec.generate --prompt "Write a haiku about TPUs."
    python -m jaxspec.generate --prompts in.jsonl --output out.jsonl --batch-size 8

Input lines: {"messages": [...]} (chat template applied), {"prompt": "raw text"}
or {"prompt_ids": [...]}; a line may also carry its own max_new_tokens,
temperature, top_p, top_k and seed. Output lines: {"prompt_ids", "output_ids",
"text", "finish_reason"}.
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
    "max_new_tokens": "sampling.max_new_tokens",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "seed": "sampling.seed",
    "ignore_eos": "sampling.ignore_eos",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxspec.generate", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="configs/*.toml file; flags override it")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key, e.g. --set engine.length_buckets=64,128")
    p.add_argument("--model", help="'default' (embedded SmolLM2), a Hugging Face dir or a .gguf file")
    p.add_argument("--dtype", choices=["float32", "bfloat16"])
    p.add_argument("--cache-dir", help="where converted GGUF checkpoints are cached")
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
    p.add_argument("--page-size", type=int)
    p.add_argument("--num-pages", type=int)
    p.add_argument("--max-context", type=int)
    p.add_argument("--output", metavar="FILE.jsonl")
    p.add_argument("--quiet", action="store_true", help="no progress bars, no text on stdout")
    return p


def config_from_args(args) -> Any:
    from jaxspec.config import ConfigValueError, load_config

    overrides: dict[str, Any] = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigValueError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        overrides[key.strip()] = value
    for dest, key in FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides[key] = value
    return load_config(args.config, overrides)


def build_requests(entries: list[dict], tokenizer, cfg, stop_ids: tuple[int, ...]):
    from jaxspec.engine import Request
    from jaxspec.prompts import PromptError, encode_entry

    s = cfg.sampling
    requests = []
    for i, entry in enumerate(entries):
        where = entry.get("_where", f"prompt {i}")
        ids = encode_entry(entry, tokenizer, where)
        try:
            req = Request(
                prompt_ids=ids,
                max_new_tokens=int(entry.get("max_new_tokens", s.max_new_tokens)),
                temperature=float(entry.get("temperature", s.temperature)),
                top_p=float(entry.get("top_p", s.top_p)),
                top_k=int(entry.get("top_k", s.top_k)),
                seed=int(entry.get("seed", s.seed + i)),
                stop_token_ids=() if s.ignore_eos else stop_ids,
            )
        except (TypeError, ValueError):
            raise PromptError(f"{where}: sampling fields must be numbers") from None
        if req.temperature < 0 or not 0 < req.top_p <= 1 or req.top_k < 0:
            raise PromptError(f"{where}: need temperature >= 0, 0 < top_p <= 1, top_k >= 0")
        requests.append(req)
    return requests


def stop_token_ids(model) -> tuple[int, ...]:
    ids = set(model.config.eos_token_ids)
    tok = model.tokenizer
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return tuple(sorted(ids))


def run(args) -> int:
    import jax.numpy as jnp

    from jaxspec.engine import Engine
    from jaxspec.models.loading import load_model
    from jaxspec.prompts import read_jsonl

    cfg = config_from_args(args)
    progress = not args.quiet
    if args.prompt is not None:
        entries = [{"prompt": args.prompt} if args.raw else {"messages": [{"role": "user", "content": args.prompt}]}]
    else:
        entries = read_jsonl(args.prompts)

    t0 = time.perf_counter()
    dtype = jnp.float32 if cfg.model.dtype == "float32" else jnp.bfloat16
    model = load_model(cfg.model.path, dtype=dtype, cache_dir=cfg.model.cache_dir or None, progress=progress)
    if args.prompt is not None and not args.raw and not getattr(model.tokenizer, "chat_template", None):
        entries = [{"prompt": args.prompt}]
    requests = build_requests(entries, model.tokenizer, cfg, stop_token_ids(model))
    engine = Engine(model.params, model.config, cfg.engine, progress=progress)
    engine.compile(sorted({bucket for _, bucket in engine.plan(requests)}))
    t_ready = time.perf_counter()
    results = engine.generate(requests)

    out_file = open(args.output, "w", encoding="utf-8") if args.output else None
    try:
        for res in results:
            text = model.tokenizer.decode(res.output_ids, skip_special_tokens=True) if model.tokenizer else ""
            line = {"prompt_ids": res.prompt_ids, "output_ids": res.output_ids, "text": text,
                    "finish_reason": res.finish_reason}
            if out_file:
                out_file.write(json.dumps(line) + "\n")
            elif not args.quiet:
                print(text if model.tokenizer else json.dumps(res.output_ids))
                print("-" * 40)
    finally:
        if out_file:
            out_file.close()
    t = engine.last_timing
    decode_tps = t["new_tokens"] / t["decode_s"] if t["decode_s"] > 0 else float("nan")
    print(
        f"prompts={len(results)} new_tokens={t['new_tokens']} load+compile={t_ready - t0:.1f}s "
        f"prefill={t['prefill_s']:.2f}s decode={t['decode_s']:.2f}s decode_tok/s={decode_tps:.1f}",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    from jaxspec.config import ConfigValueError
    from jaxspec.engine import RequestError
    from jaxspec.models.config import ConfigError
    from jaxspec.models.loading import LoadError
    from jaxspec.prompts import PromptError
    from jaxspec.cache.paged import OutOfPagesError

    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ConfigValueError, RequestError, ConfigError, LoadError, PromptError, OutOfPagesError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
