"""A real server on 127.0.0.1 driven by the official `openai` client and raw HTTP.

The model is a tiny random Llama with SmolLM2's tokenizer (real chat template,
real multi-byte tokens). The KV pool is small on purpose (`NUM_PAGES`), so the
concurrency and long-request tests run out of pages and exercise queueing and
preemption. References: `Engine.generate` (what `jaxspec.generate` runs) for
greedy answers; the allocator itself for leaked pages.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import openai
import pytest

from tests.reference import compile_events
from tests.serve_util import (NUM_PAGES, client, hold_decode, metric, post_and_keep_open, record_cancels,
                              wait_for_idle, wait_until)

@pytest.fixture(scope="module")
def reference(served, chat_model_dir):
    """Greedy text of the same model through Engine.generate (no speculation)."""
    from jaxspec.config import EngineSection
    from jaxspec.engine import Engine, Request
    from jaxspec.sampling_params import SamplingParams
    from jaxspec.models.loading import load_model

    m = load_model(chat_model_dir, progress=False)
    engine = Engine(m.params, m.config, EngineSection(max_batch_size=8, max_context=256, length_buckets=(64, 256)),
                    progress=False)
    stop = served[0].stop_ids

    def greedy(prompt_ids: list[int], max_new: int, ignore_eos: bool = False) -> str:
        req = Request(prompt_ids, SamplingParams(max_tokens=max_new), stop_token_ids=() if ignore_eos else stop)
        out = engine.generate([req])[0]
        return m.tokenizer.decode(out.output_ids, skip_special_tokens=True)

    return greedy


# ---- answers --------------------------------------------------------------------------


def test_greedy_answers_equal_engine_generate(served, reference):
    server, url = served
    c = client(url)
    tok = server.tokenizer
    prompt = "The quick brown fox"
    r = c.completions.create(model=server.model_name, prompt=prompt, max_tokens=24, temperature=0)
    assert r.choices[0].text == reference(tok.encode(prompt, add_special_tokens=False), 24)
    assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colours. 数学"}]
    r = c.chat.completions.create(model=server.model_name, messages=messages, max_tokens=20, temperature=0)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert r.choices[0].message.content == reference(ids, 20)
    assert r.usage.prompt_tokens == len(ids)


def test_long_prompt_is_prefilled_in_chunks_and_still_exact(served, reference):
    server, url = served
    ids = server.tokenizer.encode("Alpha beta gamma delta. " * 30, add_special_tokens=False)[:150]
    assert len(ids) > 2 * server.runner.prefill_chunk  # three prefill calls
    r = client(url).completions.create(model=server.model_name, prompt=ids, max_tokens=40, temperature=0)
    assert r.choices[0].text == reference(ids, 40)


def test_greedy_answer_equals_the_generate_cli(served, chat_model_dir, tmp_path):
    from jaxspec.generate import main

    server, url = served
    out = tmp_path / "out.jsonl"
    rc = main(["--model", str(chat_model_dir), "--prompt", "Hello!", "--max-new-tokens", "16", "--quiet",
               "--output", str(out), "--max-context", "256", "--set", "engine.length_buckets=64,256"])
    assert rc == 0
    want = json.loads(out.read_text())["text"]
    r = client(url).chat.completions.create(model=server.model_name, temperature=0, max_tokens=16,
                                            messages=[{"role": "user", "content": "Hello!"}])
    assert r.choices[0].message.content == want


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streaming_equals_non_streaming(served, kind):
    server, url = served
    c = client(url)
    kw = dict(model=server.model_name, max_tokens=30, temperature=0)
    if kind == "chat":
        kw["messages"] = [{"role": "user", "content": "Tell me about Paris 🇫🇷."}]
        full = c.chat.completions.create(**kw)
        chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        plain = list(c.chat.completions.create(stream=True, **kw))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        want = full.choices[0].message.content
    else:
        kw["prompt"] = "Once upon a time"
        full = c.completions.create(**kw)
        chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        plain = list(c.completions.create(stream=True, **kw))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        want = full.choices[0].text
    assert text == want
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert reasons == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(ch.choices for ch in plain)  # no usage chunk unless asked, as OpenAI
    # Tokens committed in one device call (steps_per_call iterations) go out in one chunk:
    # role chunk (chat) + the prefill's token + one chunk per call, not one per token.
    n, steps = full.usage.completion_tokens, server.runner.steps_per_call
    assert len([ch for ch in chunks if ch.choices]) <= 2 + -(-(n - 1) // steps) < n


def test_seeded_sampling_is_reproducible_and_n_gives_n_choices(served):
    server, url = served
    c = client(url)
    kw = dict(model=server.model_name, prompt="Random words:", max_tokens=12, temperature=1.0, top_p=0.9, n=3, seed=7)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert [x.index for x in a.choices] == [0, 1, 2]
    assert len({x.text for x in a.choices}) > 1  # seeds seed+i: the choices differ
    assert a.usage.completion_tokens == 36


def test_identical_prompts_of_one_request_sample_independently(served):
    """Issue 23 item 2: every prompt of a /v1/completions request drew the same coins (seed + j).
    Same-request pairs must agree no more often than pairs from different requests (Fisher's
    exact test over repeats; top-k 3 keeps agreement by chance near 1/3, shared noise makes it 1)."""
    from scipy import stats

    server, url = served
    c = client(url)
    kw = dict(model=server.model_name, prompt=["Pick one:", "Pick one:"], max_tokens=1, temperature=1.0,
              extra_body={"top_k": 3})
    firsts = [[ch.text for ch in sorted(c.completions.create(**kw).choices, key=lambda x: x.index)]
              for _ in range(30)]
    same = sum(a == b for a, b in firsts)
    cross = sum(firsts[r][0] == firsts[r + 1][1] for r in range(len(firsts) - 1))
    n_same, n_cross = len(firsts), len(firsts) - 1
    p = stats.fisher_exact([[same, n_same - same], [cross, n_cross - cross]], alternative="greater").pvalue
    assert p > 1e-3, f"identical prompts agreed {same}/{n_same} times in one request, {cross}/{n_cross} across"
    assert same < n_same  # shared noise agrees every time


def test_sampled_text_through_http_follows_the_exact_distribution(served, chat_model_dir):
    """Issue 23 section 5: the loop's first two tokens at T = 1 / top-k 5, through the HTTP server
    with speculation on (n-gram, the prompt repeats so it drafts) and the adaptive policy active,
    chi-square tested against the exact distribution from the torch model's logits (texts: token
    pairs that decode alike are pooled; a stop token ends the text). 150 unseeded requests x n 16."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from tests.test_loop_distribution import chi_square_p

    server, url = served
    assert server.scheduler.adaptive is not None and max(server.runner.candidates) > 0
    tok = server.tokenizer
    prompt = tok.encode("one two one two one two one two", add_special_tokens=False)
    hf = AutoModelForCausalLM.from_pretrained(chat_model_dir).eval()
    stop = set(server.stop_ids)

    def top5(ids):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        vals, idx = torch.topk(logits, 5)
        return idx.tolist(), torch.softmax(vals, -1).tolist()

    exact: dict[str, float] = {}
    for t1, p1 in zip(*top5(prompt)):
        if t1 in stop:
            exact[""] = exact.get("", 0.0) + p1
            continue
        for t2, p2 in zip(*top5(prompt + [t1])):
            text = tok.decode([t1] if t2 in stop else [t1, t2], skip_special_tokens=True)
            exact[text] = exact.get(text, 0.0) + p1 * p2
    c = client(url)
    seen: dict[str, int] = {}
    for _ in range(150):
        r = c.completions.create(model=server.model_name, prompt=prompt, max_tokens=2, temperature=1.0, n=16,
                                 extra_body={"top_k": 5})
        for ch in r.choices:
            seen[ch.text] = seen.get(ch.text, 0) + 1
    assert set(seen) <= set(exact), set(seen) - set(exact)
    keys = sorted(exact)
    p = chi_square_p(np.array([seen.get(k, 0) for k in keys]), np.array([exact[k] for k in keys]))
    assert p > 1e-3, (p, seen)
    assert metric(url, "jaxspec_spec_verify_calls_total") > 0


