"""Log-probabilities (issue 26, first part): the raw distribution at every prompt position and at
every generated token, equal to Hugging Face's log_softmax over the same tokens, in the API, the
CLI and the server (`echo` + `logprobs`, what lm-evaluation-harness's loglikelihood sends; chat
`logprobs` / `top_logprobs`), with speculation on or off, greedy or sampled."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from jaxspec import LLM, SamplingParams
from jaxspec.sampling_params import SamplingError

ENGINE = dict(max_batch_size=2, max_context=256, length_buckets=(32, 64, 256), page_size=8)


def hf_logprobs(hf, ids: list[int]) -> np.ndarray:
    """[T, V] log_softmax of HF's logits: row i is the distribution after ids[:i + 1]."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


@pytest.fixture(scope="module")
def llms(tiny_dirs):
    path, hf = tiny_dirs["llama"]
    return hf, {spec: LLM(str(path), spec=spec, progress=False, **ENGINE) for spec in (None, "ngram")}


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_prompt_logprobs_equal_hf(llms, spec):
    hf, engines = llms
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 250, size=n)] for n in (5, 40, 150)]  # one spans two chunks
    outs = engines[spec].generate(prompts, SamplingParams(max_tokens=3, prompt_logprobs=4))
    for ids, out in zip(prompts, outs):
        ref = hf_logprobs(hf, ids)
        got = out.prompt_logprobs
        assert len(got) == len(ids) and got[0] is None
        for i in range(1, len(ids)):
            row = ref[i - 1]
            mine = got[i][ids[i]]
            assert math.isclose(mine.logprob, row[ids[i]], abs_tol=2e-4), (i, mine, row[ids[i]])
            lo, hi = ((row > row[ids[i]] + s).sum() + 1 for s in (2e-4, -2e-4))  # rank, up to float ties
            assert lo <= mine.rank <= hi, (i, mine.rank, lo, hi)
            top = sorted((k for k in got[i] if got[i][k].rank <= 4), key=lambda k: got[i][k].rank)
            assert len(top) >= 4 and set(top[:2]) == set(np.argsort(-row)[:2].tolist())
            for k in top[:4]:
                assert math.isclose(got[i][k].logprob, row[k], abs_tol=2e-4)
        assert out.outputs[0].token_ids  # generation ran as usual beside the scoring


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_generated_logprobs_equal_hf(llms, spec):
    """Every generated token's log-probability and top entries, at batch 1 and 2 (three prompts over
    buckets of 2), greedy and sampled: the same numbers as HF over prompt + output."""
    hf, engines = llms
    engines[spec]._scorer = None  # built on first use: asserted unused below
    prompts = [[5, 17, 33, 9, 120], [7, 7, 7, 7, 7, 7, 7, 7], [200, 3, 41]]
    for sp in (SamplingParams(max_tokens=12, logprobs=3), SamplingParams(max_tokens=12, logprobs=3,
                                                                         temperature=0.9, seed=5)):
        for ids, out in zip(prompts, engines[spec].generate(prompts, sp)):
            gen = out.outputs[0].token_ids
            got = out.outputs[0].logprobs
            assert len(got) == len(gen) and out.prompt_logprobs is None
            ref = hf_logprobs(hf, ids + gen)
            for j, t in enumerate(gen):
                row = ref[len(ids) + j - 1]
                assert math.isclose(got[j][t].logprob, row[t], abs_tol=2e-4), (j, got[j][t], row[t])
                best = max(got[j], key=lambda k: got[j][k].logprob)
                assert got[j][best].rank == 1 and math.isclose(got[j][best].logprob, row.max(), abs_tol=2e-4)
            if sp.temperature == 0:
                assert all(got[j][t].rank == 1 for j, t in enumerate(gen))  # greedy: every token the argmax
    assert engines[spec]._scorer is None  # read from the loop's own logits: no scoring forward ran


def test_prompt_logprobs_off_and_bad_values(llms):
    _, engines = llms
    assert engines[None].generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].prompt_logprobs is None
    for field in ("prompt_logprobs", "logprobs"):
        for bad in (-1, 21, 2.5, True):
            with pytest.raises(SamplingError, match=f"{field} must be an integer in \\[0, 20\\]"):
                SamplingParams(**{field: bad})
    out = engines[None].generate([[5, 6, 7]], SamplingParams(max_tokens=2, prompt_logprobs=0))[0]
    assert [sorted(e) if e else None for e in out.prompt_logprobs] == [None, [6], [7]]  # the token alone


