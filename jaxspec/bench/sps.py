"""`python -m jaxspec.bench sps`: the target's verify steps per second against tokens in the batch,
the table the DSPARK verify planner reads (`jaxspec.speculative.drafters.planner.SPSTable`).

For every batch B and width w, one jitted target forward over B rows x w tokens each, the way the
speculative loop's verify forward runs: a chain block (causal tree mask) written at cache slots
context..context+w-1 of a paged KV cache that holds `--context` tokens per row, logits at every
position, the cache donated. After a compile-and-warm call, each repeat times `--steps` forwards
back to back, the repeats going round-robin over every (B, w) (a busy spell slows them alike);
steps/s is the median over `--repeats`. The table maps tokens = B*w to that rate; where several (B, w) give the same token count, the one of largest B is kept (a planner at batch
B spends its budget across rows). The JSON goes to `--out` (default `configs/sps/<device>.json`,
`cpu-<cores>core` on CPU); a Markdown table is printed. No timing is asserted anywhere: the numbers
belong to the machine at hand and to what else ran on it meanwhile.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of ints, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {text!r}")
    return tuple(sorted(set(vals)))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def device_name() -> str:
    """A file-name-safe name of the machine at hand: `cpu-<cores>core` on CPU, else the device kind."""
    if jax.default_backend() == "cpu":
        return f"cpu-{_cores()}core"
    kind = jax.devices()[0].device_kind
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or jax.default_backend()


def device_description() -> str:
    if jax.default_backend() == "cpu":
        return f"{platform.processor() or platform.machine()} ({_cores()} cores), XLA:CPU"
    return f"{jax.devices()[0].device_kind} ({jax.default_backend()})"


# Per-row sampling the `--sampled` comparison times beside greedy (temperature, top-k, top-p).
SAMPLED = {"greedy": (0.0, 0, 1.0), "T 0.8": (0.8, 0, 1.0), "T 0.8, top-k 50": (0.8, 50, 1.0),
           "T 0.8, top-p 0.9": (0.8, 0, 0.9)}


def make_verify_fn(cfg, accept: tuple[float, int, float] | None = None):
    """verify(params, cache, tokens [B, w], page_table, seq_lens [B]) -> (cache, logits [B, w, V]).

    `accept` = (temperature, top_k, top_p): return instead what the loop's verify decides (the
    argmax of every position for greedy rows; the coupled rule's walk and bonus for sampled ones),
    so a timing holds the whole verify step."""
    from jaxspec.engine.device_sampling import DeviceSampling
    from jaxspec.models.llama import forward
    from jaxspec.speculative.sampling import argmax_last
    from jaxspec.speculative.tree import build_chain_tree
    from jaxspec.speculative.verify import verify_coupled

    def verify(params, cache, tokens, page_table, seq_lens):
        tree = build_chain_tree(tokens, seq_lens)
        out = forward(params, cfg, tokens, tree.positions, cache, page_table, q_start=seq_lens,
                      kv_len=seq_lens + tokens.shape[1], tree_mask=tree.mask)
        if accept is None:
            return out.cache, out.logits
        b, w = tokens.shape
        t, k, p = accept
        if t <= 0:
            return out.cache, argmax_last(out.logits)
        sp = dataclasses.replace(DeviceSampling.pack([None] * b, b), temperature=jnp.full((b,), t, jnp.float32),
                                 top_k=jnp.full((b,), k, jnp.int32), top_p=jnp.full((b,), p, jnp.float32),
                                 seed=jnp.arange(b, dtype=jnp.uint32))
        # The loop's coupled walk over the fed tokens (random: the walk stops early, as on a miss).
        res = verify_coupled(tokens, tree.retrieve_next_token, tree.retrieve_next_sibling, out.logits, tree.depth,
                             sp, seq_lens + 1, max_depth=w - 1)
        return out.cache, res.bonus_token

    return jax.jit(verify, donate_argnums=(1,))


def chat_rows(tokenizer, rows: int, length: int) -> np.ndarray:  # [rows, length] int32
    """`rows` held-out ShareGPT conversations (the chat template over their user and assistant turns)
    cut to `length` tokens each: what a sampled verify reads must be chat's logits. Over random tokens
    in an empty cache the logits are flat, every row's nucleus overflows the sampler's top-64
    candidates and the step takes the dense path, which chat rarely does (docs/benchmarks.md)."""
    from jaxspec.train.sharegpt import sharegpt_conversations

    out = []
    for conv in sharegpt_conversations("heldout"):
        ids = tokenizer.apply_chat_template(list(conv.messages), tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        if len(ids) >= length:
            out.append(ids[:length])
            if len(out) == rows:
                return np.asarray(out, np.int32)
    raise ValueError(f"ShareGPT's held-out split has only {len(out)} conversations of {length}+ tokens; "
                     f"{rows} needed (lower --context)")


def measure(params, cfg, batches, widths, *, context: int = 256, repeats: int = 3, steps: int = 5,
            page_size: int = 16, seed: int = 0, progress: bool = False,
            accepts: dict[str, tuple] | None = None, text: np.ndarray | None = None) -> dict[tuple, float]:
    """{(B, w): median verify steps/s} for every batch x width; `params` in the runtime layout
    (`prepare_params`). With `accepts` ({label: (temperature, top_k, top_p)}): {(B, w, label): ...},
    each step also deciding the emitted tokens under that sampling (`make_verify_fn`). With `text`
    ([max B, context + max w] token ids), each row's cache holds its first `context` tokens
    (prefilled) and the verified block is the text's next w tokens; else the cache is zeros and the
    block random.

    Every (B, w) is compiled and warmed first; then the repeats run round-robin over all of them,
    so a spell of other work on the machine slows every configuration alike instead of a few."""
    from jaxspec.cache.paged import KVCache

    modes = accepts or {None: None}
    fns = {label: make_verify_fn(cfg, acc) for label, acc in modes.items()}
    rng = np.random.default_rng(seed)
    dtype = params["embed"].dtype
    pages_per_seq = -(-(context + max(widths)) // page_size)
    caches, tables, lens, toks = {}, {}, {}, {}
    for b in batches:
        # Page 0 is the null page; row r owns pages 1 + r*P .. (r+1)*P.
        caches[b] = KVCache.zeros(cfg.num_layers, b * pages_per_seq + 1, page_size, cfg.num_kv_heads,
                                  cfg.head_dim, dtype)
        tables[b] = jnp.asarray(1 + np.arange(b * pages_per_seq, dtype=np.int32).reshape(b, pages_per_seq))
        lens[b] = jnp.full((b,), context, jnp.int32)
        if text is not None:  # one chain block of the whole context from slot 0: the prefill
            caches[b], _ = make_verify_fn(cfg)(params, caches[b], jnp.asarray(text[:b, :context]), tables[b],
                                               jnp.zeros((b,), jnp.int32))
        for w in widths:
            toks[b, w] = (jnp.asarray(text[:b, context:context + w]) if text is not None
                          else jnp.asarray(rng.integers(0, cfg.vocab_size, (b, w)), jnp.int32))
            for label, fn in fns.items():
                t0 = time.perf_counter()
                caches[b], logits = fn(params, caches[b], toks[b, w], tables[b], lens[b])  # compile + warm
                logits.block_until_ready()
                if progress:
                    print(f"  compiled B={b} w={w}{'' if label is None else ' ' + label} "
                          f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    keys = [(b, w, label) for b, w in toks for label in fns]
    rates: dict[tuple, list[float]] = {k: [] for k in keys}
    for r in range(repeats):
        for b, w, label in keys:
            fn = fns[label]
            t0 = time.perf_counter()
            for _ in range(steps):
                caches[b], logits = fn(params, caches[b], toks[b, w], tables[b], lens[b])
            logits.block_until_ready()
            rates[b, w, label].append(steps / (time.perf_counter() - t0))
        if progress:
            print(f"  repeat {r + 1}/{repeats}: " + ", ".join(
                f"B{b}w{w}{'' if lb is None else ' ' + lb} {v[-1]:.1f}" for (b, w, lb), v in rates.items()),
                file=sys.stderr, flush=True)
    med = {k: float(np.median(v)) for k, v in rates.items()}
    return med if accepts else {(b, w): v for (b, w, _), v in med.items()}


def print_sampled(measured: dict[tuple, float]) -> None:
    """Each sampled verify step's cost against the greedy step of the same batch and width."""
    from jaxspec.bench.common import print_table

    labels = [lb for lb in SAMPLED if lb != "greedy"]
    bw = sorted({(b, w) for b, w, _ in measured})
    print("\nverify step (forward + accept decision), sampled (coupled rule) against greedy, ms/step:\n")
    print_table(["batch", "width", "greedy ms"] + [f"{lb} ms" for lb in labels] + [f"{lb} / greedy" for lb in labels],
                [[b, w, 1000 / measured[b, w, "greedy"]] + [1000 / measured[b, w, lb] for lb in labels]
                 + [f"{measured[b, w, 'greedy'] / measured[b, w, lb]:.2f}x" for lb in labels] for b, w in bw])


