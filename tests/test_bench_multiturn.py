"""The multi-turn serve benchmark's pure parts: choosing conversations, building each turn's
messages, reading usage, and aggregating records into the table (no server, no ShareGPT package)."""

from __future__ import annotations

import asyncio
import collections
import json
import math

import httpx
import pytest

from jaxspec.bench import multiturn as mt
from jaxspec.bench import serve


def sharegpt(*turns):
    """A ShareGPT record from (from, value) pairs."""
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}


def chat(n_human):
    turns = []
    for i in range(n_human):
        turns += [("human", f"q{i + 1}"), ("gpt", f"a{i + 1}")]
    return sharegpt(*turns)


def test_choose_skips_short_conversations_and_caps_turns_and_count():
    records = [chat(2), chat(3), "not a record", chat(6), chat(1), chat(4), chat(5)]
    got = mt.choose_conversations(records, n=2, turns=4)
    # chat(2) and chat(1) have fewer than 3 human turns; only the first 2 qualifying are taken.
    assert got == [["q1", "q2", "q3"], ["q1", "q2", "q3", "q4"]]


def test_choose_cuts_long_turns_and_merges_consecutive_human_turns():
    long = "y" * 2000
    rec = sharegpt(("gpt", "greeting dropped"), ("human", long), ("gpt", "a"), ("human", "b1"), ("human", "b2"),
                   ("gpt", "c"), ("human", "d"))
    # Leading gpt dropped; b1 + b2 merge into one turn, so this is exactly 3 human turns.
    assert mt.choose_conversations([rec], n=5, turns=4, max_chars=1500) == [["y" * 1500, "b1\n\nb2", "d"]]
    # Two human turns after merging: skipped.
    assert mt.choose_conversations([sharegpt(("human", "a"), ("human", "b"), ("gpt", "c"), ("human", "d"))],
                                   n=5, turns=4) == []


def test_turn_messages_alternate_and_carry_the_server_replies():
    users = ["u1", "u2", "u3"]
    assert mt.turn_messages("SYS", users, []) == [{"role": "system", "content": "SYS"},
                                                  {"role": "user", "content": "u1"}]
    msgs = mt.turn_messages("SYS", users, ["r1", "r2"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in msgs] == ["SYS", "u1", "r1", "u2", "r2", "u3"]


def test_system_prompt_is_long_and_tagged_per_level():
    assert len(mt.SYSTEM_PROMPT) > 500 and mt.SYSTEM_PROMPT.count(". ") >= 5  # ~100+ tokens, several sentences
    a, b = mt.level_system_prompt("aa"), mt.level_system_prompt("bb")
    assert a != b and a.endswith(mt.SYSTEM_PROMPT) and b.endswith(mt.SYSTEM_PROMPT)


def test_usage_counts_treat_missing_cached_tokens_as_zero():
    assert mt.usage_counts({"prompt_tokens": 50, "completion_tokens": 8}) == (50, 0, 8)
    assert mt.usage_counts({"prompt_tokens": 50, "completion_tokens": 8, "prompt_tokens_details": None}) == (50, 0, 8)
    assert mt.usage_counts({"prompt_tokens": 50, "completion_tokens": 8,
                            "prompt_tokens_details": {"cached_tokens": 32}}) == (50, 32, 8)


def records(cached=(0, 100, 250, 380)):
    return [{"turn": t + 1, "ttft": 0.1 * (t + 1), "tokens": 10, "prompt_tokens": 100 * (t + 1), "cached_tokens": c}
            for t, c in enumerate(cached)]


def test_summarize_hit_rates_percentiles_and_throughput():
    s = mt.summarize(records(), wall=2.0)
    assert s["requests"] == 4
    assert s["tok_s"] == pytest.approx(40 / 2.0)
    assert s["hit_rate"] == pytest.approx(730 / 1000)  # cached 0+100+250+380 over prompt 100+200+300+400
    assert s["hit_rate_late"] == pytest.approx(630 / 700)  # turns 3 and 4 only
    assert s["ttft_p50"] == pytest.approx(0.25)
    assert s["ttft_p99"] == pytest.approx(0.3 + 0.97 * 0.1)  # linear between the 3rd and 4th of 4
    empty = mt.summarize([], wall=0.0)
    assert empty["requests"] == 0 and all(math.isnan(empty[k]) for k in ("tok_s", "hit_rate", "ttft_p50"))


def test_table_rows_ratio_against_cache_off_and_order():
    on = mt.summarize(records(), 2.0)  # TTFT p50 0.25
    off = mt.summarize([{**r, "ttft": 2 * r["ttft"], "cached_tokens": 0} for r in records()], 2.0)  # p50 0.5
    results = {(8, "on", "on"): on, (1, "off", "off"): off, (1, "off", "on"): on, (1, "on", "on"): on}
    rows = mt.table_rows(results, [1, 8], ["off", "on"], ["on", "off"])
    assert [r[:3] for r in rows] == [[1, "off", "on"], [1, "off", "off"], [1, "on", "on"], [8, "on", "on"]]
    assert len(rows[0]) == len(mt.TABLE_HEADERS)
    assert rows[0][6] == pytest.approx(73.0) and rows[0][7] == pytest.approx(90.0)
    assert rows[0][8] == pytest.approx(2.0)  # cache off 0.5 s / cache on 0.25 s
    assert rows[1][8] == pytest.approx(1.0) and rows[1][6] == 0.0
    assert math.isnan(rows[2][8])  # no cache-off server for spec on


def test_spec_hit_lines_pool_levels_with_cache_on():
    results = {(1, "off", "on"): mt.summarize(records(), 1.0), (8, "off", "on"): mt.summarize(records(), 1.0),
               (1, "on", "on"): mt.summarize(records((0, 0, 0, 0)), 1.0),
               (8, "on", "on"): mt.summarize(records(), 1.0),
               (1, "on", "off"): mt.summarize(records((0, 0, 0, 0)), 1.0)}
    [line] = mt.spec_hit_lines(results, ["off", "on"])
    # spec on pooled: 730 cached of 2000 prompt; off: 1460 of 2000. Turn>=3: 630/1400 and 1260/1400.
    assert "spec on 36.5% (turn>=3 45.0%) vs spec off 73.0% (turn>=3 90.0%)" in line
    assert mt.spec_hit_lines({(1, "on", "on"): results[(1, "on", "on")]}, ["off", "on"]) == []


def fake_server(seen):
    """An httpx MockTransport handler answering chat requests with SSE: reply "R<n>" to the n-th request,
    usage with cached_tokens = 10 per message before the system prompt and the newest turn."""
    def handler(request):
        body = json.loads(request.content)
        seen.append(body)
        n = len(seen)
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
                  {"choices": [{"index": 0, "delta": {"content": "R"}}]},
                  {"choices": [{"index": 0, "delta": {"content": str(n)}}]},
                  {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": 100 * n, "completion_tokens": 2,
                                            "prompt_tokens_details": {"cached_tokens": 10 * (len(body["messages"]) - 2)}}}]
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
    return handler


