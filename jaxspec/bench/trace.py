"""`python -m jaxspec.bench trace DIR`: where a traced server's time went (`serve.trace`).

    python -m jaxspec.bench serve --workload multiturn --set serve.trace=/tmp/trace ...
    python -m jaxspec.bench trace /tmp/trace

One block per server (trace-<pid>.jsonl, `jaxspec/serve/trace.py`):

- the busy time (while any request is in the server) split into prefill calls, decode calls, held steps (the
  follow-up grace) and the rest: the host's work between calls, and idling with nothing to do;
- decode calls by iterations run (short calls: a prefill waited), with their mean time per iteration;
- each request's time to first token on the server (arrival after parsing, to the first token
  sampled; the HTTP side is not in it) split by what ran meanwhile: its own prefill calls, other
  requests' prefill calls, decode calls, held steps, the rest. Medians, and the share of the mean.
"""

from __future__ import annotations

import argparse
import bisect
import json
from pathlib import Path

import numpy as np

PARTS = ("own prefill", "other prefill", "decode", "held", "rest")


def read(path: Path) -> tuple[dict, list[dict], list[dict]]:
    """(start settings, calls in time order, finished requests) of one trace file."""
    settings, calls, requests = {}, [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        ev = rec.pop("ev")
        if ev == "start":
            settings = rec
        elif ev == "request":
            requests.append(rec)
        else:
            calls.append({"ev": ev, **rec})
    calls.sort(key=lambda c: c["t0"])
    return settings, calls, requests


def ttft_parts(req: dict, calls: list[dict], starts: list[float]) -> dict[str, float]:
    """Seconds of each part of `PARTS` between a request's arrival and its first token."""
    a, f = req["arrival"], req["first_token"]
    parts = dict.fromkeys(PARTS, 0.0)
    # Calls run one at a time on the scheduler thread: the first that can overlap starts before `a`.
    for c in calls[max(0, bisect.bisect_left(starts, a) - 1):]:
        if c["t0"] >= f:
            break
        overlap = min(c["t1"], f) - max(c["t0"], a)
        if overlap <= 0:
            continue
        if c["ev"] == "prefill":
            parts["own prefill" if req["id"] in c["seqs"] else "other prefill"] += overlap
        else:
            parts["decode" if c["ev"] == "decode" else "held"] += overlap
    parts["rest"] = (f - a) - sum(parts.values())
    return parts


def busy_periods(requests: list[dict]) -> list[tuple[float, float]]:
    """The union of the requests' [arrival, end] intervals, as disjoint (start, end) pairs in order."""
    out: list[list[float]] = []
    for r in sorted(requests, key=lambda r: r["arrival"]):
        if out and r["arrival"] <= out[-1][1]:
            out[-1][1] = max(out[-1][1], r["end"])
        else:
            out.append([r["arrival"], r["end"]])
    return [(a, b) for a, b in out]


def summarize(path: Path) -> str:
    settings, calls, requests = read(path)
    lines = [f"## {path.name}: " + ", ".join(f"{k}={v}" for k, v in settings.items())]
    served = [r for r in requests if r["first_token"] is not None and r["reason"] != "abort"]
    if not served or not calls:
        return "\n".join(lines + ["(no finished requests)"])
    # 1. The busy time (some request in the server; a benchmark's rounds on other servers are not), by what ran.
    periods = busy_periods(requests)
    busy = sum(t1 - t0 for t0, t1 in periods)
    inside = [c for c in calls if any(t0 <= c["t0"] and c["t1"] <= t1 for t0, t1 in periods)]
    by_kind = {k: sum(c["t1"] - c["t0"] for c in inside if c["ev"] == k) for k in ("prefill", "decode", "wait")}
    rest = busy - sum(by_kind.values())
    lines.append(f"busy {busy:.1f} s: prefill {by_kind['prefill']:.1f} s ({100 * by_kind['prefill'] / busy:.0f}%), "
                 f"decode {by_kind['decode']:.1f} s ({100 * by_kind['decode'] / busy:.0f}%), "
                 f"held {by_kind['wait']:.2f} s, rest (host, idle) {rest:.1f} s ({100 * rest / busy:.0f}%)")
    # 2. Decode calls by iterations run.
    decodes = [c for c in inside if c["ev"] == "decode"]
    for iters in sorted({c["iters"] for c in decodes}):
        group = [c for c in decodes if c["iters"] == iters]
        ms = 1e3 * float(np.mean([(c["t1"] - c["t0"]) / max(iters, 1) for c in group]))
        lines.append(f"decode calls of {iters} iteration(s): {len(group)}, {ms:.1f} ms an iteration, "
                     f"batch {np.mean([len(c['seqs']) for c in group]):.1f} rows, "
                     f"{np.mean([sum(c['tokens']) for c in group]):.1f} tokens a call")
    prefills = [c for c in inside if c["ev"] == "prefill"]
    if prefills:
        lines.append(f"prefill calls: {len(prefills)}, {1e3 * np.median([c['t1'] - c['t0'] for c in prefills]):.0f} ms "
                     f"median, {np.mean([c['tokens'] for c in prefills]):.0f} tokens and "
                     f"{np.mean([len(c['seqs']) for c in prefills]):.1f} requests on average")
    # 3. Time to first token, by what ran meanwhile.
    starts = [c["t0"] for c in calls]
    parts = [ttft_parts(r, calls, starts) for r in served]
    ttft = np.array([r["first_token"] - r["arrival"] for r in served])
    queue = np.array([r["admitted"] - r["arrival"] for r in served])
    lines.append(f"server TTFT over {len(served)} requests: p50 {np.median(ttft):.3f} s, p90 "
                 f"{np.percentile(ttft, 90):.3f} s, mean {ttft.mean():.3f} s (of it before admission: "
                 f"{queue.mean():.3f} s); cached {sum(r['cached'] or 0 for r in served) / sum(r['prompt'] for r in served):.1%}")
    # Means, not medians: they add up to the mean above (most requests wait for no decode call, so
    # a median per part read 0.000 s beside a share of 5-30%).
    means = {p: float(np.mean([x[p] for x in parts])) for p in PARTS}
    lines.append("  mean per request: " + " | ".join(
        f"{p} {m:.3f} s ({100 * m / ttft.mean():.0f}%)" for p, m in means.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxspec.bench trace", description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="the serve.trace directory (or one trace-<pid>.jsonl)")
    args = ap.parse_args(argv)
    path = Path(args.dir)
    files = [path] if path.is_file() else sorted(path.glob("trace-*.jsonl"))
    if not files:
        print(f"no trace-*.jsonl in {path}")
        return 1
    for f in files:
        print(summarize(f) + "\n")
    return 0
