"""`python -m jaxspec.bench serve --workload constrained`: JSON-schema requests against unconstrained
requests of the same length, with speculation off and on, side by side (issue 27).

Two prompt sets, each with its schema:
- "chat": ShareGPT questions answered as {"topic", "answer", "confidence"} (free text inside JSON);
- "copy": a record written out in the prompt, to be returned as JSON: the values are copied from
  the prompt, which is where the n-gram drafter shines (the copy-heavy set).

Per server mode and concurrency C: first the constrained requests (greedy, response_format
json_schema, each ending where its grammar and the model end it), then the same prompts
unconstrained with max_tokens set to each one's constrained length and EOS ignored, so both
runs produce the same number of tokens per request. The servers run without the prefix cache, so
both runs prefill every prompt in full. Reported: tokens/s of each, their ratio, the
speculative/plain ratio of the constrained runs, tau of each run, and the host's mask time per
callback and per token (the server's jaxspec_grammar_mask_* counters).
"""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np

from jaxspec.bench.common import print_table

CHAT_SCHEMA = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 40},
    "answer": {"type": "string", "maxLength": 300},
    "confidence": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["topic", "answer", "confidence"], "additionalProperties": False}
COPY_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "email": {"type": "string"}, "city": {"type": "string"},
    "company": {"type": "string"}, "phone": {"type": "string"}, "notes": {"type": "string", "maxLength": 200}},
    "required": ["name", "email", "city", "company", "phone", "notes"], "additionalProperties": False}

_FIRST = ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Julia"]
_LAST = ["Martin", "Okafor", "Nakamura", "Silva", "Kowalski", "Haddad", "Larsen", "Moreau", "Rossi", "Walsh"]
_CITY = ["Lisbon", "Nairobi", "Osaka", "Toronto", "Krakow", "Valparaiso", "Tromso", "Lyon", "Bologna", "Perth"]
_CO = ["Northwind Traders", "Blue Harbor Labs", "Acme Robotics", "Green Valley Farms", "Orbit Analytics"]


