"""`jaxspec.LLM` and `SamplingParams`: the Python API against the CLI, plain greedy and HF.

Tiny random models (conftest). One LLM per configuration, shared by the
module, since each compiles its own buckets.
"""

from __future__ import annotations

import json

import pytest

import jaxspec
from jaxspec import SamplingParams
from jaxspec.generate import main as cli_main
from tests.reference import assert_greedy_equal, hf_greedy

OPTS = dict(max_context=128, length_buckets=(16, 32, 64, 128), max_batch_size=4, progress=False)
PROMPTS = [[5, 17, 33, 9], [200, 3, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
CHAT = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a river."}]


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    from jaxspec.models.loading import load_model

    path, hf = tiny_dirs["llama"]
    return path, hf, load_model(str(path), progress=False)


@pytest.fixture(scope="module")
def plain(tiny):
    return jaxspec.LLM(tiny[2], **OPTS)


@pytest.fixture(scope="module")
def ngram(tiny):
    return jaxspec.LLM(tiny[2], spec="ngram", num_draft_tokens=6, profile_phases=True, **OPTS)


@pytest.fixture(scope="module")
def chat_llm(chat_model_dir):
    return jaxspec.LLM(str(chat_model_dir), max_context=256, length_buckets=(64, 256), progress=False)


def test_import_jaxspec_loads_no_jax():
    import subprocess
    import sys

    code = "import sys, jaxspec; jaxspec.SamplingParams(); assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert {"LLM", "SamplingParams", "RequestOutput"} <= set(dir(jaxspec))


def test_greedy_equals_the_cli_and_hf(tiny, plain, tmp_path, capsys):
    path, hf, _ = tiny
    outs = plain.generate(PROMPTS, GREEDY)
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    code = cli_main(["--model", str(path), "--prompts", str(tmp_path / "p.jsonl"), "--output",
                     str(tmp_path / "o.jsonl"), "--max-new-tokens", "12", "--ignore-eos", "--quiet",
                     "--max-context", "128", "--set", "engine.length_buckets=16,32,64,128"])
    assert code == 0, capsys.readouterr().err
    lines = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [o.token_ids for o in outs] == [x["output_ids"] for x in lines]
    for p, o in zip(PROMPTS, outs):
        assert o.prompt == p and o.prompt_token_ids == p and o.finish_reason == "length"
        assert o.accept_lengths is None and o.tau is None and len(o.outputs) == 1
        assert_greedy_equal(hf, p, o.token_ids, hf_greedy(hf, p, 12))
    # One prompt on its own is a list of one output; numpy ids are token ids too.
    import numpy as np

    assert plain.generate(np.array(PROMPTS[0]), GREEDY)[0].token_ids == outs[0].token_ids


def test_prompts_of_one_call_share_their_prefix_and_equal_hf(tiny, plain):
    """Three prompts of one call behind a 70-token prefix no call has seen: the first prefills it,
    the other two adopt its 4 full pages (64 tokens) in a second prefill call; every output is
    Hugging Face's greedy continuation."""
    _, hf, _ = tiny
    shared = list(range(2, 72))
    prompts = [shared + tail for tail in ([90, 91], [92], [93, 94, 95])]
    outs = plain.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [0, 64, 64]
    for p, o in zip(prompts, outs):
        assert_greedy_equal(hf, p, o.token_ids, hf_greedy(hf, p, 12))


def test_ngram_greedy_equals_plain_and_keeps_the_speculative_record(plain, ngram):
    want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    ngram.reset_stats()
    outs = ngram.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == want
    for o in outs:
        assert sum(o.accept_lengths) >= 11  # every token after prefill's came from a verify step
        assert o.tau == pytest.approx(sum(o.accept_lengths) / len(o.accept_lengths))
        assert len(o.position_acceptance) == 5 and 0 <= o.acceptance_rate <= 1
    stats = ngram.spec_stats()
    assert stats["algorithm"] == "ngram" and stats["num_requests"] == 3 and stats["new_tokens"] == 36
    assert stats["num_verify_steps"] == sum(len(o.accept_lengths) for o in outs)
    assert stats["tau"] == pytest.approx(sum(sum(o.accept_lengths) for o in outs) / stats["num_verify_steps"])
    assert len(stats["position_acceptance"]) == 5
    split = stats["time_split"]  # profile_phases=True: every batch timed apart
    assert set(split["seconds"]) >= {"draft", "verify", "other"}
    assert sum(split["fraction"].values()) == pytest.approx(1.0)
    assert plain.spec_stats()["time_split"] is None and plain.spec_stats()["tau"] is None


def test_generate_from_two_threads_is_serialised_and_exact(tiny):
    """Issue 23: two threads on one speculative LLM crashed one call ('Buffer has been deleted or
    donated'). Calls are serialised: both return, each equal to its single-threaded answer."""
    import threading

    llm = jaxspec.LLM(tiny[2], spec="ngram", num_draft_tokens=4, **OPTS)
    want = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    got, errors = {}, []

    def work(k):
        try:
            got[k] = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        except Exception as e:  # noqa: BLE001 (the failure under test)
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(v == want for v in got.values()) and len(got) == 3


def test_seeded_sampling_reproduces_and_n_gives_n_outputs(plain):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True)
    first = plain.generate(PROMPTS[0], sp)[0]
    assert plain.generate([PROMPTS[1], PROMPTS[0]], sp)[1].token_ids == first.token_ids  # batch-independent
    assert first.outputs[0].seed == 7
    three = plain.generate([PROMPTS[0]], sp.replace(n=3))[0]
    assert [c.index for c in three.outputs] == [0, 1, 2] and [c.seed for c in three.outputs] == [7, 8, 9]
    assert three.outputs[0].token_ids == first.token_ids
    assert three.outputs[2].token_ids == plain.generate(PROMPTS[0], sp.replace(seed=9))[0].token_ids
    assert len({tuple(c.token_ids) for c in three.outputs}) > 1, "three seeds, one sample: seeds unused?"
    greedy = plain.generate(PROMPTS[:2], GREEDY.replace(n=2))
    assert [len(r.outputs) for r in greedy] == [2, 2]
    assert greedy[0].outputs[0].token_ids == greedy[0].outputs[1].token_ids
    per_prompt = plain.generate(PROMPTS[:2], [GREEDY, sp])  # one SamplingParams per prompt
    assert per_prompt[0].token_ids == greedy[0].token_ids and per_prompt[1].outputs[0].seed == 7


def test_chat_equals_the_template_applied_by_hand(chat_llm):
    tok = chat_llm.get_tokenizer()
    sp = SamplingParams(max_tokens=6)
    by_hand = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    by_hand = list(by_hand["input_ids"] if hasattr(by_hand, "keys") else by_hand)
    want = chat_llm.generate(by_hand, sp)[0]
    got = chat_llm.chat(CHAT, sp)[0]
    assert got.prompt_token_ids == by_hand and got.token_ids == want.token_ids
    assert got.text == tok.decode(want.token_ids, skip_special_tokens=True)
    two = chat_llm.chat([CHAT, CHAT[1:]], sp)
    assert len(two) == 2 and two[0].token_ids == want.token_ids
    assert chat_llm.generate({"messages": CHAT}, sp)[0].token_ids == want.token_ids
    # A raw string gets no template.
    assert chat_llm.generate("Name a river.", sp)[0].prompt_token_ids == tok.encode("Name a river.",
                                                                                   add_special_tokens=False)


def test_stop_strings_cut_the_text_and_the_tokens(chat_llm):
    full = chat_llm.generate("The river", SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert len(full.text) > 12, full.text
    stop = full.text[6:9]
    cut = chat_llm.generate("The river", SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop, "\x00never"]))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]
    assert full.token_ids[: len(cut.token_ids)] == cut.token_ids and len(cut.token_ids) < len(full.token_ids)


