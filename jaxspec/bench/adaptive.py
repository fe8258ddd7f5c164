"""`python -m jaxspec.bench adaptive`: does speculation ever lose? (issue 24)

The engine's adaptive policy (`Engine(adaptive=True)`, on for a drafter's default shape) against
plain decoding and against the same drafter at its fixed shape, per batch size, greedy and sampled,
side by side in one process. MT-Bench questions, EOS ignored, whole batches:

    batch B, sampling S:  plain | n-gram fixed (k=7, k=1) | n-gram adaptive | EAGLE-3 fixed | EAGLE-3 adaptive

Every method at one (B, S) runs the same prompts, interleaved over `--reps`, and reports decode
tokens/s (all rows' new tokens over the decode time) and its ratio to plain at the same sampling.
The issue's targets read straight off the table: adaptive >= 0.97x plain at every batch and
sampling, and at batch 1 within 5% of the best of plain and the fixed draft lengths (the drafter's
shape and, `--fixed-lengths`, the shorter chains the policy may also choose). The policy's own
summary line (which program each bucket ran) is printed under each adaptive row.
"""

from __future__ import annotations

import argparse

from jaxspec.bench.common import chat_ids, median, print_table

# The drafters under test: the n-gram chain of the README and the shipped EAGLE-3 head's chain of 3
# (its best shape at batch 1, `bench spec`).
DRAFTERS = {"n-gram k=7": dict(algorithm="ngram", topk=1, num_steps=7, num_draft_tokens=8, ngram_max_match=4),
            "EAGLE-3 chain k=3": dict(algorithm="eagle3", draft_model="default", topk=1, num_steps=3,
                                      num_draft_tokens=4)}


def parse_sampling(text: str) -> list[tuple[str, dict]]:
    """--sampling "greedy,0.8:0.9" -> [(label, SamplingParams fields)]; T:TOP_P or T."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if item == "greedy":
            out.append(("greedy", {}))
            continue
        try:
            t, top_p = ([float(x) for x in item.split(":")] + [1.0])[:2] if item.count(":") <= 1 else (0.0, 0.0)
        except ValueError:
            t = top_p = 0.0
        if not (t > 0 and 0 < top_p <= 1):
            raise SystemExit(f"--sampling: expected 'greedy' or T[:TOP_P] with T > 0 and 0 < TOP_P <= 1; got {item!r}")
        out.append((f"T {t:g}" + (f", top-p {top_p:g}" if top_p < 1 else ""), dict(temperature=t, top_p=top_p)))
    if not out:
        raise SystemExit("--sampling: empty")
    return out


def parse_batches(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise SystemExit(f"--batches: expected a comma list of positive batch sizes; got {text!r}")
    return out


def run_batch(engine, prompts, new: int, fields: dict, seed: int) -> float:
    """Decode tokens/s of one whole batch, each row seeded (sampled rows repeat across methods)."""
    from jaxspec.engine import Request
    from jaxspec.sampling_params import SamplingParams

    reqs = [Request(p, SamplingParams(max_tokens=new, seed=seed + i, **fields)) for i, p in enumerate(prompts)]
    engine.generate(reqs)
    t = engine.last_timing
    return t["new_tokens"] / t["decode_s"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench adaptive")
    p.add_argument("--model", default="default")
    p.add_argument("--batches", default="1,8,32", help="comma list of batch sizes")
    p.add_argument("--sampling", default="greedy,0.8:0.9", help="comma list: greedy and/or T[:TOP_P]")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batches-per-size", type=int, default=2,
                   help="distinct prompt batches per batch size (batch 1: prompts)")
    p.add_argument("--reps", type=int, default=2, help="interleaved repetitions")
    p.add_argument("--drafters", default=",".join(DRAFTERS), help=f"comma list of: {', '.join(DRAFTERS)}")
    p.add_argument("--fixed-lengths", default="1",
                   help="shorter fixed chains also timed per drafter ('' = none; default 1, spec.adaptive_lengths)")
    args = p.parse_args(argv)
    batches, samplings = parse_batches(args.batches), parse_sampling(args.sampling)
    try:
        lengths = [int(x) for x in args.fixed_lengths.split(",") if x.strip()]
    except ValueError:
        lengths = [0]
    if any(n < 1 for n in lengths):
        raise SystemExit(f"--fixed-lengths: expected a comma list of draft lengths >= 1; got {args.fixed_lengths!r}")
    names = [x.strip() for x in args.drafters.split(",") if x.strip()]
    bad = [x for x in names if x not in DRAFTERS]
    if bad or not names:
        raise SystemExit(f"--drafters: unknown {', '.join(bad) or '(none)'}; drafters: {', '.join(DRAFTERS)}")

    import jax.numpy as jnp

    from jaxspec.bench import prompts as ps
    from jaxspec.bench.spec import engine_for
    from jaxspec.config import SpecSection
    from jaxspec.models.loading import load_model
    from jaxspec.speculative.drafters.load import load_draft

    model = load_model(args.model, dtype=jnp.float32)
    need = max(batches) * args.batches_per_size
    questions = ps.mtbench_questions(need)
    prompts = chat_ids(model.tokenizer, (questions * (need // max(len(questions), 1) + 1))[:need])
    drafts = {}
    for name in names:
        kw = DRAFTERS[name]
        drafts[name] = load_draft(SpecSection(**kw), model, jnp.float32, progress=False) \
            if kw["algorithm"] != "ngram" else None

    print(f"jaxspec adaptive benchmark: {model.path.name}, float32, MT-Bench, {args.max_new_tokens} new tokens, "
          f"EOS ignored; {args.batches_per_size} batches x {args.reps} reps per cell, interleaved")
    rows, summaries = [], []
    for b in batches:
        engines = {"plain": engine_for(model, None, batch=b)}
        for name in names:
            kw = DRAFTERS[name]
            engines[f"{name} fixed"] = engine_for(model, kw, drafts[name], batch=b)
            for n in (n for n in lengths if n < kw["num_steps"]):
                engines[f"{name} fixed k={n}"] = engine_for(model, dict(kw, num_steps=n, num_draft_tokens=n + 1),
                                                            drafts[name], batch=b)
            engines[f"{name} adaptive"] = engine_for(model, dict(kw, adaptive="on"), drafts[name], batch=b)
        groups = [prompts[i * b:(i + 1) * b] for i in range(args.batches_per_size)]
        for label, fields in samplings:
            rates = {k: [] for k in engines}
            for e in engines.values():  # compile, calibrate and warm every program at this shape
                run_batch(e, groups[0], args.max_new_tokens, fields, seed=0)
            for rep in range(args.reps):
                for gi, g in enumerate(groups):
                    for k, e in engines.items():
                        rates[k].append(run_batch(e, g, args.max_new_tokens, fields, seed=1000 * rep + 100 * gi))
            base = median(rates["plain"])
            for k, r in rates.items():
                name = k.removesuffix(" adaptive")
                fixed = [median(v) for f, v in rates.items() if f.startswith(f"{name} fixed")]
                best = max([base] + fixed) if k.endswith(" adaptive") else float("nan")
                rows.append([b, label, k, median(r), median(r) / base, median(r) / best])
        for k, e in engines.items():
            if getattr(e, "adaptive", None) is not None:
                summaries.append(f"batch {b}, {k}: {e.adaptive.summary()}")
    print_table(["batch", "sampling", "method", "tok/s", "vs plain", "vs best of plain and fixed lengths"], rows)
    print("\nthe policy's choices (every batch of the run, warm-up included):")
    for line in summaries:
        print(f"- {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

