"""Structured output through the server (issue 27): every request field that constrains the
output, the tool-call shape, the errors, a real OpenAI client's `parse`, and constrained requests
under load with preemption. The served model is a tiny random Llama with the SmolLM2 tokenizer
(n-gram speculation, adaptive), so validity comes from the grammar alone; exactness is checked
against the Hugging Face reference of tests/test_structured.py."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.serve_util import NUM_PAGES, client, metric, wait_for_idle

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def _post(url, path, body):
    return httpx.post(url + path, json=body, timeout=600)


def _chat(server, url, **extra):
    r = _post(url, "/v1/chat/completions", {"model": server.model_name, "max_tokens": 64, "temperature": 0,
                                            "messages": [{"role": "user", "content": "Reply in the asked format."}],
                                            **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_completion_equals_the_constrained_reference(served, chat_model_dir):
    """Greedy, through the scheduler (chunked prefill, bounded calls, speculation): the tokens of
    the HF reference loop with a fresh matcher's mask at each step."""
    from jaxspec.grammar.matcher import GrammarCompiler
    from jaxspec.sampling_params import StructuredOutputs
    from tests.conftest import make_tiny_hf
    from tests.test_structured import hf_constrained_greedy

    server, url = served
    tok = server.tokenizer
    prompt = "The record of the person, as JSON: "
    r = _post(url, "/v1/completions", {"model": server.model_name, "prompt": prompt, "max_tokens": 40,
                                       "temperature": 0, "response_format": {"type": "json_schema",
                                                                             "json_schema": {"name": "p",
                                                                                             "schema": PERSON}}})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    compiler = GrammarCompiler(tok, server.vocab_size, server.stop_ids)
    want = hf_constrained_greedy(make_tiny_hf("llama", vocab_size=49152), compiler,
                                 tok.encode(prompt, add_special_tokens=False), StructuredOutputs(json=PERSON), 40)
    assert text == tok.decode(want, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("extra,check", [
    ({"response_format": {"type": "json_object"}}, None),  # free-form keys: may run out of tokens, see below
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
     lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"structured_outputs": {"regex": r"[A-Z]{3}-\d{2}"}}, lambda t: re.fullmatch(r"[A-Z]{3}-\d{2}", t)),
    ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
    ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_regex": r"(yes|no)\."}, lambda t: t in ("yes.", "no.")),
    ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ({"guided_grammar": 'root ::= "x" ("y" | "z")'}, lambda t: t in ("xy", "xz")),
], ids=["json_object", "json_schema", "so-regex", "so-choice", "guided_json", "guided_regex", "guided_choice",
        "guided_grammar"])
def test_every_constraint_field(served, extra, check):
    server, url = served
    choice = _chat(server, url, **extra)
    text = choice["message"]["content"]
    if check is None:  # any object: a random model's keys may not close within max_tokens
        assert text.startswith("{"), choice
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)
        return
    assert choice["finish_reason"] == "stop", choice
    assert check(text), choice