def copy_prompts(n: int, seed: int = 0) -> list[str]:
    """Records to re-emit as JSON (deterministic)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        first, last = rng.choice(_FIRST), rng.choice(_LAST)
        rec = {"name": f"{first} {last}", "email": f"{first.lower()}.{last.lower()}@example.com",
               "city": rng.choice(_CITY), "company": rng.choice(_CO),
               "phone": f"+1-555-{rng.randrange(1000, 9999)}",
               "notes": f"Met {first} at the {rng.choice(_CITY)} conference; follow up about the "
                        f"{rng.choice(['pilot', 'contract', 'renewal', 'demo'])} next week."}
        lines = "\n".join(f"{k.capitalize()}: {v}" for k, v in rec.items())
        out.append(f"Here is a contact record:\n{lines}\n\nReturn it as a JSON object with the keys name, email, "
                   "city, company, phone and notes, copying each value exactly.")
    return out


async def _level(url: str, model: str, prompts: list[str], concurrency: int, bodies: list[dict]) -> dict:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        async def one(p, extra):
            async with sem:
                body = {"model": model, "messages": [{"role": "user", "content": p}], "temperature": 0, **extra}
                r = await client.post(url + "/v1/chat/completions", json=body)
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                j = r.json()
                return j["usage"]["completion_tokens"], j["choices"][0]["finish_reason"], time.perf_counter()

        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(p, b) for p, b in zip(prompts, bodies)))
    wall = max(r[2] for r in res) - t0
    return {"tokens": [r[0] for r in res], "finish": [r[1] for r in res], "tok_s": sum(r[0] for r in res) / wall}


def _counters(url: str) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name in ("jaxspec_grammar_mask_calls_total", "jaxspec_grammar_mask_seconds_total",
                          "jaxspec_grammar_masks_total", "jaxspec_spec_accept_length_sum",
                          "jaxspec_spec_accept_length_count", "jaxspec_generation_tokens_total"):
                out[s.name] = s.value
    return out


def _diff(before: dict, after: dict) -> dict:
    """What each counter of two `_counters` reads grew by."""
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def _tau(d: dict) -> float:
    """Tokens committed per verify step over a `_diff` (1 without speculation)."""
    count = d.get("jaxspec_spec_accept_length_count", 0.0)
    return d.get("jaxspec_spec_accept_length_sum", 0.0) / count if count else 1.0


def bench_constrained(url: str, model: str, sets: dict[str, tuple[list[str], dict]], levels: list[int],
                      max_tokens: int) -> list[dict]:
    rows = []
    for name, (prompts, schema) in sets.items():
        fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}}
        for c in levels:
            n = max(len(prompts), c)
            ps = [prompts[i % len(prompts)] for i in range(n)]
            c0 = _counters(url)
            con = asyncio.run(_level(url, model, ps, c, [{"max_tokens": max_tokens, **fmt}] * n))
            c1 = _counters(url)
            free = asyncio.run(_level(url, model, ps, c, [{"max_tokens": max(t, 1), "ignore_eos": True}
                                                          for t in con["tokens"]]))
            c2 = _counters(url)
            d = _diff(c0, c1)
            calls = d.get("jaxspec_grammar_mask_calls_total", 0.0)
            rows.append({"set": name, "concurrency": c, "constrained": con["tok_s"], "free": free["tok_s"],
                         "stop_frac": float(np.mean([f == "stop" for f in con["finish"]])),
                         "tokens": float(np.mean(con["tokens"])),
                         "tau": _tau(d), "tau_free": _tau(_diff(c1, c2)),
                         "mask_ms_per_call": 1e3 * d.get("jaxspec_grammar_mask_seconds_total", 0.0) / calls
                         if calls else float("nan"),
                         "mask_ms_per_token": 1e3 * d.get("jaxspec_grammar_mask_seconds_total", 0.0)
                         / max(d.get("jaxspec_generation_tokens_total", 0.0), 1)})
    return rows


def run(args, levels: list[int], chat_prompts: list[str]) -> int:
    """chat_prompts: the --prompts set (bench serve's `load_prompts`), the "chat" set's questions."""
    from jaxspec.bench.servers import MODES, launched
    from jaxspec.serve.launch import SERVE_DEFAULTS

    n = args.num_prompts
    sets = {"chat": (chat_prompts[:n], CHAT_SCHEMA), "copy": (copy_prompts(n), COPY_SCHEMA)}
    results = {}
    for mode in args.modes.split(","):
        # No background compiles beside the measurement: the warm pass below compiles what it uses.
        # No prefix cache: each free request follows the constrained one of the same prompt and would
        # find its prompt cached, while the constrained one, whose prompt a small pool evicted since
        # the last pass, prefills all of it (0.77-0.84x plain on 2026-12-03 was that, not the grammar).
        overrides = {**SERVE_DEFAULTS, "engine.max_batch_size": max(levels), "engine.max_context": args.max_context,
                     "serve.grammar_warmup": False, "engine.prefix_cache": False, **MODES[mode]}
        for item in args.set:
            key, _, value = item.partition("=")
            overrides[key] = value
        with launched(args.model, overrides, mode, args.config) as (url, model):
            # The same requests once, unmeasured: every bucket they touch compiled (the "+grammar"
            # builds are never stored, so a cold server compiles them on first use).
            bench_constrained(url, model, sets, levels, args.max_tokens)
            results[mode] = bench_constrained(url, model, sets, levels, args.max_tokens)
        print(f"[{mode}] done", flush=True)
    plain = {(r["set"], r["concurrency"]): r["constrained"] for r in results.get("off", [])}
    rows = []
    for mode, rs in results.items():
        for r in rs:
            rows.append([r["set"], r["concurrency"], mode, r["constrained"], r["free"], r["constrained"] / r["free"],
                         r["constrained"] / plain.get((r["set"], r["concurrency"]), float("nan")), r["tau"],
                         r["tau_free"], r["tokens"], r["stop_frac"], r["mask_ms_per_call"], r["mask_ms_per_token"]])
    print(f"\nconstrained output (JSON schema) vs unconstrained of the same lengths, greedy, {n} prompts per set, "
          f"max_tokens {args.max_tokens}")
    print_table(["set", "C", "mode", "constrained tok/s", "free tok/s", "constrained / free", "vs off (constrained)",
                 "tau", "tau free", "tokens/req", "finished", "mask ms/call", "mask ms/token"], rows)
    return 0
