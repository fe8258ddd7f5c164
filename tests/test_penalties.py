"""Penalties, logit bias, min_tokens and stop_token_ids (issue 26, part 2), exact under speculation.

1. The processors against numpy: vLLM's definitions over random logits and histories, and each
   tree node's draft-path counts against a brute-force walk of its ancestors.
2. Greedy, end to end: Hugging Face `generate(repetition_penalty=...)`, and a numpy greedy loop
   over HF logits for presence / frequency / logit_bias / min_tokens (HF has none of them), for
   plain decoding and every kind of drafter, at batch 4 with unpenalized rows in the same batch.
3. Sampled, end to end: the joint of the first 3 tokens of the whole loop with penalties on,
   chi-square tested against the exact joint computed in numpy, for the n-gram drafter and
   EAGLE-3 (a feature drafter). Positive control: the same loop with the verify step's
   penalties blind to the draft path (each node penalized as if it followed the committed
   history alone: the bug of vLLM #18902's kind) must fail.
"""

from __future__ import annotations

from collections import Counter

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxspec import LLM, SamplingParams
from jaxspec.engine import Request
from jaxspec.engine.device_sampling import DeviceSampling
from jaxspec.engine.types import RowInput
from jaxspec.speculative import penalties
from tests.reference import assert_greedy_equal
from tests.test_loop_distribution import tiny  # noqa: F401  (the module-scoped V = 8 target fixture)

ENGINE = dict(max_batch_size=4, max_context=128, length_buckets=(32, 64, 128), page_size=8)


def np_process(logits: np.ndarray, prompt, out, sp: SamplingParams, stops=()) -> np.ndarray:
    """vLLM's processors in float64: bias, min_tokens, repetition (prompt + output), frequency and
    presence (output)."""
    z = logits.astype(np.float64).copy()
    for t, b in sp.logit_bias:
        z[t] += b
    if len(out) < sp.min_tokens:
        z[list(stops)] = -np.inf
    for t in set(prompt) | set(out):
        z[t] = z[t] / sp.repetition_penalty if z[t] > 0 else z[t] * sp.repetition_penalty
    for t, c in Counter(out).items():
        z[t] -= sp.frequency_penalty * c + sp.presence_penalty
    return z


# ---- 1. the processors against numpy ---------------------------------------------------------------


def _row(params: SamplingParams, stops=()) -> RowInput:
    return RowInput(tokens=[0], prompt_len=1, page_row=np.zeros(1, np.int32), slot=0, params=params, stop_ids=stops)


def test_processors_equal_numpy_per_node():
    """Random logits at every node of random trees, random histories: each node processed under
    history + its own draft path equals numpy's processing of that exact prefix."""
    rng = np.random.default_rng(0)
    b, n, v, c = 3, 6, 40, 24
    params = [SamplingParams(presence_penalty=0.8, frequency_penalty=-0.3, repetition_penalty=1.7,
                             logit_bias={3: 5.0, 7: -20.0}, min_tokens=9, max_tokens=50),
              SamplingParams(),  # unpenalized row in the same batch: untouched
              SamplingParams(repetition_penalty=0.6, frequency_penalty=2.0, min_tokens=2)]
    stops = [(1, 2), (1,), (5,)]
    sp = DeviceSampling.pack([_row(p, s) for p, s in zip(params, stops)], b)
    history = rng.integers(0, v, size=(b, c)).astype(np.int32)
    prompt_lens, hist_len = np.array([5, 3, 8]), np.array([12, 3, 10])
    tokens = rng.integers(-1, v, size=(b, n)).astype(np.int32)
    tokens[:, 0] = history[np.arange(b), hist_len - 1]  # the root
    parents = np.array([[-1, 0, 1, 1, 2, 0], [-1, 0, 0, 1, 3, 4], [-1, 0, 1, 2, 3, 4]])
    tokens[tokens < 0] = 0  # no padding here: every node has a real path
    mask = np.zeros((b, n, n), bool)
    depth = np.zeros((b, n), np.int32)
    for r in range(b):
        for i in range(n):
            j = i
            while j >= 0:
                mask[r, i, j] = True
                j = parents[r, j]
            depth[r, i] = mask[r, i].sum() - 1
    logits = rng.normal(0, 3, size=(b, n, v)).astype(np.float32)
    tree = type("T", (), dict(mask=jnp.asarray(mask), depth=jnp.asarray(depth)))
    got = np.asarray(penalties.penalize_tree(jnp.asarray(logits), sp, jnp.asarray(history), jnp.asarray(hist_len),
                                             jnp.asarray(prompt_lens), jnp.asarray(tokens), tree))
    for r in range(b):
        for i in range(n):
            path = [int(tokens[r, j]) for j in range(n) if mask[r, i, j] and depth[r, j] >= 1]
            prefix = history[r, :hist_len[r]].tolist() + path
            want = np_process(logits[r, i], prefix[:prompt_lens[r]], prefix[prompt_lens[r]:], params[r], stops[r])
            np.testing.assert_allclose(got[r, i], want.astype(np.float32), rtol=1e-6, atol=1e-5,
                                       err_msg=f"row {r} node {i}")
    assert np.array_equal(got[1], logits[1])