def to_table(measured: dict[tuple[int, int], float], **meta):
    """The SPSTable of B*w -> steps/s, keeping the largest B where token counts collide."""
    from jaxspec.speculative.drafters.planner import SPSTable

    best: dict[int, tuple[int, float]] = {}
    for (b, w), rate in measured.items():
        t = b * w
        if t not in best or b > best[t][0]:
            best[t] = (b, rate)
    tokens = tuple(sorted(best))
    return SPSTable(tokens, tuple(best[t][1] for t in tokens),
                    measurements=tuple((b, w, r) for (b, w), r in sorted(measured.items())), **meta)


def load_note(before: float | None, after: float | None) -> str:
    """The 1-minute load average before and after the run beside the core count: other work on the
    cores skews every rate (the run itself adds about 1)."""
    if before is None or after is None:
        return ""
    busy = " (busy: timings are noisy)" if before > 0.5 * _cores() or after > 1 + 0.5 * _cores() else ""
    return f"load average {before:.1f} before the run and {after:.1f} after, on {_cores()} cores{busy}"


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def run(params, cfg, *, batches, widths, context, repeats, steps, out, model_name: str, source: str,
        page_size: int = 16, progress: bool = False):
    """Measure, save the table at `out` and return it."""
    before = _load()
    measured = measure(params, cfg, batches, widths, context=context, repeats=repeats, steps=steps,
                       page_size=page_size, progress=progress)
    notes = load_note(before, _load())
    table = to_table(measured, device=device_description(), date=time.strftime("%Y-%m-%d"), model=model_name,
                     source=source, context=context, notes=notes)
    table.save(out)
    return table


