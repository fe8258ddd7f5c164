"""`python -m jaxspec.bench decode`: plain greedy decode vs Hugging Face and the roofline.

One run, same prompts, float32, EOS ignored, 128 new tokens, batch 1 and 8.
Tokens/s is decode-only for jaxspec (prefill timed apart) and end-to-end
`generate` for Hugging Face, whose prefill of a ~40-token prompt is one
forward out of 128, so the comparison slightly favours jaxspec's view by ~1%.
"""

from __future__ import annotations

import argparse
import platform

import jax
import jax.numpy as jnp

from jaxspec.bench.common import CHAT_PROMPTS, chat_ids, hf_generate_tps, measure_read_bandwidth, median, print_table


def param_bytes(params) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def jaxspec_tps(engine, prompts, max_new_tokens: int, batch: int, reps: int) -> tuple[float, float]:
    """Median decode tokens/s and median ms per decode step (per batch step)."""
    from jaxspec.engine import Request

    reqs = [Request(p, max_new_tokens=max_new_tokens) for p in prompts]
    groups = [reqs[i : i + batch] for i in range(0, len(reqs), batch)]
    engine.generate(groups[0])  # compile + warm
    rates, step_ms = [], []
    for _ in range(reps):
        for g in groups:
            engine.generate(g)
            t = engine.last_timing
            rates.append(t["new_tokens"] / t["decode_s"])
            step_ms.append(1000 * t["decode_s"] / (max_new_tokens - 1))
    return median(rates), median(step_ms)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench decode")
    p.add_argument("--model", default="default")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-one-prompts", type=int, default=3, help="prompts run one at a time")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face peer")
    args = p.parse_args(argv)

    from jaxspec.config import EngineSection
    from jaxspec.engine import Engine
    from jaxspec.models.loading import load_model

    model = load_model(args.model, dtype=jnp.float32)
    prompts = chat_ids(model.tokenizer, CHAT_PROMPTS)
    engine = Engine(model.params, model.config, EngineSection(max_batch_size=8, max_context=512), progress=True)
    # The same engine on XLA's own CPU ops, to show what the native kernels buy (CPU only).
    xla_engine = None
    if jax.default_backend() == "cpu" and engine.native_kernels:
        xla_engine = Engine(model.params, model.config,
                            EngineSection(max_batch_size=8, max_context=512, cpu_kernels="xla"), progress=True)
    weight_bytes = param_bytes(model.params)
    bw = measure_read_bandwidth()
    roofline_tps = bw / weight_bytes  # tokens/s at batch 1 if only weights were read

    n = args.max_new_tokens
    j1, step1 = jaxspec_tps(engine, prompts[: args.batch_one_prompts], n, 1, args.reps)
    j8, step8 = jaxspec_tps(engine, prompts[:8], n, 8, args.reps)
    x1 = x8 = xs1 = xs8 = float("nan")
    if xla_engine is not None:
        x1, xs1 = jaxspec_tps(xla_engine, prompts[: args.batch_one_prompts], n, 1, args.reps)
        x8, xs8 = jaxspec_tps(xla_engine, prompts[:8], n, 8, args.reps)
    h1 = h8 = float("nan")
    if not args.no_hf:
        import torch
        import transformers as tf

        hf = tf.AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
        h1 = hf_generate_tps(hf, prompts[: args.batch_one_prompts], n, 1)
        h8 = hf_generate_tps(hf, prompts[:8], n, 8)

    print(f"\njaxspec decode benchmark: {model.path.name}, float32, {n} new tokens, EOS ignored")
    print(f"machine: {platform.processor() or platform.machine()}, backend {jax.default_backend()}, "
          f"read bandwidth {bw / 1e9:.1f} GB/s, weights {weight_bytes / 2**20:.0f} MiB, "
          f"roofline {roofline_tps:.1f} tok/s at batch 1\n")
    print_table(
        ["batch", "jaxspec tok/s", "HF tok/s", "jaxspec / HF", "ms per step", "roofline tok/s", "of roofline"],
        [
            [1, j1, h1, j1 / h1, step1, roofline_tps, f"{100 * j1 / roofline_tps:.0f}%"],
            [8, j8, h8, j8 / h8, step8, 8 * roofline_tps, f"{100 * j8 / (8 * roofline_tps):.0f}%"],
        ],
    )
    if xla_engine is not None:
        print("\nthe same engine on XLA's own CPU ops (engine.cpu_kernels = xla):")
        print_table(["batch", "tok/s", "ms per step", "native kernels / XLA ops"],
                    [[1, x1, xs1, j1 / x1], [8, x8, xs8, j8 / x8]])
    ratio = lambda a, b: "n/a" if a != a or b != b else f"{a / b:.2f}x"  # noqa: E731 (NaN: not run)
    print(f"\nbatch-8 / batch-1 throughput: jaxspec {j8 / j1:.2f}x, jaxspec on XLA ops {ratio(x8, x1)}, "
          f"HF {ratio(h8, h1)}")
    return 0