def test_stop_string_cuts_the_text_in_both_modes(served, reference):
    server, url = served
    c = client(url)
    prompt = "A list of things"
    full = c.completions.create(model=server.model_name, prompt=prompt, max_tokens=30, temperature=0).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]  # likely spans a token boundary
    want = full[: full.find(stop)]
    r = c.completions.create(model=server.model_name, prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = c.completions.create(model=server.model_name, prompt=prompt, max_tokens=30, temperature=0, stop=stop,
                                  stream=True)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want


# ---- load, cancellation, exhaustion --------------------------------------------------------


def test_64_concurrent_streaming_clients_all_complete(served):
    server, url = served

    async def one(c, i):
        rng = random.Random(i)
        n = rng.randint(4, 48)
        kw = dict(model=server.model_name, max_tokens=n, temperature=rng.choice([0.0, 0.7]), seed=i, stream=True,
                  stream_options={"include_usage": True})
        if i % 2:
            stream = await c.chat.completions.create(messages=[{"role": "user", "content": f"Question {i}?"}], **kw)
        else:
            stream = await c.completions.create(prompt=" ".join(["word"] * rng.randint(1, 60)), **kw)
        reasons, usage = [], None
        async for ch in stream:
            if ch.choices and ch.choices[0].finish_reason:
                reasons.append(ch.choices[0].finish_reason)
            if ch.usage:
                usage = ch.usage
        return reasons, usage, n

    async def main():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(64))), timeout=600)

    results = asyncio.run(main())
    for reasons, usage, n in results:
        assert len(reasons) == 1 and reasons[0] in ("stop", "length")
        assert usage is not None and 1 <= usage.completion_tokens <= n
        assert reasons[0] == "stop" or usage.completion_tokens == n
    assert wait_for_idle(server)
    assert metric(url, "jaxspec_kv_pages_used") == 0
    assert metric(url, "jaxspec_num_requests_running") == 0