def print_report(table) -> None:
    from jaxspec.bench.common import print_table

    print(f"\ntarget verify steps/s: {table.model}, context {table.context}, {table.device}, {table.date}"
          + (f", {table.notes}" if table.notes else "") + "\n")
    base = {w: r for b, w, r in table.measurements if b == 1}
    print_table(["batch", "width", "tokens", "steps/s", "ms/step", "tokens/s", "vs B=1 same width"],
                [[b, w, b * w, r, 1000 / r, b * w * r, f"{r / base[w]:.2f}x" if w in base else "-"]
                 for b, w, r in table.measurements])
    print("\nthe table (tokens = B*w -> steps/s; largest B where token counts collide):\n")
    print_table(["tokens", "steps/s"], [[t, r] for t, r in zip(table.tokens, table.steps_per_s)])


def load(model: str, dtype_name: str, cpu_kernels: str):
    """(runtime params, config, name, tokenizer or None): "default" (embedded SmolLM2), "tiny"
    (random, no tokenizer) or a path."""
    from jaxspec.models.llama import prepare_params
    from jaxspec.native.build import use_native_kernels

    dtype = jnp.float32 if dtype_name == "float32" else jnp.bfloat16
    if model == "tiny":
        from jaxspec.bench.gpu import TINY, random_model

        cfg, params = random_model(TINY, dtype)
        name, tokenizer = "tiny (random)", None
    else:
        from jaxspec.models.loading import load_model

        m = load_model(model, dtype=dtype, progress=False)
        cfg, params, name, tokenizer = m.config, m.params, m.path.name if m.path is not None else model, m.tokenizer
    native = use_native_kernels(cpu_kernels, dtype, None)
    return prepare_params(params, cfg, native=native), cfg, name, tokenizer


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench sps", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help='"default" (embedded SmolLM2), "tiny" (random) or a path')
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batches", type=_ints, default=(1, 2, 4, 8), help="comma list (default 1,2,4,8)")
    p.add_argument("--widths", type=_ints, default=(1, 2, 4, 8), help="tokens per row, comma list (default 1,2,4,8)")
    p.add_argument("--context", type=int, default=256, help="tokens already in each row's KV cache (default 256)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats, median taken (default 3)")
    p.add_argument("--steps", type=int, default=5, help="forwards per timed repeat (default 5)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--cpu-kernels", default="auto", choices=("auto", "native", "xla"))
    p.add_argument("--out", help="JSON path (default configs/sps/<device>.json, cpu-<cores>core on CPU)")
    p.add_argument("--sampled", action="store_true",
                   help="instead of the table: time each verify step with its accept decision, greedy against "
                        "sampled rows (T 0.8; top-k 50; top-p 0.9) side by side; writes nothing")
    return p


def main(argv=None) -> int:
    from jaxspec.models.config import ConfigError, LoadError

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    for flag in ("context", "repeats", "steps", "page_size"):
        if getattr(args, flag) < 1:
            print(f"error: --{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}", file=sys.stderr)
            return 2
    try:
        params, cfg, name, tokenizer = load(args.model, args.dtype, args.cpu_kernels)
    except (ValueError, ConfigError, LoadError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.context + max(args.widths) > cfg.max_position_embeddings:
        print(f"error: --context {args.context} + width {max(args.widths)} exceeds the model's "
              f"{cfg.max_position_embeddings} positions", file=sys.stderr)
        return 2
    if args.sampled:
        text = None if tokenizer is None else chat_rows(tokenizer, max(args.batches), args.context + max(args.widths))
        before = _load()
        measured = measure(params, cfg, args.batches, args.widths, context=args.context, repeats=args.repeats,
                           steps=args.steps, page_size=args.page_size, progress=True, accepts=SAMPLED, text=text)
        print(f"\n{name}, context {args.context} ({'held-out ShareGPT chat' if text is not None else 'random tokens'}), "
              f"{device_description()}, {time.strftime('%Y-%m-%d')}"
              + (f", {load_note(before, _load())}" if before is not None else ""))
        print_sampled(measured)
        return 0
    out = Path(args.out) if args.out else Path("configs/sps") / f"{device_name()}.json"
    source = "python -m jaxspec.bench sps " + " ".join(argv)
    table = run(params, cfg, batches=args.batches, widths=args.widths, context=args.context, repeats=args.repeats,
                steps=args.steps, out=out, model_name=name, source=source.strip(), page_size=args.page_size,
                progress=True)
    print_report(table)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