def test_stream_and_n_are_constrained(served):
    server, url = served
    c = client(url)
    stream = c.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "go"}],
                                       max_tokens=32, temperature=1.0, seed=3, n=3, stream=True,
                                       extra_body={"guided_regex": r"(ab|cd){2}!"})
    texts = ["", "", ""]
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
    assert all(re.fullmatch(r"(ab|cd){2}!", t) for t in texts), texts


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: foo"}, "guided_grammar"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                  "function": {"name": "g"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "stream": True},
     "stream"),
])
def test_bad_constraints_are_400s_naming_the_field(served, extra, param):
    server, url = served
    r = _post(url, "/v1/chat/completions", {"model": server.model_name, "max_tokens": 8,
                                            "messages": [{"role": "user", "content": "x"}], **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err
    assert "Traceback" not in err["message"]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
             "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["a", "b"], "additionalProperties": False}}}]


def test_tool_calls_required_and_named(served):
    server, url = served
    c = client(url)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = c.chat.completions.create(model=server.model_name, messages=messages, tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, max_tokens=96, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None and len(ch.message.tool_calls) == 1
    for call in ch.message.tool_calls:
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)
    r = c.chat.completions.create(model=server.model_name, messages=messages, tools=TOOLS,
                                  tool_choice={"type": "function", "function": {"name": "add"}},
                                  max_tokens=32, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and [t.function.name for t in ch.message.tool_calls] == ["add"]
    jsonschema.validate(json.loads(ch.message.tool_calls[0].function.arguments), TOOLS[1]["function"]["parameters"])


class Point(pydantic.BaseModel):
    x: int = pydantic.Field(ge=0, le=99)
    label: str = pydantic.Field(max_length=6)


def test_openai_parse_returns_a_pydantic_object(served):
    server, url = served
    r = client(url).chat.completions.parse(model=server.model_name, response_format=Point, max_tokens=48,
                                           temperature=0, messages=[{"role": "user", "content": "A point?"}])
    point = r.choices[0].message.parsed
    assert isinstance(point, Point) and 0 <= point.x <= 99


def test_constrained_requests_under_load_all_finish(served):
    """32 concurrent requests, half of them constrained, long enough prompts that the page pool is
    oversubscribed (preemption and recompute): every one finishes, every constrained one validates,
    and the pool drains."""
    server, url = served
    tok = server.tokenizer
    before = metric(url, "jaxspec_preemptions_total")
    prompts = [f"Entry {i}: " + "the sea and the sky " * 6 for i in range(32)]
    assert sum(-(-(len(tok.encode(p, add_special_tokens=False)) + 64) // 8) for p in prompts) > 2 * NUM_PAGES

    async def main():
        c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)

        def one(i, p):
            extra = {"guided_json": PERSON} if i % 2 == 0 else {"ignore_eos": True}
            return c.completions.create(model=server.model_name, prompt=p, max_tokens=64,
                                        temperature=0 if i % 4 < 2 else 0.8, seed=i, extra_body=extra)

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    for i, r in enumerate(results):
        ch = r.choices[0]
        if i % 2 == 0:
            assert ch.finish_reason == "stop", (i, ch.text)
            jsonschema.validate(json.loads(ch.text), PERSON)
        else:
            assert ch.finish_reason == "length" and r.usage.completion_tokens == 64
    assert metric(url, "jaxspec_preemptions_total") > before
    assert wait_for_idle(server)


def test_grammar_builds_compile_in_the_background(chat_model_dir):
    """serve.grammar_warmup: once the server is ready, a thread compiles every bucket's "+grammar"
    build (they cannot be stored), and shutdown waits for it; a constrained request then compiles
    nothing. Control: with one of those builds dropped, the same request compiles it again."""
    from jaxspec.engine.host_io import GRAMMAR
    from jaxspec.serve.server import build_server
    from tests.serve_util import serve_config

    small = {"spec.algorithm": "none", "engine.batch_buckets": "1", "engine.max_batch_size": 1,
             "serve.context_buckets": "64", "serve.adaptive": False, "serve.grammar_warmup": True}
    server = build_server(serve_config(chat_model_dir, **small), progress=False)
    try:
        server.warm_up()
        assert server.warmup == "running"  # what /health reports, and what `bench serve` waits out
        server._warmup.join(timeout=600)
        assert server.warmup == "done"
        keys = server.runner.all_keys(GRAMMAR)
        assert set(keys) <= set(server.runner._compiled)
        for drop in (False, True):
            if drop:
                del server.runner._compiled[next(k for k in keys if k[0].startswith("decode"))]
            before = server.runner.num_compiles
            seq = server.submit(server.tokenizer.encode("Hi", add_special_tokens=False),
                                _params({"guided_choice": ["on", "off"]}), 0, lambda e: None, "prompt")
            assert _wait(lambda: seq.finish_reason is not None) and seq.finish_reason == "stop"
            assert server.runner.num_compiles == before + drop
    finally:
        server.shutdown()


def test_programs_stay_within_vm_max_map_count(chat_model_dir, monkeypatch):
    """XLA:CPU maps ~3 mappings per kernel, and a process past vm.max_map_count dies in LLVM (the default
    server did, 2 minutes after it was ready). Counted here as 100 mappings per resident program under
    a limit that holds the buckets and three more: the warm-up stops with room for two, a request's
    build evicts the least recently used build (never a bucket) and is served, and a server whose
    buckets cannot fit refuses at start-up, naming the limit."""
    from jaxspec.engine import mappings
    from jaxspec.engine.host_io import GRAMMAR
    from jaxspec.serve.server import build_server
    from tests.serve_util import serve_config

    small = {"spec.algorithm": "none", "engine.batch_buckets": "1", "engine.max_batch_size": 1,
             "serve.context_buckets": "64", "serve.adaptive": False, "serve.grammar_warmup": True}
    server = build_server(serve_config(chat_model_dir, **small), progress=False)
    runner = server.runner
    monkeypatch.setattr(mappings, "count", lambda: 1000 + 100 * len(runner._compiled))
    buckets, builds = runner.all_keys(), runner.all_keys(GRAMMAR)
    assert len(builds) >= 5
    runner.map_budget = mappings.MapBudget(max_maps=int((1000 + 100 * (len(buckets) + 3)) / (1 - mappings.RESERVE_FRACTION)) + 1)
    try:
        server.warm_up()
        server._warmup.join(timeout=600)
        resident = lambda: [k for k in runner._compiled if k[0].endswith(GRAMMAR)]  # noqa: E731
        assert runner.map_budget.per_program == 100 and len(resident()) == 2  # stopped with room for two
        for key in builds[2:5]:  # three more builds: the third evicts the oldest resident one
            runner.compile([key])
            assert set(buckets) <= set(runner._compiled) and key in runner._compiled and len(resident()) <= 3
        assert set(resident()) == set(builds[2:5])  # the least recently used went first
        seq = server.submit(server.tokenizer.encode("Hi", add_special_tokens=False),
                            _params({"guided_choice": ["on", "off"]}), 0, lambda e: None, "prompt")
        assert _wait(lambda: seq.finish_reason is not None) and seq.finish_reason == "stop"
        assert len(resident()) == 3 and set(buckets) <= set(runner._compiled)
    finally:
        server.shutdown()
    # Control: room for fewer than the buckets. The first program is measured, the rest refused.
    server = build_server(serve_config(chat_model_dir, **small), progress=False)
    monkeypatch.setattr(mappings, "count", lambda: 1000 + 100 * len(server.runner._compiled))
    server.runner.map_budget = mappings.MapBudget(max_maps=1000 + 100 * len(buckets))
    with pytest.raises(mappings.MapLimitError, match="vm.max_map_count is"):
        server.warm_up()
    assert "vm.max_map_count" in server.startup_error and len(server.runner._compiled) == 1
    server.shutdown()


def _params(extra):
    from jaxspec.serve.protocol import parse_gen_params

    return parse_gen_params({"max_tokens": 8, "temperature": 0, **extra}, 16, kind="completion")


def _wait(cond, timeout=300.0):
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False