def test_block_top_k_is_lax_top_k():
    """The loop's top entries (`logprobs.top_k`, blocks by their maxima) equal lax.top_k on a real-sized
    vocabulary, including a ragged last block, peaked rows and heavy ties (values equal; ids hold them)."""
    import jax

    from jaxspec.speculative.logprobs import top_k

    rng = np.random.default_rng(0)
    v = 49152 + 37
    smooth = rng.normal(size=(5, v)).astype(np.float32)
    peaked = smooth.copy()
    peaked[:, v - 3:] += 40.0  # the top entries all in the ragged last block
    ties = rng.integers(0, 4, size=(3, v)).astype(np.float32)
    for x in (smooth, peaked, ties):
        vals, ids = jax.jit(top_k, static_argnums=1)(x, 20)
        ref_vals, ref_ids = jax.lax.top_k(x, 20)
        np.testing.assert_array_equal(vals, ref_vals)
        np.testing.assert_array_equal(np.take_along_axis(x, np.asarray(ids), 1), vals)
        if x is not ties:
            np.testing.assert_array_equal(ids, ref_ids)


# ---- the server: echo + logprobs, as lm-evaluation-harness's loglikelihood asks ---------------------


def test_server_echo_logprobs_equal_hf(served, chat_model_dir):
    """The request local-completions sends for a loglikelihood (max_tokens 1, echo, logprobs 1,
    temperature 0), scored the way it reads the answer, against HF; speculation is on (n-gram,
    adaptive) and changes nothing here."""
    import transformers as tf

    from tests.serve_util import client

    server, url = served
    hf = tf.AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval()
    tok = server.tokenizer
    context, continuation = "Question: what colour is the sky? Answer:", " blue"
    ctx = tok.encode(context, add_special_tokens=False)
    ids = ctx + tok.encode(continuation, add_special_tokens=False)
    c = client(url)
    r = c.completions.create(model=server.model_name, prompt=[ids, ctx], max_tokens=1, temperature=0, logprobs=1,
                             echo=True, seed=1234)
    for choice, prompt in zip(sorted(r.choices, key=lambda ch: ch.index), (ids, ctx)):
        ref = hf_logprobs(hf, prompt)
        lp = choice.logprobs
        assert len(lp.token_logprobs) == len(prompt) + 1 and lp.token_logprobs[0] is None
        want = [ref[i - 1, prompt[i]] for i in range(1, len(prompt))] + [ref[-1].max()]  # the greedy token
        np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=2e-4)
        for i in range(1, len(prompt) + 1):  # top-1 at each position: HF's argmax
            (text, value), = lp.top_logprobs[i].items()
            row = ref[i - 1]
            assert math.isclose(value, row.max(), abs_tol=2e-4) and text == tok.decode([int(row.argmax())])
        assert choice.text.startswith(tok.decode(prompt)) and lp.text_offset[0] == 0
        assert lp.tokens[1] == tok.decode([prompt[1]])
    # lm-eval's reading: the continuation's summed log-probability and whether it is the greedy path.
    lp = sorted(r.choices, key=lambda ch: ch.index)[0].logprobs
    cont = lp.token_logprobs[len(ctx):-1]
    ref = hf_logprobs(hf, ids)
    assert math.isclose(sum(cont), sum(ref[i - 1, ids[i]] for i in range(len(ctx), len(ids))), abs_tol=5e-4)


def test_server_generated_logprobs_completions_and_chat(served, chat_model_dir):
    """Completions' logprobs over generated tokens (no echo) and chat's logprobs / top_logprobs, equal
    to HF over prompt + output; the server speculates (n-gram, adaptive)."""
    import transformers as tf

    from tests.serve_util import client

    server, url = served
    hf = tf.AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval()
    tok = server.tokenizer
    c = client(url)
    ids = tok.encode("one two three one two three one two", add_special_tokens=False)
    r = c.completions.create(model=server.model_name, prompt=ids, max_tokens=10, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    with torch.no_grad():  # HF's own greedy continuation: the tokens the server must have produced
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)[0, len(ids):].tolist()
    assert lp.tokens == [tok.decode([t]) for t in gen] and r.usage.completion_tokens == 10
    ref = hf_logprobs(hf, ids + gen)
    np.testing.assert_allclose(lp.token_logprobs, [ref[len(ids) + j - 1, t] for j, t in enumerate(gen)], atol=2e-4)
    assert all(len(t) == 2 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    messages = [{"role": "user", "content": "Count: one two three"}]
    r = c.chat.completions.create(model=server.model_name, messages=messages, max_tokens=6, temperature=0,
                                  logprobs=True, top_logprobs=3)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)
    ref_ids = [int(hf_logprobs(hf, prompt)[-1].argmax())]
    assert content[0].token == tok.decode(ref_ids) and bytes(content[0].bytes) == content[0].token.encode()
    assert math.isclose(content[0].logprob, hf_logprobs(hf, prompt)[-1].max(), abs_tol=2e-4)
    assert content[0].top_logprobs[0].token == content[0].token  # greedy: the top entry is the token


