"""What `bench ablate` writes from its rows: rows.csv, summary.md and the plots.

Every statistic is pooled from the rows' accept lengths through
`jaxspec.speculative.metrics` (tau = mean committed tokens per verify step,
bonus included; per-position acceptance conditional on the previous position),
so a point's summary is step-weighted, not a mean of per-prompt ratios.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import platform
from pathlib import Path

import numpy as np

from jaxspec.bench.common import median

CSV_FIELDS = ("point_id", "kind", "method", "prompt_set", "batch_size", "temperature", "top_p", "top_k", "seed",
              "prompt_index", "source_prompt", "new_tokens", "verify_steps", "tau", "acceptance_rate", "accept_hist",
              "tok_s", "baseline_tok_s", "speedup", "decode_s", "draft_frac", "verify_frac", "other_frac",
              "algorithm", "draft_model", "num_steps", "topk", "num_draft_tokens", "verify", "simulate_accept_length")


# ---- pooling --------------------------------------------------------------------------------------


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per point, in first-row order: pooled metrics over its rows."""
    from jaxspec.bench.spec import speedups
    from jaxspec.speculative.metrics import merge_metrics, request_metrics

    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["point_id"], []).append(r)
    out = []
    for pid, rs in by.items():
        cfg = rs[0]["config"]
        spec = cfg["spec"]
        depth = max((len(r.get("cond_acceptance") or []) for r in rs), default=0)
        s = {"point_id": pid, "kind": rs[0]["kind"], "method": rs[0]["method"], "prompt_set": rs[0]["prompt_set"],
             "batch_size": rs[0]["batch_size"], "temperature": rs[0]["temperature"], "seed": rs[0]["seed"],
             "rows": len(rs), "algorithm": spec["algorithm"] if rs[0]["kind"] != "baseline" else "none",
             "num_draft_tokens": spec["num_draft_tokens"], "topk": spec["topk"], "num_steps": spec["num_steps"],
             "simulate_accept_length": spec["simulate_accept_length"], "labels": cfg["labels"],
             "tok_s": median([r["tok_s"] for r in rs])}
        if rs[0]["accept_lengths"] is not None:
            m = merge_metrics(request_metrics(r["accept_lengths"], spec["num_draft_tokens"] - 1) for r in rs)
            s.update(tau=m.tau, verify_steps=m.num_verify_steps, accept_length_counts=list(m.accept_length_counts),
                     cond_acceptance=list(m.conditional_position_acceptance(depth)),
                     position_acceptance=list(m.position_acceptance(depth)))
        else:
            s.update(tau=1.0, verify_steps=sum(r["verify_steps"] for r in rs), accept_length_counts=[],
                     cond_acceptance=[], position_acceptance=[])
        paired = [(r["tok_s"], r["baseline_tok_s"]) for r in rs if r.get("baseline_tok_s")]
        s["speedup_median"], s["speedup_aggregate"] = (speedups(*zip(*paired)) if paired else (math.nan, math.nan))
        splits = [r["time_split"] for r in rs if r.get("time_split")]
        s["time_split"] = ({k: float(np.mean([x[k] for x in splits])) for k in splits[0]} if splits else None)
        out.append(s)
    return out


# ---- files ----------------------------------------------------------------------------------------


def _csv_row(r: dict) -> dict:
    spec = r["config"]["spec"]
    split = r.get("time_split") or {}
    flat = {k: r.get(k) for k in CSV_FIELDS}
    flat.update({k: spec[k] for k in ("algorithm", "draft_model", "num_steps", "topk", "num_draft_tokens", "verify",
                                      "simulate_accept_length")})
    flat["accept_hist"] = "/".join(map(str, r.get("accept_length_counts") or []))
    flat.update(draft_frac=split.get("draft"), verify_frac=split.get("verify"), other_frac=split.get("other"))
    for i, x in enumerate(r.get("cond_acceptance") or [], 1):
        flat[f"accept_pos_{i}"] = x
    return flat


def write_csv(rows: list[dict], path: Path) -> Path:
    """rows.csv: CSV_FIELDS, then accept_pos_1..D (P(position i accepted | i-1 accepted))."""
    depth = max((len(r.get("cond_acceptance") or []) for r in rows), default=0)
    fields = list(CSV_FIELDS) + [f"accept_pos_{i}" for i in range(1, depth + 1)]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow(_csv_row(r))
    return path


def _fmt(x, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def machine_line() -> str:
    import os

    import jax

    return (f"{datetime.date.today().isoformat()}, {platform.machine()} {os.cpu_count()} cores, "
            f"JAX backend {jax.default_backend()}")


def summary_markdown(grid, summary: list[dict], invalid: list[dict], excluded: int) -> str:
    depth = max((len(s["cond_acceptance"]) for s in summary), default=0)
    shown = min(depth, 8)
    lines = [f"# Ablation `{grid.name}`", "", grid.description or "", "",
             f"Run {machine_line()}. Model `{grid.model}` ({grid.dtype}), {grid.num_prompts} prompts per set, "
             f"{grid.max_new_tokens} new tokens each, EOS ignored. tau: mean tokens committed per verify step, "
             "bonus included. pos i: P(draft position i accepted | position i-1 accepted), pooled over the point's "
             "verify steps. tok/s: decode rate of the batch (median over batches); vs plain: median of per-prompt "
             "ratios to plain decoding of the same prompt in the same run, and the aggregate (total time ratio). "
             "Ceiling rows force acceptance (output NOT exact).", "",
             "| method | prompts | batch | T | tau | " + " | ".join(f"pos {i}" for i in range(1, shown + 1))
             + " | tok/s | vs plain (median) | vs plain (aggregate) | draft / verify time | rows |",
             "|" + "---|" * (10 + shown)]
    for s in summary:
        pos = (s["cond_acceptance"] + [math.nan] * shown)[:shown]
        split = s["time_split"]
        sp = f"{split['draft']:.0%} / {split['verify']:.0%}" if split else "n/a"
        lines.append(f"| {s['method']} | {s['prompt_set']} | {s['batch_size']} | {s['temperature']} | "
                     f"{_fmt(s['tau'])} | " + " | ".join(_fmt(x) for x in pos) + f" | {_fmt(s['tok_s'], 1)} | "
                     f"{_fmt(s['speedup_median'])} | {_fmt(s['speedup_aggregate'])} | {sp} | {s['rows']} |")
    lines += ["", f"{excluded} points excluded by the grid's rules."]
    if invalid:
        lines += ["", "## Invalid points (skipped)", "", "| method | prompts | batch | T | reason |", "|---|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['prompt_set']} | {r['batch_size']} | {r['temperature']} | "
                  f"{r['reason'].replace('|', '/')} |" for r in invalid]
    return "\n".join(lines) + "\n"


def write_report(grid, res: dict, out: Path, *, plots: bool = True) -> list[Path]:
    """rows.csv, summary.json, summary.md and (plots=True) plots/ from a run_grid result; the paths written."""
    out = Path(out)
    summary = summarize(res["rows"])
    files = [write_csv(res["rows"], out / "rows.csv")]
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    md = out / "summary.md"
    md.write_text(summary_markdown(grid, summary, res["invalid"], res["excluded"]))
    files += [out / "summary.json", md]
    if plots:
        from jaxspec.bench.ablate_plots import plot_all

        files += plot_all(summary, out / "plots", title=grid.name)
    return files
