"""The server's prefix cache (issue 28): usage.prompt_tokens_details.cached_tokens, /metrics,
exactness against the cache switched off, n > 1, eviction before preemption, and the page
accounting after a load with hang-ups (every page free or cached and unreferenced).
(The allocator and the drafter state: tests/test_prefix_cache.py; split pages over "data":
tests/test_serve_mesh_pages.py.)"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.serve_util import metric, wait_for_idle, wait_until

SYSTEM = ("You are a careful assistant. Answer in short sentences, name your assumptions, and say so "
          "when you do not know. Prefer plain words to jargon.")


def _chat(url, model, messages, **kw):
    body = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **kw}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()


def _stream_usage(url, model, messages):
    body = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    text, usage = "", None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                elif chunk["choices"]:
                    text += chunk["choices"][0]["delta"].get("content") or ""
    return text, usage


PREFILL_SERIES = ("jaxspec_request_queue_time_seconds_count", "jaxspec_request_prefill_time_seconds_count",
                  "jaxspec_prefill_tokens_total", "jaxspec_prefill_padded_tokens_total", "jaxspec_prefill_calls_total",
                  "jaxspec_prefill_seconds_total")


@pytest.fixture
def cache_on(served):
    server, _ = served
    assert wait_for_idle(server)
    server.runner.allocator.drop_cached()  # a known start: nothing cached by earlier tests
    yield
    server.runner.allocator.enabled = True


def test_second_turn_reports_cached_tokens_and_equals_cache_off(served, cache_on):
    server, url = served
    model = server.model_name
    hits0, queries0 = metric(url, "jaxspec_prefix_cache_hits_total"), metric(url, "jaxspec_prefix_cache_queries_total")
    split0 = {k: metric(url, k) for k in PREFILL_SERIES}
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name three rivers."}]
    first = _chat(url, model, turn1)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    turn2 = turn1 + [first["choices"][0]["message"], {"role": "user", "content": "And three lakes?"}]
    second = _chat(url, model, turn2)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    page = server.runner.page_size
    # The whole first prompt's full pages at least: the system prompt and the first question.
    assert cached % page == 0 and cached >= (first["usage"]["prompt_tokens"] // page - 1) * page > 0
    text, usage = _stream_usage(url, model, turn2)  # streamed: the same prompt, now cached further
    assert usage["prompt_tokens_details"]["cached_tokens"] >= cached
    assert text == second["choices"][0]["message"]["content"]
    # /metrics: hits and queries in tokens, the rate, the cached pages.
    assert metric(url, "jaxspec_prefix_cache_hits_total") - hits0 == cached + usage["prompt_tokens_details"][
        "cached_tokens"]
    assert metric(url, "jaxspec_prefix_cache_queries_total") - queries0 == (
        first["usage"]["prompt_tokens"] + 2 * second["usage"]["prompt_tokens"])
    assert 0 < metric(url, "jaxspec_prefix_cache_hit_rate") < 1
    assert metric(url, "jaxspec_kv_pages_cached") > 0
    # The cache switched off: no hit reported, the same answer.
    server.runner.allocator.enabled = False
    off = _chat(url, model, turn2)
    assert off["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert off["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]
    # The TTFT split: every request admitted once, and the prefill calls computed exactly the uncached
    # prompt tokens (no preemption here), inside their padded shapes.
    d = {k: metric(url, k) - split0[k] for k in PREFILL_SERIES}
    prompts = [first["usage"]["prompt_tokens"]] + [second["usage"]["prompt_tokens"]] * 3
    assert d["jaxspec_request_queue_time_seconds_count"] == d["jaxspec_request_prefill_time_seconds_count"] == 4
    assert d["jaxspec_prefill_tokens_total"] == sum(prompts) - cached - usage["prompt_tokens_details"]["cached_tokens"]
    assert d["jaxspec_prefill_padded_tokens_total"] >= d["jaxspec_prefill_tokens_total"]
    assert d["jaxspec_prefill_calls_total"] >= 4 and d["jaxspec_prefill_seconds_total"] > 0


def test_n_samples_share_the_prompt_and_stay_exact(served, cache_on):
    server, url = served
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello twice."}]
    hits0 = metric(url, "jaxspec_prefix_cache_hits_total")
    out = _chat(url, server.model_name, msgs, n=3)
    texts = [c["message"]["content"] for c in out["choices"]]
    assert len(texts) == 3 and len(set(texts)) == 1  # greedy: every sample the same
    # Samples 2 and 3 waited for sample 1's prefill and share its prompt pages.
    page, prompt = server.runner.page_size, out["usage"]["prompt_tokens"]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the first sample's
    assert metric(url, "jaxspec_prefix_cache_hits_total") - hits0 == 2 * ((prompt - 1) // page) * page
    again = _chat(url, server.model_name, msgs, n=2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert [c["message"]["content"] for c in again["choices"]] == texts[:2]
    assert wait_for_idle(server)
    server.runner.allocator.check()


def test_eviction_comes_before_preemption(served, cache_on):
    """Distinct long prompts one after another: each leaves its pages cached, so the pool runs out
    of free pages and the next request evicts cached ones rather than preempting anyone."""
    server, url = served
    alloc = server.runner.allocator
    evicted0 = metric(url, "jaxspec_prefix_cache_evicted_pages_total")
    preempted0 = metric(url, "jaxspec_preemptions_total")
    for i in range(4):  # ~150 prompt tokens each: 4 x ~19 cached pages > the 47-page pool
        prompt = f"Topic {i}: " + " ".join(f"w{i}{j}" for j in range(38))
        r = httpx.post(url + "/v1/completions", json={"model": server.model_name, "prompt": prompt,
                                                      "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                       timeout=120)
        assert r.status_code == 200, r.text
    assert metric(url, "jaxspec_prefix_cache_evicted_pages_total") > evicted0
    assert metric(url, "jaxspec_preemptions_total") == preempted0
    assert alloc.num_cached <= alloc.total
    alloc.check()


def test_hang_ups_leave_every_page_free_or_cached_unreferenced(served, cache_on):
    server, url = served
    model = server.model_name
    errors = []

    def one(i):
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i % 3}?"}]
        body = {"model": model, "messages": msgs, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
                for n, line in enumerate(resp.iter_lines()):
                    if i % 2 and n >= 3:
                        return  # hang up mid-stream
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert wait_until(lambda: wait_for_idle(server, timeout=1), timeout=60)
    alloc = server.runner.allocator
    alloc.check()
    assert alloc.num_used == 0 and alloc.num_free == alloc.total and alloc.num_cached > 0
    assert not any(alloc.owned(s) for s in list(alloc._owned))


def test_cli_and_server_flag_turns_it_off():
    from jaxspec.generate import build_parser as cli_parser, config_from_args as cli_config
    from jaxspec.serve.launch import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args([])).engine.prefix_cache is True
    assert config_from_args(build_parser().parse_args(["--no-prefix-cache"])).engine.prefix_cache is False
    args = cli_parser().parse_args(["--no-prefix-cache", "--prompt", "x"])
    assert cli_config(args).engine.prefix_cache is False