def test_kv_exhaustion_long_requests_all_finish_exactly(served, reference):
    """More long requests than pages: they queue or get preempted and recomputed, and the
    greedy answers still equal the reference."""
    server, url = served
    tok = server.tokenizer
    before = metric(url, "jaxspec_preemptions_total")
    prompts = [f"Story number {i}: " + "the sea and the sky " * 8 for i in range(6)]
    pages_needed = sum(-(-(len(tok.encode(p, add_special_tokens=False)) + 150) // 8) for p in prompts)
    assert pages_needed > 2 * NUM_PAGES  # the test really oversubscribes the pool

    async def main():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        return await asyncio.gather(*(c.completions.create(model=server.model_name, prompt=p, max_tokens=150,
                                                           temperature=0, extra_body={"ignore_eos": True})
                                      for p in prompts))

    results = asyncio.run(main())
    for r in results:
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 150
    for p, r in zip(prompts, results):  # exact through preemption and recompute
        assert r.choices[0].text == reference(tok.encode(p, add_special_tokens=False), 150, ignore_eos=True)
    assert metric(url, "jaxspec_preemptions_total") > before
    assert wait_for_idle(server)


# The disconnect tests hold the scheduler at its first decode call (hold_decode), so the
# request is certainly still running when the client hangs up, and release it only once
# the handler has cancelled: no step of either depends on how fast the machine is.


def test_client_disconnect_mid_stream_frees_pages(served):
    server, url = served
    assert wait_for_idle(server)
    aborted = metric(url, "jaxspec_requests_total", {"status": "abort"})
    body = {"model": server.model_name, "prompt": "Count: one two three", "max_tokens": 200, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with hold_decode(server) as parked, record_cancels(server) as cancelled:
        with httpx.Client(timeout=60) as h:
            with h.stream("POST", url + "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        break  # got the first chunk (the prefill's token); hang up
                assert parked.wait(60), "the scheduler never reached a decode call"
                assert server.runner.allocator.num_used > 0  # live, holding pages
        assert wait_until(lambda: len(cancelled) == 1), "the hang-up did not cancel the request"
        assert cancelled[0].finish_reason is None  # cancelled while unfinished
    assert wait_for_idle(server, timeout=60)
    assert cancelled[0].finish_reason == "abort"
    assert metric(url, "jaxspec_requests_total", {"status": "abort"}) == aborted + 1


def test_non_streaming_client_disconnect_frees_pages(served):
    server, url = served
    assert wait_for_idle(server)
    aborted = metric(url, "jaxspec_requests_total", {"status": "abort"})
    # 16 long sequences: two waves of the 8-row batch, most still waiting when the client leaves.
    body = {"model": server.model_name, "prompt": "Tell me a long story", "max_tokens": 240, "temperature": 0,
            "ignore_eos": True, "n": 16}
    with hold_decode(server) as parked, record_cancels(server) as cancelled:
        sock = post_and_keep_open(url, "/v1/completions", body)
        try:
            assert parked.wait(60), "the scheduler never reached a decode call"
            assert server.runner.allocator.num_used > 0
        finally:
            sock.close()  # the client hangs up mid-request
        assert wait_until(lambda: len(cancelled) == 16), f"{len(cancelled)} of 16 sequences cancelled"
        assert all(s.finish_reason is None for s in cancelled)
    assert wait_for_idle(server, timeout=60)
    # Every one of the 16 was cancelled unfinished, so every one ends as an abort.
    assert [s.finish_reason for s in cancelled] == ["abort"] * 16
    assert metric(url, "jaxspec_requests_total", {"status": "abort"}) == aborted + 16


def test_huge_top_k_is_rejected_and_others_keep_running(served):
    server, url = served
    c = client(url)
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=server.model_name, prompt="x", max_tokens=3, extra_body={"top_k": 2**40})
    r = c.completions.create(model=server.model_name, prompt="x", max_tokens=3, extra_body={"top_k": 5},
                             temperature=1.0, seed=1)
    assert r.usage.completion_tokens == 3


def test_nothing_compiles_while_serving(served):
    server, url = served
    c = client(url)

    def serve_some():
        for i, n in enumerate((1, 5, 33, 70)):
            c.completions.create(model=server.model_name, prompt=[5 + i] * n, max_tokens=9 + i,
                                 temperature=0.5 * (i % 2), n=1 + i % 3)
        list(c.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=7, stream=True))

    before = server.runner.num_compiles
    events = compile_events(serve_some)
    assert events == [] and server.runner.num_compiles == before
    # Warm-up compiled every bucket. A total count would also hold the grammar builds that other
    # tests sharing the session's server asked for (their order differs between pytest workers).
    assert set(server.runner.all_keys()) <= set(server.runner._compiled)


# ---- metrics ----------------------------------------------------------------------------


def test_metrics_cover_requests_latency_pages_and_speculation(served):
    server, url = served
    c = client(url)
    gen_before = metric(url, "jaxspec_generation_tokens_total")
    r = c.completions.create(model=server.model_name, prompt="abc abc abc abc abc abc", max_tokens=20, temperature=0)
    assert metric(url, "jaxspec_generation_tokens_total") - gen_before == r.usage.completion_tokens
    text = httpx.get(url + "/metrics").text
    for name in ("jaxspec_requests_total", "jaxspec_prompt_tokens_total", "jaxspec_time_to_first_token_seconds_bucket",
                 "jaxspec_time_per_output_token_seconds_bucket", "jaxspec_num_requests_running",
                 "jaxspec_num_requests_waiting", "jaxspec_kv_pages_used", "jaxspec_kv_pages_free",
                 "jaxspec_spec_accept_length_bucket", "jaxspec_spec_accept_rate", "jaxspec_spec_num_draft_tokens",
                 "jaxspec_spec_num_steps", "jaxspec_spec_verify_calls_total", "jaxspec_spec_position_acceptance"):
        assert name in text, name
    assert metric(url, "jaxspec_kv_pages_used") + metric(url, "jaxspec_kv_pages_free") == NUM_PAGES - 1
    current = server.scheduler.adaptive.current
    assert current
    for (b, ctx), k in current.items():
        assert metric(url, "jaxspec_spec_num_steps", {"batch_bucket": str(b), "context_bucket": str(ctx)}) == k
    assert metric(url, "jaxspec_spec_verify_calls_total") > 0
    # What each draft length ran per batch bucket: the calls add up to every decode call; the tokens to
    # fewer than were generated (each request's first token comes from its prefill).
    by_k = {k: metric(url, "jaxspec_spec_calls_by_length_total", {"draft_length": str(k)})
            for k in server.runner.candidates}
    assert sum(by_k.values()) == metric(url, "jaxspec_decode_calls_total") > 0
    assert metric(url, "jaxspec_spec_seconds_by_length_total") > 0
    assert 0 < metric(url, "jaxspec_spec_tokens_by_length_total") < metric(url, "jaxspec_generation_tokens_total")