def test_compile_up_front_and_mesh(tiny, plain):
    buckets = plain.compile(PROMPTS, GREEDY)
    assert buckets == [(4, 16, 32)]
    assert plain.compile(buckets=[(1, 16, 16)]) == [(1, 16, 16)]
    meshed = jaxspec.LLM(tiny[2], mesh="1x1", **OPTS)  # the CLI's --mesh path, on one device
    assert meshed.engine.mesh is not None
    want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in meshed.generate(PROMPTS, GREEDY)] == want


# ---- bad arguments: ValueError naming the field --------------------------------------------------------


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="hot"), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2**31), "top_k"), (dict(top_k=2.5), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=True), "max_tokens"), (dict(seed=-1), "seed"),
    (dict(seed=2**32), "seed"), (dict(n=0), "n"), (dict(stop=[""]), "stop"), (dict(stop=[1]), "stop"),
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_bad_sampling_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"^{field} must ") as e:
        SamplingParams(**kw)
    assert e.value.field == field


def test_good_sampling_params_at_the_edges_are_kept():
    sp = SamplingParams(temperature=0, top_p=1, top_k=2**31 - 1, max_tokens=1, seed=2**32 - 1, n=16, stop="x",
                        ignore_eos=True)
    assert (sp.temperature, sp.top_p, sp.stop, sp.seed) == (0.0, 1.0, ("x",), 2**32 - 1)
    assert isinstance(sp.temperature, float) and sp.greedy and SamplingParams(max_tokens=3.0).max_tokens == 3
    with pytest.raises(ValueError, match="top_p"):
        sp.replace(top_p=0)  # replace validates too


