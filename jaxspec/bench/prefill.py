"""`python -m jaxspec.bench prefill`: the server's prefill calls, timed by shape and attention path.

A prefill call's cost is what a cache-hit turn waits for. This times `ModelRunner.prefill_scored`
on the server's configuration as `bench serve --workload multiturn` starts it (speculation off, 8
rows, a 2048-token context; `--set` overrides) for calls of rows x chunk tokens whose chunks start
after `start` cached tokens, and compares, in one run and per shape, the attention paths a chunk
can take on CPU:

- `native`: the FFI kernel for blocks of up to `native.paged_attention.MAX_QUERIES` queries;
- `blocked`: the jnp `cache.attention.paged_attention_blocked` for chunks of more than 32 queries
  (what ran before 2026-12-06), by lowering the kernel's bound to 32 for that runner;
- `packed`: the native kernel, each row's chunk cut into rows of `serve.prefill_piece` tokens over
  the same page table (the server's packed prefill, `serve/prefill_plan.py`): what packing costs
  per real token when nothing needs padding.

Each path gets its own runner (so its own compiled programs); the paths take turns per repetition,
and the table reports medians with the ratio to the first path.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time

import numpy as np

PATHS = ("native", "blocked", "packed")
DEFAULT_SHAPES = "1x32@400,1x64@400,4x64@400,8x32@400,1x128@400,1x256@400,2x256@1200"


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'ROWSxCHUNK@START,...' -> [(rows, chunk, start)]."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        try:
            dims, start = item.split("@")
            rows, chunk = dims.split("x")
            shape = (int(rows), int(chunk), int(start))
        except ValueError:
            raise SystemExit(f"--shapes: expected ROWSxCHUNK@START items such as 2x64@400, got {item!r}") from None
        if shape[0] < 1 or shape[1] < 1 or shape[2] < 0:
            raise SystemExit(f"--shapes: rows and chunk must be >= 1 and start >= 0, got {item!r}")
        out.append(shape)
    if not out:
        raise SystemExit("--shapes: no shapes given")
    return out


@contextlib.contextmanager
def attention_path(path: str):
    """The bound of the native kernel while a runner traces its programs (`blocked`: 32, the old one)."""
    from jaxspec.models import llama

    saved = llama.MAX_QUERIES
    llama.MAX_QUERIES = saved if path == "native" else 32
    try:
        yield
    finally:
        llama.MAX_QUERIES = saved


class Calls:
    """One runner and its prefill chunks per shape (pages allocated once, reused every repetition)."""

    def __init__(self, runner, shapes, seed: int = 0):
        from jaxspec.engine.types import RowInput

        self.runner, self.chunks = runner, {}
        rng = np.random.default_rng(seed)
        sid = 0
        for rows, chunk, start in shapes:
            calls = []
            for i in range(rows):
                sid += 1
                tokens = [int(x) for x in rng.integers(100, 20000, start + chunk)]
                runner.allocator.allocate(sid, start + chunk + 1)
                table = np.asarray(runner.allocator.page_table_row(sid, runner.max_pages))
                row = RowInput(tokens, len(tokens), table, slot=i, cached=start)
                g = runner.prefill_piece or chunk  # packed: the chunk in rows of one piece each
                calls += [(row, start + off, min(g, chunk - off)) for off in range(0, chunk, g)]
            self.chunks[(rows, chunk, start)] = calls

    def time(self, shape) -> float:
        t0 = time.perf_counter()
        self.runner.prefill_scored(self.chunks[shape])
        return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench prefill")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of ROWSxCHUNK@START (cached tokens before)")
    p.add_argument("--paths", default="native,packed", help=f"comma list of: {', '.join(PATHS)}")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per shape and path (after one warm-up)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, as the server's --set (repeatable)")
    p.set_defaults(config=None)  # no --config: config_from_args reads one when given
    args = p.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    bad = [x for x in paths if x not in PATHS]
    if bad or not paths:
        raise SystemExit(f"--paths: unknown {', '.join(bad) or '(none)'}; paths: {', '.join(PATHS)}")
    if args.reps < 1:
        raise SystemExit("--reps must be >= 1")

    from jaxspec.config import ConfigValueError, apply_overrides, load_config
    from jaxspec.engine.assemble import assemble
    from jaxspec.generate import config_from_args
    from jaxspec.models.loading import load_model
    from jaxspec.serve.launch import SERVE_DEFAULTS

    base = apply_overrides(load_config(None), {**SERVE_DEFAULTS, "spec.algorithm": "none",
                                               "engine.max_batch_size": 8, "engine.max_context": 2048})
    try:  # the CLI's and the server's --set reading, on the server's defaults
        cfg = config_from_args(args, base=base)
    except ConfigValueError as e:
        raise SystemExit(f"--set: {e}") from None
    model = load_model(cfg.model.path, progress=False)
    runs = {}
    piece = cfg.serve.prefill_piece
    for path in paths:
        with attention_path(path):
            serve = dataclasses.replace(cfg.serve, prefill_piece=piece if path == "packed" else 0)
            runner = assemble(dataclasses.replace(cfg, serve=serve), model, serving=True, progress=False)
            if path == "packed" and not runner.prefill_piece:
                raise SystemExit("--paths packed: serve.prefill_piece is 0")
            if path == "packed" and any(r * c > runner.prefill_batches[-1] * piece for r, c, _ in shapes):
                raise SystemExit(f"--paths packed: every shape's rows x chunk must be <= "
                                 f"{runner.prefill_batches[-1] * piece} (serve.prefill_tokens)")
            if not runner.native_kernels and path == "native":
                raise SystemExit("--paths native: this runner does not use the native CPU kernels "
                                 "(engine.cpu_kernels, dtype or device); time `blocked` alone")
            too_long = [s for s in shapes if s[1] > runner.prefill_chunk or s[2] + s[1] > runner.max_context]
            if too_long:
                raise SystemExit(f"--shapes {too_long}: chunks must be <= serve.prefill_chunk "
                                 f"({runner.prefill_chunk}) and end within engine.max_context ({runner.max_context})")
            runs[path] = Calls(runner, shapes)
            for shape in shapes:  # compile (traced under this path's bound) and warm up
                runs[path].time(shape)
    times = {(path, s): [] for path in paths for s in shapes}
    for _ in range(args.reps):
        for shape in shapes:
            for path in paths:
                times[(path, shape)].append(runs[path].time(shape))
    base = paths[0]
    print(f"jaxspec prefill calls: {cfg.model.path} model, serve configuration, speculation off; "
          f"medians of {args.reps}, paths taking turns")
    head = ["rows x chunk", "cached before", *(f"{p} ms" for p in paths), *(f"{p} / {base}" for p in paths[1:]),
            f"ms per token ({base})"]
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for shape in shapes:
        med = {path: statistics.median(times[(path, shape)]) * 1e3 for path in paths}
        rows, chunk, start = shape
        cells = [f"{rows} x {chunk}", str(start), *(f"{med[p]:.0f}" for p in paths),
                 *(f"{med[p] / med[base]:.2f}" for p in paths[1:]), f"{med[base] / (rows * chunk):.2f}"]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