def test_server_streams_logprobs(served, chat_model_dir):
    """Streamed completions and chat carry each chunk's tokens' logprobs: together, the same tokens
    and numbers as HF over prompt + output (greedy, so HF's own continuation), the completions'
    text_offset running over the chunks; the server speculates (n-gram, adaptive)."""
    import transformers as tf

    from tests.serve_util import client

    server, url = served
    hf = tf.AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval()
    tok = server.tokenizer
    c = client(url)
    ids = tok.encode("one two three one two three one two", add_special_tokens=False)
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    ref = hf_logprobs(hf, ids + gen)
    tokens, lps, offsets, tops = [], [], [], []
    for ch in c.completions.create(model=server.model_name, prompt=ids, max_tokens=12, temperature=0, logprobs=2,
                                   stream=True):
        lp = ch.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens
            lps += lp.token_logprobs
            offsets += lp.text_offset
            tops += lp.top_logprobs
    assert tokens == [tok.decode([t]) for t in gen]
    np.testing.assert_allclose(lps, [ref[len(ids) + j - 1, t] for j, t in enumerate(gen)], atol=2e-4)
    assert offsets == np.cumsum([0] + [len(t) for t in tokens[:-1]]).tolist()
    assert all(len(t) == 2 and math.isclose(max(t.values()), lp, abs_tol=2e-4) for t, lp in zip(tops, lps))
    # echo streams too: each choice opens with its prompt's text and scores, then its tokens' offsets go on.
    chunks = [ch.choices[0] for ch in c.completions.create(model=server.model_name, prompt=ids, max_tokens=3,
                                                           temperature=0, logprobs=1, echo=True, stream=True)]
    head = chunks[0].logprobs
    assert chunks[0].text == tok.decode(ids) and head.token_logprobs[0] is None and head.top_logprobs[0] is None
    np.testing.assert_allclose(head.token_logprobs[1:], [ref[i - 1, ids[i]] for i in range(1, len(ids))], atol=2e-4)
    nxt = next(ch.logprobs for ch in chunks[1:] if ch.logprobs is not None)
    assert nxt.tokens[0] == tok.decode([gen[0]]) and nxt.text_offset[0] == sum(len(t) for t in head.tokens)
    messages = [{"role": "user", "content": "Count: one two three"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    content = [e for ch in c.chat.completions.create(model=server.model_name, messages=messages, max_tokens=8,
                                                      temperature=0, logprobs=True, top_logprobs=1, stream=True)
               if ch.choices and ch.choices[0].logprobs is not None for e in ch.choices[0].logprobs.content]
    with torch.no_grad():
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    gen = gen[: gen.index(tok.eos_token_id) + 1] if tok.eos_token_id in gen else gen
    ref = hf_logprobs(hf, prompt + gen)
    assert [e.token for e in content] == [tok.decode([t]) for t in gen]
    np.testing.assert_allclose([e.logprob for e in content], [ref[len(prompt) + j - 1, t] for j, t in enumerate(gen)],
                               atol=2e-4)
    assert all(e.top_logprobs[0].token == e.token for e in content)  # greedy: the top entry is the token


def test_server_logprobs_under_an_eagle3_tree_at_batch_4(chat_model_dir, tmp_path):
    """Through the server with a feature drafter's tree (EAGLE-3, top-k 2), four streamed chat requests
    at once, sampled: each token's logprob is HF's over prompt + output, and the server speculated."""
    import asyncio

    import transformers as tf

    from jaxspec.serve.app import create_app
    from jaxspec.serve.server import build_server
    from tests.heads_fixtures import write_eagle3_head
    from tests.serve_util import ServerThread, serve_config

    hf = tf.AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval()
    head = write_eagle3_head(tmp_path / "e3", hf, layer_ids=[0, 1, 1], convention="input")
    server = build_server(serve_config(chat_model_dir, **{
        "spec.algorithm": "eagle3", "spec.draft_model": str(head), "spec.topk": 2, "spec.num_steps": 2,
        "spec.num_draft_tokens": 5, "serve.adaptive": False}), progress=False)
    thread = ServerThread(create_app(server)).start()
    server.warm_up()
    try:
        import openai

        c = openai.AsyncOpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0)
        questions = ["Count: one two", "Name a colour", "Say hello", "List three fruits"]

        async def one(q, seed):
            content = []
            stream = await c.chat.completions.create(
                model=server.model_name, messages=[{"role": "user", "content": q}], max_tokens=12,
                temperature=0.9, seed=seed, logprobs=True, stream=True)
            async for ch in stream:
                if ch.choices and ch.choices[0].logprobs is not None:
                    content += ch.choices[0].logprobs.content
            return content

        async def all_four():
            return await asyncio.gather(*(one(q, i) for i, q in enumerate(questions)))

        results = asyncio.run(all_four())
        tok = server.tokenizer
        ids_of: dict[str, list[int]] = {}  # a token's text -> the ids that decode to it
        for i, text in enumerate(tok.batch_decode([[i] for i in range(len(tok))])):
            ids_of.setdefault(text, []).append(i)
        for q, content in zip(questions, results):
            assert len(content) == 12
            prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True)
            seq = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
            for e in content:  # rebuild the ids: of the candidates, the one HF gives this logprob
                ref = hf_logprobs(hf, seq)[-1]
                cands = [t for t in ids_of[e.token] if abs(ref[t] - e.logprob) < 2e-4]
                assert cands, (e.token, e.logprob, [ref[t] for t in ids_of[e.token]])
                seq.append(cands[0])
        assert server.scheduler.num_decode_calls > 0 and server.runner.speculative
    finally:
        thread.stop()
        server.shutdown()