def test_replay_resends_the_server_replies_and_reads_usage():
    seen = []

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(fake_server(seen))) as client:
            return await mt.replay(client, "http://x", "m", "SYS", ["u1", "u2", "u3"], 64, 0.0, asyncio.Semaphore(1))

    recs, complete = asyncio.run(go())
    assert complete and [r["turn"] for r in recs] == [1, 2, 3]
    assert [m["content"] for m in seen[2]["messages"]] == ["SYS", "u1", "R1", "u2", "R2", "u3"]
    assert all(b["stream"] and b["ignore_eos"] and b["stream_options"] == {"include_usage": True} and
               b["max_tokens"] == 64 and b["temperature"] == 0.0 for b in seen)
    assert [(r["prompt_tokens"], r["cached_tokens"], r["tokens"]) for r in recs] == [(100, 0, 2), (200, 20, 2),
                                                                                      (300, 40, 2)]


def test_replay_stops_a_conversation_the_context_cannot_hold():
    def handler(request):
        n = len(json.loads(request.content)["messages"])
        if n > 3:
            return httpx.Response(400, json={"error": {"message": "prompt exceeds the context of 2048 tokens"}})
        return fake_server([])(request)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await mt.replay(client, "http://x", "m", "SYS", ["u1", "u2"], 8, 0.0, asyncio.Semaphore(1))

    recs, complete = asyncio.run(go())
    assert not complete and [r["turn"] for r in recs] == [1]


def test_serve_cli_dispatches_multiturn_with_its_defaults(monkeypatch):
    got = {}
    monkeypatch.setattr(mt, "run", lambda args, levels: got.update(args=args, levels=levels) or 0)
    assert serve.main(["--workload", "multiturn", "--concurrency", "1,4"]) == 0
    a = got["args"]
    assert got["levels"] == [1, 4]
    assert (a.max_tokens, a.max_context, a.modes, a.cache, a.num_conversations, a.turns) == \
        (64, 2048, "off,on", "on,off", 16, 4)
    assert serve.WORKLOAD_DEFAULTS["single"] == {"max_tokens": 128, "max_context": 1024, "modes": "off,on,adaptive"}


