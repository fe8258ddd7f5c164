"""Shared benchmark pieces: prompts, bandwidth measurement, Hugging Face peer, tables."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import numpy as np

# Chat prompts for decode benchmarks; EOS is ignored, so their length only
# sets the prefix. Eight, so batch 8 uses each once.
CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the ocean.",
    "Explain what a hash table is in two sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give three tips for writing clear technical documentation.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "What are the main differences between TCP and UDP?",
    "Describe how photosynthesis works to a ten-year-old.",
]


def chat_ids(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    out = []
    for text in texts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def measure_read_bandwidth(num_bytes: int = 1 << 30, reps: int = 7) -> float:
    """Best of numpy (1 thread) and XLA (all cores) streaming-sum bandwidth, bytes/s (median)."""
    import jax
    import jax.numpy as jnp

    a = np.ones(num_bytes // 4, np.float32)
    np_times = timed(a.sum, reps)
    x = jnp.asarray(a)
    f = jax.jit(lambda v: jnp.sum(v))
    f(x).block_until_ready()
    jx_times = timed(lambda: f(x).block_until_ready(), reps)
    return num_bytes / min(median(np_times), median(jx_times))


def hf_generate_tps(
    model, prompts: list[list[int]], max_new_tokens: int, batch: int, reps: int = 1, lookup: int = 0
) -> float:
    """Hugging Face `generate` greedy tokens/s (median), EOS ignored; left-padded batches.
    `lookup` > 0 turns on prompt-lookup decoding with that many draft tokens."""
    return median(hf_generate_rates(model, prompts, max_new_tokens, batch, reps, lookup))


def hf_generate_rates(
    model, prompts: list[list[int]], max_new_tokens: int, batch: int, reps: int = 1, lookup: int = 0
) -> list[float]:
    """tokens/s of every batch in order (batch-major within each repetition)."""
    import torch

    model.generation_config.eos_token_id = None
    rates = []
    for _ in range(reps):
        for start in range(0, len(prompts), batch):
            chunk = prompts[start : start + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            with torch.no_grad():
                t0 = time.perf_counter()
                model.generate(
                    ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                    do_sample=False, pad_token_id=0, eos_token_id=None,
                    **(dict(prompt_lookup_num_tokens=lookup) if lookup else {}),
                )
                dt = time.perf_counter() - t0
            rates.append(len(chunk) * max_new_tokens / dt)
    return rates


def timed(fn: Callable[[], object], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """A Markdown table, so the output pastes straight into the README."""
    fmt = lambda v: ("n/a" if v != v else f"{v:.2f}") if isinstance(v, float) else str(v)  # noqa: E731
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---" for _ in headers) + "|")
    for row in rows:
        print("| " + " | ".join(fmt(v) for v in row) + " |")
