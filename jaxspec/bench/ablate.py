"""`python -m jaxspec.bench ablate --grid configs/ablations/NAME.toml`: research ablations.

Runs every point of a grid (`jaxspec.bench.ablate_grid`) on its prompts and
writes, under --out (default runs/ablate/NAME):

    rows.jsonl   one line per (point, prompt): the point's full config, the accept
                 lengths, tau, per-position acceptance, tok/s, plain tok/s, seed
    rows.csv     the same rows, flat
    invalid.jsonl  the points that cannot run, each with the reason
    summary.md   one table row per point, plus the invalid points
    plots/*.png, *.svg

Resumable: rows.jsonl is appended a batch at a time, and a rerun skips the
(point, prompt) rows already there (a point's id hashes its whole config, so
a changed grid reruns what changed). Deterministic: greedy rows give the same
tokens every run, sampled rows are seeded (seed + prompt index).

Each point is plain decoding of the same prompts beside it: the baselines
(plain decoding per prompt set, batch size and sampling) run first, in the
same run, and every row's speedup is its tok/s over the baseline row of the
same prompt. tok/s is the decode rate of the batch the prompt ran in (all
rows' new tokens over the decode time, prefill excluded), so at batch 1 it
is per prompt.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Callable

from jaxspec.bench.ablate_grid import Grid, GridError, Point, baseline_of, load_grid, plan
from jaxspec.bench.common import time_split

ROWS, INVALID = "rows.jsonl", "invalid.jsonl"
# What a point that cannot run raises: the validator's, the head loader's, the engine's messages.
POINT_ERRORS = (ValueError, FileNotFoundError)


# ---- prompts --------------------------------------------------------------------------------------


def load_prompts(name: str, tokenizer, n: int, grid_dir: Path | None = None) -> list[list[int]]:
    """Token ids of the first n prompts of a set: a `bench spec` set name, or "jsonl:PATH" (the CLI's
    input lines: messages, prompt or prompt_ids; a relative PATH is tried beside the grid file too)."""
    if name.startswith("jsonl:"):
        from jaxspec.prompts import encode_entry, read_jsonl

        path = Path(name[len("jsonl:"):]).expanduser()
        if not path.is_absolute() and not path.exists() and grid_dir is not None:
            path = grid_dir / path
        entries = read_jsonl(path)[:n]
        return [encode_entry(e, tokenizer, e.get("_where", f"{path}:{i + 1}")) for i, e in enumerate(entries)]
    from jaxspec.bench.spec import SETS, prompt_sets

    if name not in SETS:
        raise GridError(f"prompt_set {name!r}: not a set ({', '.join(SETS)}) or jsonl:PATH")
    if tokenizer is None:
        raise GridError(f"prompt_set {name!r} needs the model's tokenizer; this model has none (use jsonl:PATH "
                        "with prompt_ids)")
    return next(iter(prompt_sets(tokenizer, [name], n).values()))[:n]


def slots(num_prompts: int, batch: int) -> list[int]:
    """Source prompt of each row slot: the prompts cycled up to a whole number of batches, so a
    batch-B point always runs B real rows (B > number of prompts repeats prompts)."""
    total = -(-max(num_prompts, batch) // batch) * batch
    return [i % num_prompts for i in range(total)]


# ---- rows on disk ---------------------------------------------------------------------------------


def read_rows(path: Path) -> list[dict]:
    """The rows already written. A last line cut off by an interruption is dropped from the file, so
    the next append starts on a fresh line."""
    if not path.exists():
        return []
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1
    if cut != len(data):
        with open(path, "r+b") as f:
            f.truncate(cut)
    return [json.loads(line) for line in data[:cut].decode().splitlines() if line.strip()]


def append_rows(path: Path, rows: list[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, default=_json_default) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def _json_default(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"not JSON: {type(x).__name__}")


def _nan_none(xs) -> list:
    return [None if isinstance(x, float) and math.isnan(x) else x for x in xs]


# ---- one point ------------------------------------------------------------------------------------


def check_point(point: Point) -> str | None:
    """Why the point cannot run (the spec validator's message), or None. Drafts load later."""
    from jaxspec.config import SpecSection
    from jaxspec.speculative.algorithm import check_request_sampling
    from jaxspec.speculative.drafters import algorithm_info, validate_spec_config

    if point.kind == "baseline":
        return None
    try:
        spec = validate_spec_config(SpecSection(**point.spec))
        if not algorithm_info(spec.algorithm).speculative:
            return "spec.algorithm is 'none': a grid point needs a drafter (plain decoding is the baseline)"
        check_request_sampling(spec.verify, float(point.run["temperature"]))
    except (POINT_ERRORS + (TypeError,)) as e:
        return str(e)
    return None


class Engines:
    """Builds the engine of each point, reusing the last one for points that differ only in sampling,
    and each draft model / head once."""

    def __init__(self, model, max_context: int):
        self.model, self.max_context = model, max_context
        self.drafts: dict = {}
        self.key, self.engine = None, None

    def get(self, point: Point):
        import jax.numpy as jnp

        from jaxspec.bench.spec import engine_for
        from jaxspec.config import EngineSection, SpecSection
        from jaxspec.engine import Engine
        from jaxspec.speculative.drafters.load import load_draft

        spec = dict(point.spec) if point.kind != "baseline" else None
        key = (json.dumps(spec, sort_keys=True, default=str), point.run["batch_size"])
        if key == self.key:
            return self.engine
        self.engine = self.key = None  # free the previous engine's caches first
        draft = None
        if spec:
            dkey = tuple(spec.get(k, "") for k in ("algorithm", "draft_model", "draft_layers", "eagle3_layer_ids"))
            if dkey not in self.drafts:
                self.drafts[dkey] = load_draft(SpecSection(**spec), self.model, jnp.float32, progress=False)
            draft = self.drafts[dkey]
        b = int(point.run["batch_size"])
        if self.max_context:  # a small target: one context bucket that fits it
            ecfg = EngineSection(max_batch_size=b, max_context=self.max_context, length_buckets=(self.max_context,),
                                 batch_buckets=(b,))
            self.engine = Engine(self.model.params, self.model.config, ecfg, progress=False,
                                 spec=SpecSection(**spec) if spec else None, draft=draft, benchmark=True)
        else:
            self.engine = engine_for(self.model, spec, draft, batch=b)
        self.key = key
        return self.engine


def requests_for(point: Point, prompts: list[list[int]], idx: list[int], max_new: int) -> list:
    from jaxspec.engine import Request
    from jaxspec.sampling_params import SamplingParams

    t = float(point.run["temperature"])
    sp = SamplingParams(max_tokens=max_new, temperature=t, top_p=float(point.run["top_p"]),
                        top_k=int(point.run["top_k"]))
    return [Request(prompts[src], sp, seed=int(point.run["seed"]) + slot) for slot, src in idx]


def run_group(engine, point: Point, grid: Grid, prompts, group: list[tuple[int, int]], pid: str,
              base_rates: dict, split: dict | None) -> list[dict]:
    """Rows of one batch of (slot, source prompt) pairs; `split`: the point's time split."""
    from jaxspec.speculative.metrics import request_metrics

    reqs = requests_for(point, prompts, group, grid.max_new_tokens)
    results = engine.generate(reqs)
    t = engine.last_timing
    tok_s = t["new_tokens"] / t["decode_s"] if t["decode_s"] > 0 else float("nan")
    plan = engine.spec_plan
    rows = []
    for (slot, src), res in zip(group, results):
        row = {"point_id": pid, "kind": point.kind, "method": point.method, **point.run,
               "seed": int(point.run["seed"]) + slot, "prompt_index": slot, "source_prompt": src, "new_tokens": len(res.output_ids),
               "tok_s": tok_s, "decode_s": t["decode_s"], "batch_new_tokens": t["new_tokens"], "time_split": split}
        if res.accept_lengths is not None:
            m = request_metrics(res.accept_lengths, plan.num_draft_tokens - 1)
            row.update(accept_lengths=res.accept_lengths, verify_steps=m.num_verify_steps, tau=m.tau,
                       acceptance_rate=m.acceptance_rate, accept_length_counts=list(m.accept_length_counts),
                       cond_acceptance=_nan_none(m.conditional_position_acceptance(plan.max_depth)),
                       position_acceptance=_nan_none(m.position_acceptance(plan.max_depth)))
        else:
            row.update(accept_lengths=None, verify_steps=len(res.output_ids), tau=1.0)
        base = base_rates.get(slot)
        row["baseline_tok_s"] = base
        row["speedup"] = tok_s / base if base else None
        row["config"] = point.config(grid)
        rows.append(row)
    return rows


# ---- the grid -------------------------------------------------------------------------------------


def run_grid(grid: Grid, out: Path, *, model=None, progress: bool = True, max_context: int = 0,
             on_rows: Callable[[list[dict]], None] | None = None) -> dict:
    """Run (or finish) the grid into `out`; returns {"rows", "invalid", "excluded", "points"}.

    `model`: a LoadedModel to use instead of loading grid.model. `max_context`: > 0 gives every
    engine that one context bucket (small targets); 0 uses `bench spec`'s engines. `on_rows`: called
    after each batch's rows are written (the tests interrupt a run there)."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    points, excluded = plan(grid)
    invalid = [{"point_id": p.point_id(grid), "method": p.method, **p.run, "reason": r, "config": p.config(grid)}
               for p in points if (r := check_point(p))]
    bad = {r["point_id"] for r in invalid}
    if model is None:
        import jax.numpy as jnp

        from jaxspec.models.loading import load_model

        model = load_model(grid.model, dtype=jnp.float32 if grid.dtype == "float32" else jnp.bfloat16,
                           progress=progress)
    grid_dir = Path(grid.path).parent
    prompt_cache: dict[str, list] = {}

    def prompts_of(name: str):
        if name not in prompt_cache:
            prompt_cache[name] = load_prompts(name, model.tokenizer, grid.num_prompts, grid_dir)
            if not prompt_cache[name]:
                raise GridError(f"{grid.path}: prompt_set {name!r} has no prompts")
        return prompt_cache[name]

    rows = read_rows(out / ROWS)
    done = {(r["point_id"], r["prompt_index"]) for r in rows}
    todo = [p for p in points if p.point_id(grid) not in bad]
    total = sum(len(slots(len(prompts_of(p.run["prompt_set"])), int(p.run["batch_size"]))) for p in todo)
    rates = {(r["point_id"], r["prompt_index"]): r["tok_s"] for r in rows if r["kind"] == "baseline"}
    engines = Engines(model, max_context)
    bar = tqdm(total=total, initial=sum(1 for p in todo for k in done if k[0] == p.point_id(grid)),
               desc=f"ablate {grid.name}", unit="row", disable=not progress, file=sys.stderr)
    for point in todo:
        pid = point.point_id(grid)
        prompts = prompts_of(point.run["prompt_set"])
        b = int(point.run["batch_size"])
        pairs = list(enumerate(slots(len(prompts), b)))
        groups = [pairs[i:i + b] for i in range(0, len(pairs), b)]
        groups = [g for g in groups if any((pid, slot) not in done for slot, _ in g)]
        if not groups:
            continue
        bar.set_postfix_str(point.method[:40])
        try:
            engine = engines.get(point)
            first = requests_for(point, prompts, groups[0], grid.max_new_tokens)
            engine.generate(first)  # compiles; untimed
            split = time_split(engine, first) if point.run["time_split"] else None
        except POINT_ERRORS as e:  # a head that is missing or does not fit, a request the engine refuses
            invalid.append({"point_id": pid, "method": point.method, **point.run, "reason": str(e),
                            "config": point.config(grid)})
            bar.update(len(pairs))
            continue
        bid = baseline_of(point, grid).point_id(grid)
        base = {slot: rates.get((bid, slot)) for slot, _ in pairs}
        for g in groups:
            new = [r for r in run_group(engine, point, grid, prompts, g, pid, base, split) if (pid, r["prompt_index"]) not in done]
            append_rows(out / ROWS, new)
            rows += new
            if point.kind == "baseline":
                rates.update({(pid, r["prompt_index"]): r["tok_s"] for r in new})
            bar.update(len(new))
            if on_rows:
                on_rows(new)
    bar.close()
    (out / INVALID).write_text("".join(json.dumps(r) + "\n" for r in invalid))
    return {"rows": rows, "invalid": invalid, "excluded": excluded, "points": points}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench ablate",
                                description="Run an ablation grid: CSV/JSONL rows, a markdown summary, plots.")
    p.add_argument("--grid", required=True, help="a grid TOML file (configs/ablations/NAME.toml)")
    p.add_argument("--out", default=None, help="output folder (default runs/ablate/<grid name>); rerun to resume")
    p.add_argument("--max-prompts", type=int, default=None, help="at most N prompts per set (a quick look)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per prompt (overrides the grid)")
    p.add_argument("--model", default=None, help="the target, overriding the grid's model")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    from jaxspec.bench.ablate_report import write_report

    try:
        grid = load_grid(args.grid).shrink(args.max_prompts, args.max_new_tokens)
        if args.model:
            import dataclasses

            grid = dataclasses.replace(grid, model=args.model)
        out = Path(args.out or f"runs/ablate/{grid.name}")
        res = run_grid(grid, out, progress=not args.quiet)
    except GridError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    files = write_report(grid, res, out, plots=not args.no_plots)
    for r in res["invalid"]:
        print(f"invalid point, skipped: {r['method']} ({r['prompt_set']}, batch {r['batch_size']}): {r['reason']}",
              file=sys.stderr)
    print(f"{len(res['rows'])} rows, {len(res['invalid'])} invalid points, {res['excluded']} excluded; wrote "
          + ", ".join(str(f) for f in files))
    return 0