def test_cache_off_server_sets_the_prefix_cache_key(monkeypatch):
    args = type("A", (), {"max_context": 2048, "set": ["engine.page_size=32"]})()
    off = mt.server_overrides("on", "off", [1, 8], args)
    on = mt.server_overrides("off", "on", [1, 8], args)
    assert off["engine.prefix_cache"] == "false" and "engine.prefix_cache" not in on
    assert off["spec.algorithm"] == "ngram" and on["spec.algorithm"] == "none"
    assert off["engine.max_batch_size"] == 8 and off["engine.max_context"] == 2048
    assert off["engine.page_size"] == "32"


def test_an_error_in_the_stream_is_raised_not_misread():
    def handler(request):
        text = 'data: {"error": {"message": "scheduler step failed"}}\n\ndata: [DONE]\n\n'
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await mt.one_turn(client, "http://x", "m", [{"role": "user", "content": "hi"}], 8, 0.0)

    with pytest.raises(RuntimeError, match="scheduler step failed"):
        asyncio.run(go())


def test_time_split_differences_the_counters_over_a_level():
    S = collections.namedtuple("S", "name value")
    names = mt.SPLIT_SERIES
    before = mt.counter_totals([S(names["queue_s"], 1.0), S(names["admitted"], 2), S("jaxspec_other", 9.0)])
    after = mt.counter_totals([S(names["queue_s"], 4.0), S(names["admitted"], 5), S(names["to_first_s"], 6.0),
                               S(names["prefill_tokens"], 30), S(names["prefill_padded"], 120),
                               # labelled per draft length: summed
                               S(names["decode_s"], 2.0), S(names["decode_s"], 3.5), S(names["decode_calls"], 7)])
    t = mt.time_split(before, after)
    assert t["queue_mean"] == 1.0 and t["to_first_mean"] == 2.0 and t["prefill_fill"] == 0.25
    assert t["decode_s"] == 5.5 and t["decode_calls"] == 7
    assert "queue 1.00 s + prefill 2.00 s" in mt.split_line(t)
    # A server without these series (an older build, another engine) reads NaN means, not a crash.
    assert math.isnan(mt.time_split(mt.counter_totals([]), mt.counter_totals([]))["queue_mean"])


def test_rounds_take_turns_and_read_the_cache_ratio_per_round(monkeypatch, capsys):
    """--rounds with the multiturn workload: the cache-on and cache-off servers stay up, their replays
    alternate ABBA, and the TTFT ratio is read round by round (each round's machine speed falls on
    both; here 1.0, 0.5, 0.8 times a true 4x). Servers and replays are stubbed. --rounds with --url or
    the constrained workload is refused, not ignored."""
    import contextlib

    from jaxspec.bench import multiturn as mt
    from jaxspec.bench import serve as bs
    from jaxspec.bench import servers

    order, machine = [], [1.0, 0.5, 0.8]

    @contextlib.contextmanager
    def fake_launched(model, overrides, label, config=None):
        yield f"http://{label}", "m"

    def fake_server(url, model, convs, levels, args, label):
        slow = 1 / machine[len(order) // 2]
        order.append(label["cache"])
        ttft = (1.0 if label["cache"] == "on" else 4.0) * slow
        return {(c, label["spec"], label["cache"]): {"requests": 4, "ttft_p50": ttft, "ttft_p99": ttft, "tok_s": 1.0,
                                                     "hit_rate": 0.5, "hit_rate_late": 0.8, "prompt": 10, "cached": 5,
                                                     "prompt_late": 4, "cached_late": 3} for c in levels}

    monkeypatch.setattr(servers, "launched", fake_launched)
    monkeypatch.setattr(mt, "run_server", fake_server)
    monkeypatch.setattr(mt, "load_conversations", lambda n, turns: [["hi"]] * n)
    assert bs.main(["--workload", "multiturn", "--concurrency", "8", "--modes", "off", "--rounds", "3",
                    "--hf-prompts", "0"]) == 0
    assert order == ["on", "off", "off", "on", "on", "off"]
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 8 | off | on |"))
    assert [c.strip() for c in row.strip("|").split("|")][4:] == ["4.00", "4.00", "4.00", "3"]
    for argv, why in ((["--rounds", "2", "--url", "http://x"], "not with --url"),
                      (["--rounds", "2", "--workload", "constrained"], "constrained runs one pass"),
                      (["--rounds", "0"], "at least 1")):
        with pytest.raises(SystemExit, match=why):
            bs.main(argv + ["--hf-prompts", "0"])
