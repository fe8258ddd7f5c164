"""`python -m jaxspec.bench shared`: one `Engine.generate` batch whose prompts share a system prompt.

The offline engine prefills a batch's rows together, so rows that open the same way would each
compute the shared pages. With the prefix cache on it prefills the rows that lead first and the
others in a second call that adopts what the first published (`cache.prefix.shared_in_batch`).
Three modes, interleaved per repetition, the prefix cache emptied before every call so only the
batch's own sharing counts:

* cache off: every row prefills its whole prompt (one call);
* one call: the cache on, in-batch sharing off (the engine before 2026-12-07);
* shared: the default.

Prints the prefill seconds (the batch's time to first token: every first token comes from the
prefill), the generate call's seconds, and the prompt tokens served from the cache, medians.
"""

from __future__ import annotations

import argparse
import time

from jaxspec.bench.common import chat_ids, median, print_table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench shared")
    p.add_argument("--batch", type=int, default=8, help="prompts per generate call (MT-Bench first turns)")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per prompt (EOS ignored)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per mode (after one warm-up)")
    args = p.parse_args(argv)
    if args.batch < 2 or args.reps < 1 or args.max_tokens < 1:
        raise SystemExit("--batch must be >= 2, --reps and --max-tokens >= 1")

    from jaxspec.bench.multiturn import SYSTEM_PROMPT
    from jaxspec.bench.prompts import mtbench_questions
    from jaxspec.config import EngineSection
    from jaxspec.engine import Engine, Request, offline
    from jaxspec.models.loading import load_model
    from jaxspec.sampling_params import SamplingParams

    model = load_model("default", progress=False)
    prompts = chat_ids(model.tokenizer, mtbench_questions(args.batch), system=SYSTEM_PROMPT)
    ecfg = EngineSection(max_batch_size=args.batch, max_context=1024, length_buckets=(128, 256, 512, 1024),
                         batch_buckets=(args.batch,))
    engine = Engine(model.params, model.config, ecfg, progress=False, benchmark=True)
    alloc, share_min = engine.runner.allocator, offline.SHARE_MIN_TOKENS
    reqs = [Request(p, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)) for p in prompts]
    modes = {"cache off": (False, share_min), "one call (no in-batch sharing)": (True, 1 << 30),
             "shared (default)": (True, share_min)}
    got = {m: {"prefill": [], "total": [], "cached": 0} for m in modes}
    outputs = {}
    for rep in range(args.reps + 1):
        for mode, (enabled, threshold) in modes.items():
            alloc.drop_cached()
            alloc.enabled, offline.SHARE_MIN_TOKENS = enabled, threshold
            t0 = time.perf_counter()
            res = engine.generate(reqs)
            total = time.perf_counter() - t0
            outputs.setdefault(mode, [r.output_ids for r in res])
            if rep:  # the first pass compiles every shape a mode needs
                got[mode]["prefill"].append(engine.last_timing["prefill_s"])
                got[mode]["total"].append(total)
                got[mode]["cached"] = sum(r.num_cached_tokens for r in res)
    offline.SHARE_MIN_TOKENS, alloc.enabled = share_min, True
    if len({tuple(map(tuple, o)) for o in outputs.values()}) != 1:
        raise SystemExit("the modes' greedy outputs differ: the cache changed what was generated")
    base = median(got["cache off"]["prefill"])
    print(f"\nshared system prompt: {args.batch} MT-Bench first turns in one generate call, "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} prompt tokens each, {args.max_tokens} new tokens, "
          f"SmolLM2-135M float32, median of {args.reps}; outputs identical across modes")
    print_table(["mode", "prefill s (time to first token)", "vs cache off", "generate s", "prompt tokens cached"],
                [[m, median(g["prefill"]), base / median(g["prefill"]), median(g["total"]), g["cached"]]
                 for m, g in got.items()])
    return 0