def test_draft_logits_are_processed_under_their_prefix():
    """A chain drafter's next draft (after `prev`) on a reduced vocabulary: its logits processed as
    the target's are at that position, read through d2t."""
    from types import SimpleNamespace

    rng = np.random.default_rng(2)
    b, v, vd, c = 2, 30, 12, 16
    params = [SamplingParams(presence_penalty=1.1, frequency_penalty=0.4, repetition_penalty=1.5,
                             logit_bias={int(t): 3.0 for t in (4, 9)}, min_tokens=6, max_tokens=20),
              SamplingParams(frequency_penalty=1.0)]
    sp = DeviceSampling.pack([_row(p, (1,)) for p in params], b)
    history = rng.integers(0, v, size=(b, c)).astype(np.int32)
    prompt_lens, hist_len = np.array([4, 6]), np.array([9, 7])
    d2t = np.sort(rng.choice(v, vd, replace=False)).astype(np.int32)
    prev = [rng.integers(0, v, size=b).astype(np.int32) for _ in range(2)]
    logits = rng.normal(0, 3, size=(b, vd)).astype(np.float32)
    s = SimpleNamespace(sampling=sp, history=jnp.asarray(history), hist_len=jnp.asarray(hist_len),
                        prompt_lens=jnp.asarray(prompt_lens))
    got = np.asarray(penalties.penalize_draft(jnp.asarray(logits), s, [jnp.asarray(t) for t in prev],
                                              jnp.asarray(d2t), v))
    for r in range(b):
        prefix = history[r, :hist_len[r]].tolist() + [int(t[r]) for t in prev]
        full = np.full(v, -1e9)
        full[d2t] = logits[r]
        want = np_process(full, prefix[:prompt_lens[r]], prefix[prompt_lens[r]:], params[r], (1,))[d2t]
        np.testing.assert_allclose(got[r], want.astype(np.float32), rtol=1e-6, atol=1e-5)


def test_nothing_runs_without_penalties():
    """A batch that asks for nothing gets its logits back as they were (the cond's identity branch)."""
    sp = DeviceSampling.pack([_row(SamplingParams())] * 2, 2)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 1, 16)), jnp.bfloat16)
    out = penalties.penalize(x, sp, jnp.zeros((2, 4), jnp.int32), jnp.array([3, 4]), jnp.array([1, 1]))
    assert out.dtype == jnp.bfloat16 and bool(jnp.all(out == x))
    assert not bool(penalties.active(sp))
    assert bool(penalties.active(DeviceSampling.pack([_row(SamplingParams(logit_bias={3: 0.5}))], 1)))


# ---- 2. greedy, end to end -------------------------------------------------------------------------


def hf_greedy_processed(hf, prompt, sp: SamplingParams, stops, n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].double().numpy()
        out.append(int(np.argmax(np_process(logits, prompt, out, sp, stops))))
        if out[-1] in stops and len(out) > 0:
            break
    return out


