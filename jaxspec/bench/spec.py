"""`python -m jaxspec.bench spec`: speculative decoding vs plain decoding vs Hugging Face.

One run, embedded model, float32, batch 1, EOS ignored. Prints Markdown tables:

1. per prompt set and method: tau, decode tokens/s (median over prompts) and
   the ratio to jaxspec plain decoding and to Hugging Face (plain `generate`
   and prompt-lookup decoding on the same prompts);
2. the cost of one verify forward over T tokens relative to a decode step;
3. a synthetic-acceptance sweep (L = 1..8, output NOT exact) showing the
   system's ceiling.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.common import chat_ids, hf_generate_tps, median, print_table, timed


def engine_for(model, spec_kw: dict | None, draft=None):
    from jaxspec.config import EngineSection, SpecSection
    from jaxspec.engine import Engine

    ecfg = EngineSection(max_batch_size=1, max_context=1024, length_buckets=(128, 256, 512, 1024))
    spec = SpecSection(**spec_kw) if spec_kw else None
    return Engine(model.params, model.config, ecfg, progress=False, spec=spec, draft=draft)


def run_engine(engine, prompts, max_new: int, warm: bool = True) -> tuple[list[float], list[int]]:
    """(decode tokens/s per prompt, accept lengths) at batch 1; `warm` first runs prompt 0 once."""
    from jaxspec.engine import Request

    if warm:
        engine.generate([Request(prompts[0], max_new_tokens=max_new)])
    rates, lens = [], []
    for p in prompts:
        res = engine.generate([Request(p, max_new_tokens=max_new)])[0]
        t = engine.last_timing
        rates.append(t["new_tokens"] / t["decode_s"])
        lens += res.accept_lengths or []
    return rates, lens


def run_interleaved(engines: dict, prompts, max_new: int, reps: int) -> dict[str, tuple[float, float]]:
    """{name: (median tok/s, tau)}. Methods take turns within each repetition, so the
    slow drift of a noisy machine hits all of them alike instead of whichever ran last."""
    rates = {name: [] for name in engines}
    lens = {name: [] for name in engines}
    for rep in range(reps):
        for name, eng in engines.items():
            r, acc = run_engine(eng, prompts, max_new, warm=rep == 0)
            rates[name] += r
            lens[name] += acc
    return {name: (median(rates[name]), float(np.mean(lens[name])) if lens[name] else 1.0) for name in engines}


def run_hf(hf, prompts, max_new: int, lookup: int = 0) -> float:
    """Median Hugging Face tokens/s at batch 1 (plain `generate`, or prompt lookup)."""
    return hf_generate_tps(hf, prompts, max_new, batch=1, lookup=lookup)


def verify_cost(model, sizes=(1, 2, 4, 8, 16), reps: int = 15, cpu_kernels: str = "auto") -> dict[int, float]:
    """Median ms of one target forward over T query tokens at a 256-token prefix."""
    from jaxspec.cache.paged import KVCache
    from jaxspec.models.llama import forward, prepare_params
    from jaxspec.native.build import use_native_kernels

    c = model.config
    params = prepare_params(model.params, c, native=use_native_kernels(cpu_kernels, model.params["embed"].dtype, None))
    cache = KVCache.zeros(c.num_layers, 1 + 32, 16, c.num_kv_heads, c.head_dim)
    pt = jnp.arange(1, 33, dtype=jnp.int32)[None]
    calls = {}
    for t in sizes:
        f = jax.jit(lambda p, ca, tok, pos, t=t: forward(p, c, tok, pos, ca, pt, q_start=jnp.array([256]),
                                                         kv_len=jnp.array([256 + t])).logits)
        tok = jnp.ones((1, t), jnp.int32)
        pos = 256 + jnp.arange(t)[None]
        f(params, cache, tok, pos).block_until_ready()
        calls[t] = lambda f=f, tok=tok, pos=pos: f(params, cache, tok, pos).block_until_ready()
    # Round-robin over T, so machine drift during the run hits every width alike.
    times = {t: [] for t in sizes}
    for _ in range(reps):
        for t in sizes:
            times[t] += timed(calls[t], 1)
    out = {t: 1000 * median(ts) for t, ts in times.items()}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench spec")
    p.add_argument("--model", default="default")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-layers", type=int, default=20)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--reps", type=int, default=2, help="interleaved repetitions of every jaxspec method")
    args = p.parse_args(argv)

    from jaxspec.bench.prompts import humaneval_rewrite_prompts, mtbench_questions, repeat_prompts
    from jaxspec.models.loading import load_model
    from jaxspec.spec.standalone import truncate_layers

    model = load_model(args.model, dtype=jnp.float32)
    n, new = args.num_prompts, args.max_new_tokens
    sets = {
        "copy: HumanEval rewrite": chat_ids(model.tokenizer, humaneval_rewrite_prompts(n)),
        "copy: repeat text": chat_ids(model.tokenizer, repeat_prompts(n)),
        "MT-Bench": chat_ids(model.tokenizer, mtbench_questions(n)),
    }
    ngram = dict(algorithm="ngram", topk=1, num_steps=7, num_draft_tokens=8, ngram_max_match=4)
    ngram_tree = dict(algorithm="ngram", topk=4, num_steps=3, num_draft_tokens=16, ngram_max_match=4)
    trunc = dict(algorithm="standalone", topk=1, num_steps=3, num_draft_tokens=4, draft_layers=args.draft_layers)
    draft = truncate_layers(model.params, model.config, args.draft_layers)
    methods = {
        "jaxspec plain": (None, None),
        "jaxspec n-gram chain k=7": (ngram, None),
        "jaxspec n-gram tree 16": (ngram_tree, None),
        f"jaxspec truncated-{args.draft_layers} chain k=3": (trunc, draft),
    }
    engines = {name: engine_for(model, kw, d) for name, (kw, d) in methods.items()}
    hf = None
    if not args.no_hf:
        import torch
        import transformers as tf

        hf = tf.AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()

    rows = []
    for set_name, prompts in sets.items():
        chosen = {name: eng for name, eng in engines.items()
                  if set_name == "MT-Bench" or not name.startswith("jaxspec truncated")}
        measured = run_interleaved(chosen, prompts, new, args.reps)
        base = measured["jaxspec plain"][0]
        hf_plain = run_hf(hf, prompts, new) if hf else float("nan")
        for name, (tps, tau) in measured.items():
            rows.append([set_name, name, tau, tps, tps / base, tps / hf_plain])
        if hf:
            rows.append([set_name, "HF generate", 1.0, hf_plain, hf_plain / base, 1.0])
            lookup = run_hf(hf, prompts, new, lookup=10)
            rows.append([set_name, "HF prompt lookup (10)", float("nan"), lookup, lookup / base, lookup / hf_plain])

    print(f"\njaxspec spec benchmark: {model.path.name}, float32, batch 1, {new} new tokens, EOS ignored, "
          f"{n} prompts per set, medians")
    print_table(["prompts", "method", "tau", "tok/s", "vs jaxspec plain", "vs HF generate"], rows)

    # The engine's native CPU kernels beside XLA's own ops, to show what the kernels buy.
    cost = verify_cost(model)
    xla = verify_cost(model, cpu_kernels="xla")
    print("\nverify forward cost (one target forward over T tokens, 256-token prefix, median ms):")
    print_table(["T", "ms", "vs T=1", "ms (XLA ops)", "vs T=1 (XLA ops)"],
                [[t, ms, ms / cost[1], xla[t], xla[t] / xla[1]] for t, ms in cost.items()])

    if not args.no_sweep:
        prompts = sets["MT-Bench"][:1]
        base = median(run_engine(engines["jaxspec plain"], prompts, new)[0])
        sweep = []
        for L in range(1, 9):
            kw = dict(algorithm="ngram", topk=1, num_steps=8, num_draft_tokens=9, simulate_accept_length=L)
            rates, lens = run_engine(engine_for(model, kw), prompts, new)
            tps, tau = median(rates), float(np.mean(lens))
            sweep.append([L, tau, tps, tps / base])
        print("\nsynthetic acceptance sweep (n-gram chain of 8, acceptance forced to L; output NOT exact):")
        print_table(["L", "tau", "tok/s", "vs jaxspec plain"], sweep)
    return 0