def test_the_server_and_cli_share_the_rules():
    from jaxspec.generate import line_sampling
    from jaxspec.config import SamplingSection
    from jaxspec.serve.protocol import APIError, GenParams, parse_gen_params

    assert issubclass(GenParams, SamplingParams)
    with pytest.raises(APIError) as e:
        parse_gen_params({"top_p": 0}, 16)
    assert e.value.param == "top_p" and str(e.value) == "top_p must be a number in (0, 1], got 0"
    with pytest.raises(ValueError, match=r"^line 3: top_p must be a number in \(0, 1\], got 0$"):
        line_sampling({"top_p": 0, "_where": "line 3"}, SamplingSection(), 0)
    assert line_sampling({"seed": 5}, SamplingSection(seed=1), 4).seed == 5
    assert line_sampling({}, SamplingSection(seed=1), 4).seed == 5


@pytest.mark.parametrize("kw, message", [
    (dict(page_sise=16), "unknown option 'page_sise'; valid options: adaptive, adaptive_lengths, batch_buckets"),
    (dict(algorithm="ngram"), "option 'algorithm': pass it as LLM's spec= argument"),
    (dict(page_size=0), "engine.page_size must be >= 1"),
    (dict(num_draft_tokens="many"), "spec.num_draft_tokens: expected int"),
    (dict(dtype="float16"), "model.dtype must be float32 or bfloat16"),
    (dict(spec="bogus"), "unknown speculative algorithm"),
    (dict(spec="ngram", num_draft_tokens=1), "spec.num_draft_tokens must be >= 2"),
    (dict(spec="mlp_speculator"), "algorithm 'mlp_speculator' needs a draft model"),
    (dict(spec=3), "spec must be None, an algorithm name"),
    (dict(mesh="3x"), "expected DATAxMODEL"),
    (dict(model="/nonexistent/model"), "no such model file or directory"),
])
def test_bad_llm_arguments_raise_before_loading(kw, message):
    # model="/nonexistent" would fail at loading: every other case must fail before it.
    kw = {"model": "/nonexistent/model", **kw}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        jaxspec.LLM(progress=False, **kw)


def test_bad_prompts_and_calls_name_what_is_wrong(plain):
    cases = [
        (lambda: plain.generate([PROMPTS[0], ""], GREEDY), r"prompts\[1\]: 'prompt' must be a non-empty string"),
        (lambda: plain.generate([PROMPTS[0], [1, 10**6]], GREEDY), r"prompts\[1\]: prompt token id 1000000 is outside"),
        (lambda: plain.generate([[1] * 120], GREEDY), r"prompts\[0\]: .*exceeds the context"),
        (lambda: plain.generate([]), "the list is empty"),
        (lambda: plain.generate(PROMPTS, [GREEDY]), "sampling has 1 entries for 3 prompts"),
        (lambda: plain.generate(PROMPTS, {"temperature": 1}), "sampling must be a SamplingParams"),
        (lambda: plain.generate(PROMPTS[0], GREEDY.replace(stop="x")), "stop strings need a tokenizer"),
        (lambda: plain.generate({"text": "hi"}), "expected one of 'messages', 'prompt' or 'prompt_ids'"),
        (lambda: plain.chat("hi"), "messages must be a conversation"),
        (lambda: plain.compile(), "compile needs prompts"),
        (lambda: plain.compile(buckets=[(3, 16, 16)]), r"buckets\[0\] must be"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    assert plain.generate(PROMPTS[0], GREEDY)[0].finish_reason == "length"  # still serving


def test_the_persistent_compilation_cache_is_on_by_default(tmp_path):
    """Issue 23 (start-up time): the CLI and the API share LLM._setup, which turns JAX's
    persistent compilation cache on under the cache root; "off" and a directory set already win.
    In a subprocess: jax.config is process-wide."""
    import os
    import subprocess
    import sys

    code = ("import sys, jax; from jaxspec.paths import enable_compilation_cache as e; "
            "e(sys.argv[1], sys.argv[2]); print(jax.config.jax_compilation_cache_dir)")
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}

    def run(where, extra=None):
        out = subprocess.run([sys.executable, "-c", code, where, str(tmp_path)], env={**env, **(extra or {})},
                             capture_output=True, text=True, check=True)
        return out.stdout.strip()

    assert run("") == str(tmp_path / "xla")
    assert run("off") == "None"
    assert run("", {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "mine")}) == str(tmp_path / "mine")