PROMPTS = [[7, 7, 7, 7, 7, 7, 7], [11, 12, 13, 11, 12, 13, 11, 12], [5, 17, 33, 9, 120], [200, 3, 41, 3, 41]]
PENALIZED = [
    SamplingParams(max_tokens=16, presence_penalty=1.5, frequency_penalty=0.5),
    SamplingParams(max_tokens=16, repetition_penalty=1.8, logit_bias={"13": 4.0, 12: -100}),
    SamplingParams(max_tokens=16),  # unpenalized beside the others
    SamplingParams(max_tokens=16, min_tokens=12, frequency_penalty=-0.5, stop_token_ids=[41, 3]),
]
SPECS = {
    None: None,
    "ngram": {"algorithm": "ngram", "num_draft_tokens": 4},
    "eagle3-chain": {"algorithm": "eagle3", "num_draft_tokens": 4, "num_steps": 3},
    "eagle3-tree": {"algorithm": "eagle3", "topk": 2, "num_steps": 2, "num_draft_tokens": 5},
    "medusa-tree": {"algorithm": "medusa", "topk": 2, "num_steps": 2, "num_draft_tokens": 5},
    "dflash": {"algorithm": "dflash", "num_draft_tokens": 4},
    "dspark": {"algorithm": "dspark", "num_draft_tokens": 4, "sps_table": "flat"},
}