@pytest.mark.parametrize("path, body, field", [
    ("completions", dict(prompt="hi", max_tokens=1, logprobs=21), "logprobs"),
    ("completions", dict(prompt="hi", max_tokens=1, echo="yes"), "echo"),
    ("completions", dict(prompt="hi", max_tokens=1, top_logprobs=2), "top_logprobs"),
    ("chat/completions", dict(logprobs=1), "logprobs"),  # a boolean there
    ("chat/completions", dict(top_logprobs=2), "top_logprobs"),  # needs logprobs: true
    ("chat/completions", dict(logprobs=True, top_logprobs=30), "top_logprobs"),
    ("chat/completions", dict(echo=True), "echo"),
])
def test_server_refuses_what_it_cannot_score(served, path, body, field):
    import httpx

    server, url = served
    if path.startswith("chat"):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    r = httpx.post(f"{url}/v1/{path}", json={"model": server.model_name, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_cli_line_asks_for_prompt_logprobs(tiny_dirs, tmp_path, capsys):
    import json

    from tests.test_cli import ENGINE as CLI_ENGINE, run

    path, hf = tiny_dirs["llama"]
    prompt = [5, 17, 33, 9, 120]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt_ids": prompt, "prompt_logprobs": 2, "logprobs": 1}) + "\n"
                                      + json.dumps({"prompt_ids": prompt}) + "\n")
    out = tmp_path / "o.jsonl"
    code, _, err = run(capsys, "--model", str(path), "--prompts", str(tmp_path / "p.jsonl"), "--output", str(out),
                       "--max-new-tokens", "2", "--spec", "ngram", *CLI_ENGINE)
    assert code == 0, err
    first, second = [json.loads(x) for x in out.read_text().splitlines()]
    ref = hf_logprobs(hf, prompt)
    assert first["prompt_logprobs"][0] is None and "prompt_logprobs" not in second and "logprobs" not in second
    for i in range(1, len(prompt)):
        lp, rank = first["prompt_logprobs"][i][str(prompt[i])]
        assert math.isclose(lp, ref[i - 1, prompt[i]], abs_tol=2e-4) and rank >= 1
    ref = hf_logprobs(hf, prompt + first["output_ids"])
    for j, t in enumerate(first["output_ids"]):
        lp, rank = first["logprobs"][j][str(t)]
        assert math.isclose(lp, ref[len(prompt) + j - 1, t], abs_tol=2e-4) and rank == 1  # greedy
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt_ids": prompt, "prompt_logprobs": 30}) + "\n")
    code, _, err = run(capsys, "--model", str(path), "--prompts", str(tmp_path / "bad.jsonl"), *CLI_ENGINE)
    assert code == 2 and "bad.jsonl:1: prompt_logprobs must be an integer in [0, 20], got 30" in err


@pytest.mark.parametrize("alg, shape", [
    ("eagle3", dict(num_draft_tokens=4, num_steps=3)),  # chain
    ("eagle3", dict(topk=2, num_steps=2, num_draft_tokens=5)),  # tree
    ("medusa", dict(topk=2, num_steps=2, num_draft_tokens=5)),
    ("dflash", dict(num_draft_tokens=4)),
    ("dspark", dict(num_draft_tokens=4, sps_table="flat")),
])
def test_logprobs_under_every_feature_drafter_equal_hf(tiny_dirs, tmp_path, alg, shape):
    """Whatever drafts them, the tokens' log-probabilities are the target's: batch 4, sampled."""
    from tests.heads_fixtures import write_block_head, write_eagle3_head, write_medusa_head

    path, hf = tiny_dirs["llama"]
    head = {"eagle3": lambda d: write_eagle3_head(d, hf, layer_ids=[0, 1, 1], convention="input"),
            "medusa": lambda d: write_medusa_head(d, hf, num_heads=3),
            "dflash": lambda d: write_block_head(d, hf, kind="dflash", layer_ids=(0, 1)),
            "dspark": lambda d: write_block_head(d, hf, kind="dspark", layer_ids=(0, 1))}[alg](tmp_path / alg)
    llm = LLM(str(path), spec={"algorithm": alg, "adaptive": "off", **shape}, draft_model=str(head), progress=False,
              **{**ENGINE, "max_batch_size": 4})
    prompts = [[5, 17, 33, 9, 120], [7, 7, 7, 7, 7, 7], [200, 3, 41], [11, 12, 13, 11, 12, 13, 11]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.8, seed=2, logprobs=1))
    assert all(o.outputs[0].accept_lengths for o in outs)  # the drafter ran: a speculative record
    for ids, out in zip(prompts, outs):
        gen = out.outputs[0].token_ids
        ref = hf_logprobs(hf, ids + gen)
        got = [out.outputs[0].logprobs[j][t].logprob for j, t in enumerate(gen)]
        np.testing.assert_allclose(got, [ref[len(ids) + j - 1, t] for j, t in enumerate(gen)], atol=2e-4)


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_processed_logprobs_are_the_sampled_distribution(tiny_dirs, spec):
    """engine.logprobs_mode = "processed": the distribution each request samples from (repetition
    penalty, temperature, then top-k, then top-p), from HF's logits in numpy; tokens it excludes
    read -9999; greedy is one-hot. Under n-gram speculation each accepted draft's entry comes from its
    own tree node, penalized under its own path."""
    path, hf = tiny_dirs["llama"]
    llm = LLM(str(path), spec=spec, progress=False, logprobs_mode="processed", **ENGINE)
    ids = [5, 17, 33, 9, 120, 5, 17, 33, 9]
    for sp in (SamplingParams(max_tokens=8, temperature=0.7, top_k=5, seed=3, logprobs=2),
               SamplingParams(max_tokens=8, temperature=1.3, top_p=0.6, seed=4, logprobs=2),
               SamplingParams(max_tokens=8, temperature=0.8, repetition_penalty=1.5, seed=6, logprobs=2),
               SamplingParams(max_tokens=8, logprobs=2)):
        out = llm.generate([ids], sp)[0].outputs[0]
        gen = out.token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids + gen])).logits[0].double().numpy()
        for j, t in enumerate(gen):
            row = logits[len(ids) + j - 1].copy()
            seen = list(set(ids + gen[:j]))  # vLLM's repetition penalty: prompt + output so far
            r = sp.repetition_penalty
            row[seen] = np.where(row[seen] > 0, row[seen] / r, row[seen] * r)
            if sp.temperature == 0:
                want = np.where(np.arange(row.size) == row.argmax(), 0.0, -9999.0)
            else:
                z = row / sp.temperature
                keep = np.ones(z.size, bool)
                if sp.top_k:
                    keep &= z >= np.sort(z)[-sp.top_k]
                p = np.exp(z - z.max()) * keep
                p /= p.sum()
                if sp.top_p < 1:
                    order = np.argsort(-p)
                    before = np.cumsum(p[order]) - p[order]  # mass of the likelier tokens
                    keep2 = np.zeros(z.size, bool)
                    keep2[order[before < sp.top_p]] = True
                    p = p * keep2
                    p /= p.sum()
                want = np.where(p > 0, np.log(np.maximum(p, 1e-300)), -9999.0)
            assert math.isclose(out.logprobs[j][t].logprob, want[t], abs_tol=3e-4), (sp, j, out.logprobs[j][t])
            for k, lp in out.logprobs[j].items():
                assert math.isclose(lp.logprob, want[k], abs_tol=3e-4)