def _llm(tiny_dirs, tmp_path, name):
    from tests.heads_fixtures import write_block_head, write_eagle3_head, write_medusa_head

    path, hf = tiny_dirs["llama"]
    spec = SPECS[name]
    if spec is None or name == "ngram":
        # adaptive off: on a loaded machine the timing policy may pick plain decoding, and the test
        # checks the drafter ran.
        return LLM(str(path), spec=spec and {**spec, "adaptive": "off"}, progress=False, **ENGINE), hf
    alg = spec["algorithm"]
    head = {"eagle3": lambda d: write_eagle3_head(d, hf, layer_ids=[0, 1, 1], convention="input"),
            "medusa": lambda d: write_medusa_head(d, hf, num_heads=3),
            "dflash": lambda d: write_block_head(d, hf, kind="dflash", layer_ids=(0, 1)),
            "dspark": lambda d: write_block_head(d, hf, kind="dspark", layer_ids=(0, 1))}[alg](tmp_path / alg)
    return LLM(str(path), spec={**spec, "adaptive": "off"}, draft_model=str(head), progress=False, **ENGINE), hf


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_penalties_equal_the_reference(tiny_dirs, tmp_path, name):
    """Batch 4, one request per processor mix (one unpenalized): the tokens of the numpy greedy loop
    over HF logits, whatever drafts them; and repetition_penalty alone equals HF generate."""
    llm, hf = _llm(tiny_dirs, tmp_path, name)
    eos = llm.eos_token_ids
    outs = llm.generate(PROMPTS, PENALIZED)
    for ids, sp, out in zip(PROMPTS, PENALIZED, outs):
        got = out.outputs[0].token_ids
        stops = sp.stop_ids(eos)
        want = hf_greedy_processed(hf, ids, sp, stops, sp.max_tokens)
        assert got[:len(want)] == want[:len(got)], (name, sp, got, want)
        assert len(got) == len(want), (name, got, want)
        if sp.min_tokens:
            assert not set(got[:sp.min_tokens - 1]) & set(stops)
        if name is not None:
            assert out.outputs[0].accept_lengths  # the drafter ran
    # All four prompts again: batch 4 runs the programs compiled above (two would compile batch 2).
    rep = SamplingParams(max_tokens=20, repetition_penalty=1.3, ignore_eos=True)
    got = llm.generate(PROMPTS, rep)
    for ids, out in zip(PROMPTS, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                              repetition_penalty=1.3, pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
        assert_greedy_equal(hf, ids, out.outputs[0].token_ids, ref)


def test_penalties_change_the_output(tiny_dirs):
    """Positive control for the greedy test: the processors do something here (a penalty the engine
    dropped would make the reference differ from what it produced)."""
    path, hf = tiny_dirs["llama"]
    plain = [hf_greedy_processed(hf, ids, SamplingParams(max_tokens=16), (), 16) for ids in PROMPTS]
    penal = [hf_greedy_processed(hf, ids, sp, (), 16) for ids, sp in zip(PROMPTS, PENALIZED)]
    assert sum(a != b for a, b in zip(plain, penal)) >= 3


# ---- 3. sampled, end to end: chi-square of the first three tokens -----------------------------------

SAMPLED = SamplingParams(max_tokens=3, temperature=1.0, presence_penalty=0.6, frequency_penalty=0.9,
                         repetition_penalty=1.6, logit_bias={4: 1.2}, min_tokens=2)
V8_STOPS = (1,)  # the V = 8 target's EOS: banned for the first two tokens (min_tokens)


def exact_penalized_joint(hf, sp: SamplingParams) -> np.ndarray:
    from tests.test_loop_distribution import PROMPT, VOCAB, _filtered

    def last(seqs):
        with torch.no_grad():
            return hf(torch.tensor(seqs)).logits[:, -1].double().numpy()

    def p(logits, out):
        return _filtered(np_process(logits, PROMPT, out, sp, V8_STOPS), sp.temperature, sp.top_p)

    p1 = p(last([PROMPT])[0], [])
    l2 = last([PROMPT + [a] for a in range(VOCAB)])
    l3 = last([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    joint = np.zeros((VOCAB,) * 3)
    for a in range(VOCAB):
        p2 = p(l2[a], [a])
        for b in range(VOCAB):
            joint[a, b] = p1[a] * p2[b] * p(l3[a * VOCAB + b], [a, b])
    return joint


def sampled_first_three(engine, seeds=range(20_000)):
    from tests.test_loop_distribution import PROMPT

    out = engine.generate([Request(list(PROMPT), SAMPLED, seed=s, stop_token_ids=V8_STOPS) for s in seeds])
    toks = np.array([r.output_ids for r in out])
    return toks, np.concatenate([r.accept_lengths for r in out])


@pytest.fixture(scope="module")
def v8(tiny, tmp_path_factory):  # noqa: F811
    """(target, HF model, {name: SpecSection}) on the V = 8 target."""
    from jaxspec.config import SpecSection
    from tests.heads_fixtures import feature_heads_v8
    from tests.test_feature_distribution import spec_of

    model, hf = tiny
    heads = feature_heads_v8(tmp_path_factory.mktemp("v8_heads"), hf)
    return model, hf, {"ngram": SpecSection(algorithm="ngram", num_draft_tokens=4, verify="rejection"),
                       "eagle3-chain": spec_of(heads, "eagle3-chain")}


def v8_engine(v8, name):
    from tests.test_feature_distribution import build_engine
    from tests.test_loop_distribution import engine_for

    model, _, specs = v8
    if name == "ngram":
        return engine_for(model, specs[name])
    return build_engine(model, specs[name])


@pytest.mark.parametrize("name", ["ngram", "eagle3-chain"])
def test_sampled_penalties_keep_the_target_distribution(v8, name):
    from tests.test_loop_distribution import chi_square_p, joint_counts

    hf = v8[1]
    toks, accepts = sampled_first_three(v8_engine(v8, name))
    assert np.sum(accepts > 1) > 300, f"{name}: only {np.sum(accepts > 1)} steps accepted a draft"
    assert not np.isin(toks[:, :2], V8_STOPS).any()  # min_tokens
    p = chi_square_p(joint_counts(toks), exact_penalized_joint(hf, SAMPLED))
    assert p > 1e-4, f"{name}: joint of the first 3 tokens under penalties, chi-square p={p:.2e}"


def test_chi_square_detects_path_blind_penalties(v8, monkeypatch):
    """Positive control: verify nodes penalized as if each followed the committed history only
    (a fresh engine, so its programs are traced with the broken processor)."""
    from jaxspec.speculative import loop
    from tests.test_loop_distribution import chi_square_p, joint_counts

    hf = v8[1]
    monkeypatch.setattr(loop, "penalize_tree", lambda x, sp, h, n, p, tokens, tree: penalties.penalize(x, sp, h, n, p))
    toks, _ = sampled_first_three(v8_engine(v8, "eagle3-chain"))
    p = chi_square_p(joint_counts(toks), exact_penalized_joint(hf, SAMPLED))
    assert p < 1e-6, f"path-blind penalties went unnoticed: p={p:.2e}"


def test_processed_logprobs_include_the_penalties(tiny_dirs):
    """engine.logprobs_mode = "processed": each generated token's log-probability under the distribution
    it was sampled from, the penalties of its own prefix included (numpy over HF logits)."""
    from tests.test_loop_distribution import _filtered

    path, hf = tiny_dirs["llama"]
    llm = LLM(str(path), progress=False, logprobs_mode="processed", spec="ngram", **ENGINE)
    ids = PROMPTS[1]
    sp = SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=2, presence_penalty=0.7,
                        frequency_penalty=0.3, repetition_penalty=1.4, logit_bias={12: 2.0}, min_tokens=5)
    out = llm.generate([ids], sp)[0].outputs[0]
    gen = out.token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([ids + gen])).logits[0].double().numpy()
    for j, t in enumerate(gen):
        p = _filtered(np_process(logits[len(ids) + j - 1], ids, gen[:j], sp, llm.eos_token_ids), sp.temperature, 1.0)
        assert abs(out.logprobs[j][t].logprob - np.log(p[t])) < 3e-4, (j, out.logprobs[j][t], np.log(p[t]))


def test_server_applies_the_penalties(served, chat_model_dir):
    """Through the server with the `openai` client (speculation on, as served): a completion with every
    processor, streamed and not, equals the numpy greedy loop over HF logits; the fields are vLLM's /
    OpenAI's names, logit_bias keyed by strings as JSON has it."""
    import transformers as tf

    from tests.serve_util import client

    server, url = served
    hf = tf.AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32).eval()
    ids = [504, 2821, 314, 504, 2821, 314, 504, 2821]
    sp = SamplingParams(max_tokens=10, presence_penalty=1.2, frequency_penalty=0.6, repetition_penalty=1.3,
                        logit_bias={314: 8.0, 2821: -3.0}, min_tokens=4, stop_token_ids=[11])
    want = hf_greedy_processed(hf, ids, sp, sp.stop_ids(server.stop_ids), sp.max_tokens)
    # The fields matter here: the bias makes 314 the first token, and the penalties take it away after.
    assert want[0] == 314 and 314 not in want[1:3], want
    body = dict(model=server.model_name, prompt=ids, max_tokens=10, temperature=0, seed=1,
                presence_penalty=1.2, frequency_penalty=0.6, logit_bias={"314": 8.0, "2821": -3.0},
                extra_body=dict(repetition_penalty=1.3, min_tokens=4, stop_token_ids=[11]))
    c = client(url)
    text = c.completions.create(**body).choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(**body, stream=True) if ch.choices)
    assert text == streamed == server.tokenizer.decode(want), (text, streamed, want)


def test_min_tokens_defers_stop_strings(served, chat_model_dir):
    """vLLM's rule: no stop string is looked for before the min_tokens-th token. The API and the server
    (streamed and not) cut at the first occurrence starting at or after that token's text; positive
    control: without min_tokens the same stop string cuts earlier."""
    from tests.serve_util import client

    server, url = served
    llm = LLM(str(chat_model_dir), progress=False, **ENGINE)
    ids = [504, 2821, 314, 504, 2821, 314]
    free = llm.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0].outputs[0]
    tok = llm.tokenizer
    pieces = [tok.decode(free.token_ids[:k]) for k in range(len(free.token_ids) + 1)]
    stop = pieces[2][len(pieces[1]):].strip() or pieces[2]  # the second token's text
    assert stop and stop in free.text
    for min_tokens in (0, 6):
        start = len(pieces[max(min_tokens - 1, 0)])  # where the armed text begins
        hit = free.text.find(stop, start)
        want = free.text[:hit] if hit >= 0 else free.text
        sp = SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop], min_tokens=min_tokens)
        assert llm.generate([ids], sp)[0].outputs[0].text == want, (min_tokens, stop)
        body = dict(model=server.model_name, prompt=ids, max_tokens=16, temperature=0, stop=[stop],
                    extra_body=dict(min_tokens=min_tokens, ignore_eos=True))
        c = client(url)
        assert c.completions.create(**body).choices[0].text == want
        assert "".join(ch.choices[0].text for ch in c.completions.create(**body, stream=True) if ch.choices) == want
        if min_tokens == 0:
            early = want
    assert len(early) < len(want)  # the control: min_tokens moved the cut
