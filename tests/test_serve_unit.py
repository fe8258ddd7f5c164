"""Server pieces without a server: incremental detokenization, stop strings, the adaptive policy, request parsing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxspec.engine.adaptive import AdaptiveSteps
from jaxspec.detok import IncrementalDetokenizer, StopStringMatcher
from jaxspec.serve.protocol import APIError, parse_completion, parse_gen_params, parse_json_body


@pytest.fixture(scope="module")
def tokenizer():
    from jaxspec.models.loading import cached_gguf_dir, default_gguf_path, load_tokenizer

    return load_tokenizer(cached_gguf_dir(default_gguf_path(), progress=False))


TEXTS = ["Hello, world! Ünïcödé façade.", "数学是科学的皇后。🙂👍🏽 ok", "émoji 🇫🇷🇯🇵 and    spaces\n\nnew", "a" * 40]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_incremental_detokenizer_equals_full_decode(tokenizer, text, step):
    """Streaming in chunks of `step` tokens never emits half a character and adds up to the full text."""
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    parts = []
    for i in range(0, len(ids), step):
        parts.append(detok.add(ids[i: i + step], final=i + step >= len(ids)))
    assert all("\ufffd" not in p for p in parts)
    assert "".join(parts) == tokenizer.decode(ids, skip_special_tokens=True)


def test_incremental_detokenizer_skips_special_tokens(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [])
    ids = tokenizer.encode("fine", add_special_tokens=False)
    out = detok.add(ids) + detok.add([tokenizer.eos_token_id], final=True)
    assert out == "fine"


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abcXY", max_size=30), st.lists(st.text(alphabet="abcXY", min_size=1, max_size=4),
                                                        min_size=1, max_size=3), st.data())
def test_stop_strings_across_arbitrary_splits(text, stops, data):
    """Whatever the split into deltas, the sent text is cut at the stop string completing first (reference: str.find on the whole text)."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    m = StopStringMatcher(stops)
    sent, stopped = "", False
    for p in pieces:
        out, stopped = m.feed(p)
        sent += out
        if stopped:
            break
    if not stopped:
        sent += m.flush()
    hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    assert stopped == bool(hits)
    assert sent == (text[: min(hits)[1]] if hits else text)


def test_adaptive_turns_speculation_off_when_it_loses_and_on_when_it_wins():
    # Cost grows with k at a large batch: verify is no longer free.
    cost = {(k, 1): 1.0 + 0.02 * k for k in (0, 1, 3, 5)} | {(k, 32): 1.0 + 0.5 * k for k in (0, 1, 3, 5)}
    a = AdaptiveSteps((0, 1, 3, 5), cost, hysteresis=0.1)
    for _ in range(5):
        a.observe(3, 1, [4, 4, 4, 3, 4, 4], 1.06)  # nearly every draft accepted
    assert a.choose(1) == 5  # cheap verify, high acceptance: draft deep
    assert a.choose(32) in (1, 3) and a.expected_tokens(5) > 4
    b = AdaptiveSteps((0, 1, 3, 5), cost)
    for _ in range(5):
        b.observe(3, 1, [1] * 8, 1.06)  # nothing accepted
    assert b.choose(1) == 0 and b.choose(32) == 0


def test_adaptive_acceptance_weighs_each_call_by_what_it_saw():
    """At C = 8 a batch-1 call of a repetitive prompt (4 verify steps, every draft accepted) lifted the
    rate an EMA per call kept to 0.4 after a batch-8 call (32 steps, none accepted), E(3) past plain,
    and the bucket switched to a losing chain of 3. Counted by reached positions, it is 4 / 36; many
    such calls still move it (the estimate is not stuck), and old counts fade with a half-life."""
    a = AdaptiveSteps((0, 3), {})
    a.observe(3, (8, 512), [1] * 32, None)
    a.observe(3, (1, 512), [4] * 4, None)
    assert a.rates[0] == pytest.approx(4 / 36, rel=0.02) and a.expected_tokens(3) < 1.4  # the EMA: 2.2
    for _ in range(40):
        a.observe(3, (1, 512), [4] * 4, None)
    assert a.rates[0] > 0.8 and a.expected_tokens(3) > 3
    fast = AdaptiveSteps((0, 3), {}, rate_half_life=1)  # a short memory forgets most of the first call
    fast.observe(3, (8, 512), [1] * 32, None)
    fast.observe(3, (1, 512), [4] * 4, None)
    assert fast.rates[0] > 0.6


def test_adaptive_hysteresis_and_probing():
    cost = {(k, 4): 1.0 for k in (0, 2)}
    a = AdaptiveSteps((0, 2), cost, hysteresis=0.5, probe_every=4, max_probe_every=16)
    a.observe(0, 4, [], 1.0)  # both costs live: nothing left to explore
    a.observe(2, 4, [1, 1, 1, 1], 1.0)  # rate 0: k = 0 wins
    assert a.choose(4) == 0
    a.observe(2, 4, [2, 2, 1, 1], 1.0)  # rate recovers a little: +25% score, under the 50% hysteresis
    assert a.current[4] == 0 and a.choose(4) == 0
    picks = [a.choose(4) for _ in range(60)]  # calls 3..62
    # The first probe comes on the 4th call; while the choice holds, the gap doubles up to 16.
    assert [n for n, k in enumerate(picks, start=3) if k == 2] == [4, 12, 28, 44, 60]
    for _ in range(10):
        a.observe(2, 4, [3, 3, 3, 3], 1.0)
    # A switch resets the gap: k = 0 is probed on the 4th call again.
    assert [a.choose(4) for _ in range(8)] == [2, 2, 2, 0, 2, 2, 2, 2]


def test_adaptive_margin_gives_ties_to_plain_decoding():
    """serve.adaptive_margin: a chain of 1 that ties plain decoding per iteration loses the batch's
    tail (rows end at different iterations), so with a 5% margin a tie goes to plain at once, and a
    switch back takes (1 + hysteresis)(1 + margin) = 1.155x plain's score. Control: margin 0 holds
    the chain through the tie (it is inside the 10% hysteresis). E(1) = 1.5 (the prior rate); the
    chain's cost sets its score against plain's 1.0."""
    b = (8, 512)

    def run(margin):
        a = AdaptiveSteps((0, 1), {(0, b): 1.0}, hysteresis=0.1, margin=margin, explore=False,
                          probe_every=10**6)
        picks = []
        for ratio in (1.19, 1.0, 1.12, 1.0, 1.16):  # chain of 1's score / plain's, call by call
            a.cost[(1, b)] = 1.5 / ratio
            picks.append(a.choose(b))
        return picks

    assert run(0.05) == [1, 0, 0, 0, 1]
    assert run(0.0) == [1, 1, 1, 1, 1]
    # A chain that falls behind is judged as if plain were current: a longer chain well ahead of
    # plain takes over in the same call (E(3) = 1.875; its score 1.5x plain's).
    a = AdaptiveSteps((0, 1, 3), {(0, b): 1.0, (1, b): 1.5 / 1.19, (3, b): 100.0}, hysteresis=0.1, margin=0.05,
                      explore=False, probe_every=10**6)
    assert a.choose(b) == 1
    a.cost[(1, b)], a.cost[(3, b)] = 1.5, 1.875 / 1.5
    assert a.choose(b) == 3
    with pytest.raises(ValueError, match="margin"):
        AdaptiveSteps((0, 1), {}, margin=-0.1)
    # Without plain decoding among the candidates there is nothing to fall back to: no margin.
    assert AdaptiveSteps((1, 3), {}, margin=0.05).margin == 0.0


def test_adaptive_explores_each_candidate_once_before_probing():
    """A start-up calibration that overprices plain decoding (1.3 s against 1.0 live) sends batch 32 to
    k = 1, which live runs at 0.89x plain: exploration measures k = 0 and k = 3 live on the bucket's
    2nd and 3rd calls, and from the 4th call on it decodes plainly."""
    cal = {(0, 32): 1.3, (1, 32): 1.05, (3, 32): 1.5}
    a = AdaptiveSteps((0, 1, 3), cal, hysteresis=0.1, probe_every=16)
    a.observe(1, 1, [2, 2, 1, 1], None)  # r1 = 0.5 from batch 1: E(1) / 1.05 = 1.43 beats plain's 1.0
    live = {0: 1.0, 1: 1.4, 3: 1.9}  # seconds per iteration when run
    ran = []
    for _ in range(12):
        k = a.choose(32)
        ran.append(k)
        a.observe(k, 32, [2, 1, 1, 1] * 8 if k else [1] * 32, live[k])  # r1 = 0.25 at batch 32
    assert ran[:4] == [1, 0, 3, 0] and set(ran[3:]) == {0}
    # Without exploration the calibrated plain cost stands until the first probe (call 16).
    b = AdaptiveSteps((0, 1, 3), cal, hysteresis=0.1, probe_every=16, explore=False)
    b.observe(1, 1, [2, 2, 1, 1], None)
    ran = []
    for _ in range(12):
        k = b.choose(32)
        ran.append(k)
        b.observe(k, 32, [2, 1, 1, 1] * 8 if k else [1] * 32, live[k])
    assert ran == [1] * 12


@pytest.mark.parametrize("plausible", [0.75, 0.0], ids=["default", "control: every candidate worth a call"])
def test_adaptive_does_not_explore_or_probe_a_hopeless_deeper_draft(plausible):
    """The server's batch-32 bucket at C = 32 (2026-12-04 log): dummy-row calibration 55.7 / 73.1 /
    106.6 ms for k = 0 / 1 / 3, live 120.7 / 190.9 / 381.5 ms, n-gram acceptance 7%. Plain decoding's
    live cost scales the others' calibrations by 2.2x: the chain of 1 is still within reach and
    explored once, the chain of 3 is not, and nothing is probed after."""
    b = (32, 512)
    a = AdaptiveSteps((0, 1, 3), {(0, b): 0.0557, (1, b): 0.0731, (3, b): 0.1066}, plausible=plausible)
    a.observe(3, (1, 512), [2] * 7 + [1] * 93, None)  # r1 = 0.07, r2 = 0
    live = {0: 0.1207, 1: 0.1909, 3: 0.3815}
    ran = []
    for _ in range(80):
        k = a.choose(b)
        ran.append(k)
        a.observe(k, b, [1] * 128, live[k])
    if plausible:
        assert ran == [0, 1] + [0] * 78
        assert a.estimated_cost(3, b) == pytest.approx(0.1066 * (0.1207 / 0.0557 + 0.1909 / 0.0731) / 2)
    else:  # positive control: the chain of 3 is explored (call 3) and probed
        assert ran[:3] == [0, 1, 3] and ran.count(3) > 1 and a.current[b] == 0


@pytest.mark.parametrize("smaller", [True, False], ids=["batch 16 live first", "control: no smaller batch live"])
def test_adaptive_prices_a_larger_batch_by_a_smaller_ones_live_ratio(smaller):
    """Batch 16 has run live: a chain of 3 costs 2.2 plain calls there, so at batch 32 (same context)
    it costs at least 2.2 of batch 32's plain calls, whatever the dummy-row calibration says (1.8),
    and it is not explored; the chain of 1 (1.4x at batch 16) still is."""
    b, s = (32, 512), (16, 512)
    a = AdaptiveSteps((0, 1, 3), {(0, b): 0.059, (1, b): 0.080, (3, b): 0.104})
    a.observe(3, (1, 512), [1] * 7 + [2] * 2 + [3], None)  # r1 = 0.3, r2 = 1/3: E(3) = 1.4
    if smaller:
        for k, sec in ((0, 0.036), (1, 0.050), (3, 0.080)):
            a.observe(k, s, [], sec)
    live = {0: 0.12, 1: 0.16, 3: 0.38}
    ran = []
    for _ in range(40):
        k = a.choose(b)
        ran.append(k)
        a.observe(k, b, [], live[k])
    if smaller:
        assert ran[:3] == [0, 1, 0] and 3 not in ran
        assert a.estimated_cost(3, b) == pytest.approx(0.12 * 0.080 / 0.036)
    else:
        assert ran[:3] == [0, 1, 3]


@pytest.mark.parametrize("chain1", [0.24, 0.16], ids=["chain of 1 live at 2x", "control: chain of 1 at 1.3x"])
def test_adaptive_prices_a_longer_draft_by_a_shorter_ones_live_ratio(chain1):
    """No smaller batch has run a chain of 3, and its dummy-row calibration at batch 32 is nearly
    plain's (scaled by the bucket's live ratios it would be within reach), but batch 32 explored a
    chain of 1 at 2 plain calls: a chain of 3 costs at least that, and is not explored. Control: with
    the chain of 1 at 1.3x it still is."""
    b = (32, 512)
    a = AdaptiveSteps((0, 1, 3), {(0, b): 0.059, (1, b): 0.080, (3, b): 0.085})
    a.observe(3, (1, 512), [1] * 7 + [2] * 2 + [3], None)  # E(1) = 1.3, E(3) = 1.4
    live = {0: 0.12, 1: chain1, 3: 0.38}
    ran = []
    for _ in range(40):
        k = a.choose(b)
        ran.append(k)
        a.observe(k, b, [], live[k])
    assert ran[:2] == [0, 1]
    assert (3 in ran) == (chain1 == 0.16)
    if chain1 == 0.24:  # without the floor: 0.085 x the bucket's mean live ratio (2.03 + 3.0) / 2
        assert a.estimated_cost(3, b) == pytest.approx(0.24) and 0.085 * (0.12 / 0.059 + 3.0) / 2 < 0.22


def test_adaptive_live_costs_replace_the_calibration():
    """Calibration says drafting 3 is nearly free; live calls say it costs 2x. Periodic exploration
    measures k = 0 live too, and the policy settles on k = 0."""
    a = AdaptiveSteps((0, 3), {(0, "b"): 1.0, (3, "b"): 1.1}, hysteresis=0.1, probe_every=2)
    for _ in range(3):
        a.observe(3, "b", [2, 1, 1, 1], None)  # tau 1.25, no timing yet
    assert a.choose("b") == 3  # 1.25 / 1.1 beats 1 / 1.0 on calibration alone
    ran = []
    for _ in range(12):
        k = a.choose("b")
        ran.append(k)
        a.observe(k, "b", [2, 1, 1, 1] if k else [1] * 4, 2.0 if k == 3 else 1.0)
    assert 0 in ran and a.current["b"] == 0


def test_parse_errors_name_the_field():
    ids = [1, 2]
    for body, param in [({"prompt": ids, "max_tokens": True}, "max_tokens"), ({"prompt": ids, "n": 0}, "n"),
                        ({"prompt": ids, "temperature": "hot"}, "temperature"), ({"prompt": ids, "stop": [1]}, "stop"),
                        ({"prompt": [1, 10**9]}, "prompt"), ({"prompt": ids, "logprobs": 21}, "logprobs"),
                        ({"prompt": "text"}, "prompt")]:
        with pytest.raises(APIError) as e:
            parse_completion(body, None, 1000, 16)
        assert e.value.status == 400 and e.value.param == param, body
    with pytest.raises(APIError, match="UTF-8"):
        parse_json_body(b"\xff\xfe{}")
    with pytest.raises(APIError, match="JSON object"):
        parse_json_body(json.dumps([1]).encode())
    p = parse_gen_params({"prompt": "x", "unknown_field": {"a": 1}, "top_k": -1, "max_completion_tokens": 5}, 16)
    assert p.top_k == 0 and p.max_tokens == 5 and not p.include_usage  # OpenAI: usage chunk only when asked
    p = parse_gen_params({"max_completion_tokens": None, "max_tokens": 7, "stream_options": {"include_usage": True}}, 16)
    assert p.max_tokens == 7 and p.include_usage
    with pytest.raises(APIError) as e:
        parse_gen_params({"top_k": 2**40}, 16)
    assert e.value.param == "top_k"


def test_chat_template_errors_are_400():
    from jaxspec.serve.protocol import parse_chat

    class Strict:
        chat_template = "{{ raise_exception('Conversation roles must alternate') }}"

        def apply_chat_template(self, *a, **kw):
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")

    with pytest.raises(APIError) as e:
        parse_chat({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, Strict(), 16)
    assert e.value.status == 400 and e.value.param == "messages" and "alternate" in e.value.message


# ---- the model's generation_config.json as request defaults (issue 23, first impressions) ----------------


def test_generation_config_defaults_fill_only_what_a_request_leaves_out(tmp_path):
    from jaxspec.models.loading import LoadError, generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20}))
    defaults = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    p = parse_gen_params({}, 16, defaults)
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.9, 20)
    p = parse_gen_params({"temperature": 0, "top_p": 1.0, "top_k": -1}, 16, defaults)  # explicit values win
    assert (p.temperature, p.top_p, p.top_k) == (0.0, 1.0, 0)
    p = parse_gen_params({}, 16)  # no model defaults: OpenAI's
    assert (p.temperature, p.top_p, p.top_k) == (1.0, 1.0, 0)
    assert generation_defaults(tmp_path / "absent") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(LoadError, match=r"generation_config.json: top_p = 1.5"):
        generation_defaults(tmp_path)


def test_server_reads_generation_config_unless_told_not_to(tiny_dirs, tmp_path):
    import shutil

    from jaxspec.models.loading import load_model
    from jaxspec.serve.server import build_server
    from tests.test_serve_scheduler import config

    path, _ = tiny_dirs["llama"]
    d = tmp_path / "m"
    shutil.copytree(path, d)
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_k": 50}))
    model = load_model(str(d), progress=False)
    on = build_server(config(d, **{"spec.algorithm": "ngram"}), model=model, progress=False)
    assert on.sampling_defaults == {"temperature": 0.7, "top_k": 50}
    off = build_server(config(d, **{"spec.algorithm": "ngram", "serve.generation_config": "none"}), model=model,
                       progress=False)
    assert off.sampling_defaults == {}


def test_cli_and_llm_layer_the_models_sampling_defaults_under_the_users(tiny_dirs, tmp_path):
    """The CLI and LLM(...) take generation_config.json's values where the user sets none; a flag
    or --set wins (an LLM call's own SamplingParams too); the embedded model gives none (greedy)."""
    import shutil
    from types import SimpleNamespace

    from jaxspec.api import config_for
    from jaxspec.generate import config_from_args, with_model_sampling

    d = tmp_path / "m"
    shutil.copytree(tiny_dirs["llama"][0], d)
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))

    def cli(**flags):
        args = SimpleNamespace(config=None, set=flags.pop("set", []), model=str(d), **flags)
        return with_model_sampling(config_from_args(args), lambda base: config_from_args(args, base=base), True)

    s = cli().sampling
    assert (s.temperature, s.top_p) == (0.6, 0.9)
    s = cli(temperature=0.0).sampling  # a flag wins
    assert (s.temperature, s.top_p) == (0.0, 0.9)
    s = cli(set=["sampling.top_p=0.5"]).sampling
    assert (s.temperature, s.top_p) == (0.6, 0.5)
    # LLM(...): its default_sampling (what generate uses without a SamplingParams) is the model's.
    s = config_for(str(d), None, None, "float32", {}).sampling
    assert (s.temperature, s.top_p) == (0.6, 0.9)
    assert config_for("default", None, None, "float32", {}).sampling.temperature == 0.0


# ---- the prefill planner (serve/scheduler.plan_prefill) ---------------------------------------------

def _shapes(batches, chunks, budget):
    """What `ModelRunner.prefill_shapes` compiles for these buckets and token budget."""
    return tuple((b, c) for b in batches for c in chunks if b == batches[0] or b * c <= budget)


def _rows(batches):
    return lambda shards: next((b for b in batches if b >= len(shards)), None)


CHUNKS, BATCHES = (32, 64, 128, 256), (1, 2, 4, 8)


def _plan(pending, batches=BATCHES, budget=512):
    from jaxspec.serve.scheduler import plan_prefill

    return plan_prefill(pending, _shapes(batches, CHUNKS, budget), CHUNKS, _rows(batches), 256)


def _fifo_plan(pending, shapes, rows):
    """The planner before 2026-12-05, as the reference: oldest first, each row's need sets the chunk."""
    from jaxspec.engine.types import bucket_for

    taken, bucket = [], 0
    for i, (_, left) in enumerate(pending):
        c = max(bucket, bucket_for(min(256, left), CHUNKS, "chunk"))
        r = rows([pending[j][0] for j in taken + [i]])
        if taken and r is None:
            continue
        if taken and (r, c) not in shapes:
            break
        taken.append(i)
        bucket = c
    return taken, bucket


def _finished(pending, plan):
    idx, c = plan
    return sum(1 for i in idx if pending[i][1] <= c)


def test_prefill_planner_keeps_long_prompts_at_two_full_rows():
    assert _plan([(0, 900), (0, 700), (0, 1500), (0, 300)]) == ([1, 3], 256)  # the shortest two, no padding


def test_prefill_planner_packs_short_cache_hit_turns_within_the_budget():
    pending = [(0, n) for n in (50, 61, 40, 33, 64, 58, 47, 62, 49)]
    assert _plan(pending) == ([0, 1, 2, 3, 5, 6, 7, 8], 64)  # the eight shortest finish in one 512-token call
    # Control: under a row cap of two the same queue finishes only the two shortest per call.
    assert _plan(pending, batches=(1, 2)) == ([2, 3], 64)
    # One turn of 100 tokens does not hold the chunk at 128: it waits, the eight shortest finish.
    assert _plan([(0, 50), (0, 100)] + pending) == ([0, 2, 3, 4, 5, 7, 8, 10], 64)


def test_prefill_planner_passes_over_a_full_data_shard():
    from jaxspec.serve.scheduler import plan_prefill

    batches = (2, 4)  # split pages over 2 data shards: at most 2 rows per shard

    def rows(of):
        return next((b for b in batches if b // 2 >= max(of.count(d) for d in range(2))), None)

    pending = [(0, 50), (0, 40), (0, 30), (1, 60)]
    assert plan_prefill(pending, _shapes(batches, CHUNKS, 512), CHUNKS, rows, 256) == ([1, 2, 3], 64)


def test_prefill_planner_lets_short_turns_pass_a_long_prompt_until_it_is_urgent():
    """A short turn rides beside a long prompt's chunk (it fills its row exactly); two short turns go
    before it, where oldest-first held them behind a 256-token chunk. Once the scheduler marks the long
    prompt urgent (passed over MAX_PREFILL_SKIPS calls) it is taken whatever waits."""
    from jaxspec.serve.scheduler import plan_prefill

    assert _plan([(0, 1000), (0, 50)]) == ([0, 1], 64)
    pending = [(0, 1000), (0, 50), (0, 40)]
    assert _plan(pending) == ([1, 2], 64)
    assert _fifo_plan(pending, _shapes(BATCHES, CHUNKS, 512), _rows(BATCHES)) == ([0, 1], 256)  # control
    shorts = [(0, 30 + k) for k in range(9)]
    assert 0 not in _plan([(0, 1000)] + shorts)[0]
    idx, c = plan_prefill([(0, 1000)] + shorts, _shapes(BATCHES, CHUNKS, 512), CHUNKS, _rows(BATCHES), 256, urgent=0)
    assert idx[0] == 0 and len(idx) > 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(1, 2000)), min_size=1, max_size=12),
       st.sampled_from([256, 512, 1024]), st.sampled_from([1, 2]), st.booleans())
def test_prefill_planner_stays_within_budget_and_shard_caps_and_finishes_no_fewer(pending, budget, shards, urgent):
    """Every plan is a compiled shape within the shard caps, takes the shortest (or the urgent)
    sequence, sizes its chunk to what its rows take (none larger than needed), and brings at least as
    many sequences to their first token as the oldest-first reference did on one shard."""
    from jaxspec.serve.scheduler import plan_prefill

    pending = [(s % shards, n) for s, n in pending]
    batches = tuple(b for b in BATCHES if b % shards == 0)
    shapes = _shapes(batches, CHUNKS, budget)

    def rows(of):  # split pages: every shard's rows fit its slice of the bucket
        return next((b for b in batches if b // shards >= max(of.count(d) for d in range(shards))), None)

    first = len(pending) - 1 if urgent else None
    idx, c = plan_prefill(pending, shapes, CHUNKS, rows, 256, urgent=first)
    assert idx and idx == sorted(set(idx))
    must = first if urgent else min(range(len(pending)), key=lambda i: (pending[i][1], i))
    assert must in idx
    assert c <= 256 and c == next(x for x in CHUNKS if x >= max(min(c, pending[i][1]) for i in idx))  # no spare
    assert (rows([pending[i][0] for i in idx]), c) in shapes  # a compiled program, within the budget
    if shards == 1 and not urgent:
        assert _finished(pending, (idx, c)) >= _finished(pending, _fifo_plan(pending, shapes, rows))


PACKED_ROWS = (1, 2, 4, 8, 12, 16, 20, 24, 28, 32)  # what the runner compiles for piece 16 and a 512-token budget


def test_batch_size_weighs_a_call_of_its_own_against_delaying_the_batch():
    """prefill_plan.batch_size by hand (piece 16, a call's overhead and gap 32 + 32 tokens): sequence
    i + 1 joins i while i x its tokens < (sequences behind it) x 64."""
    from jaxspec.serve.prefill_plan import batch_size

    assert batch_size([5], 16, 32) == 1
    assert batch_size([5, 5, 5], 16, 32) == 2  # 80 < 2 x 64; then 160 >= 64
    assert batch_size([19] * 8, 16, 32) == 2  # long prompts: 304 < 448; then 608 >= 384
    assert batch_size([1] * 30, 16, 32) == 24  # a burst of one-piece turns: i x 16 < (30 - i) x 64
    assert batch_size([3, 3, 3, 3, 4, 4, 4, 4], 16, 0) == 4  # nothing decoding: 256 >= 4 x 32


def test_packed_planner_finishes_the_shortest_turns_in_the_smallest_call():
    """Eight cache-hit turns of 33-64 tokens (400 in all): the call finishes the four shortest in 12
    rows of 16 (192 padded tokens), not all eight in 28 rows (448): those four are not held behind
    the other four's 16 rows, and the next call takes the rest. Either pads under one piece per turn,
    where the rectangle pads each to 64 (512). Control: 20 of a burst of 24 one-piece turns share one call
    (a second call would cost the many behind more than the batch costs the first)."""
    from jaxspec.serve.prefill_plan import plan_packed

    pending = [(0, n) for n in (50, 61, 40, 33, 64, 58, 47, 47)]
    rows = _rows(PACKED_ROWS)
    assert plan_packed(pending, PACKED_ROWS, 16, rows) == [(2, 40), (3, 33), (6, 47), (7, 47)]
    rest = [(0, n) for n in (50, 61, 64, 58)]  # the next call: two of the four (64 < 3 x 64; 128 >= 2 x 64)
    assert plan_packed(rest, PACKED_ROWS, 16, rows) == [(0, 50), (3, 58)]
    assert rows([0] * sum(-(-n // 16) for _, n in pending)) == 28
    assert _plan(pending) == (list(range(8)), 64)  # the rectangle: the same eight in 8 rows x 64
    burst = [(0, 16)] * 24
    assert plan_packed(burst, PACKED_ROWS, 16, rows) == [(i, 16) for i in range(20)]  # i x 16 < (24 - i) x 64


def test_packed_planner_chunks_a_long_prompt_over_the_rows_left():
    """A long prompt takes every row the short turns leave (a multiple of the piece), is not finished,
    and an urgent one goes first whatever waits."""
    from jaxspec.serve.prefill_plan import plan_packed

    rows = _rows(PACKED_ROWS)
    # The 40-token turn gets a call of 4 rows (the spare row to the long prompt), not 32 rows.
    assert plan_packed([(0, 1000), (0, 40)], PACKED_ROWS, 16, rows) == [(0, 16), (1, 40)]
    assert plan_packed([(0, 1000)], PACKED_ROWS, 16, rows) == [(0, 512)]  # alone: the largest bucket
    shorts = [(0, 100 + k) for k in range(8)]
    plan = plan_packed([(0, 1000)] + shorts, PACKED_ROWS, 16, rows)
    assert 0 not in dict(plan)
    plan = plan_packed([(0, 1000)] + shorts, PACKED_ROWS, 16, rows, urgent=0)
    assert plan[0] == (0, 512)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(1, 2000)), min_size=1, max_size=12),
       st.sampled_from([1, 2]), st.sampled_from([4, 16, 32]), st.booleans())
def test_packed_planner_fills_a_compiled_bucket_in_whole_pieces(pending, shards, piece, urgent):
    """Every packed plan fits a compiled row bucket within the shard caps, takes the shortest (or the
    urgent) sequence, gives each sequence whole pieces (only its last partial, only when it finishes),
    finishes as many as `batch_size` asks where the largest bucket can, and no smaller bucket would
    have finished as many."""
    from jaxspec.serve.prefill_plan import DECODE_GAP_TOKENS, _order, batch_size, plan_packed

    pending = [(s % shards, n) for s, n in pending]
    budget = 512
    buckets = tuple(b for b in sorted({1, 2, 4, *range(8, budget // piece + 1, 4)}) if b <= budget // piece)
    buckets = tuple(sorted({-(-b // shards) * shards for b in buckets}))

    def rows(of):
        return next((b for b in buckets if b // shards >= max(of.count(d) for d in range(shards))), None)

    first = len(pending) - 1 if urgent else None
    plan = plan_packed(pending, buckets, piece, rows, urgent=first)
    idx = [i for i, _ in plan]
    assert idx and idx == sorted(set(idx))
    assert (first if urgent else min(range(len(pending)), key=lambda i: (pending[i][1], i))) in idx
    for i, n in plan:
        assert 0 < n <= pending[i][1] and (n % piece == 0 or n == pending[i][1])
    used = [pending[i][0] for i, n in plan for _ in range(-(-n // piece))]
    assert rows(used) in buckets and rows(used) * piece <= max(budget, piece * shards)
    order = _order(pending, first)
    want = batch_size([-(-pending[i][1] // piece) for i in order], piece, DECODE_GAP_TOKENS)

    def finished(p):
        return sum(1 for i, n in p if n == pending[i][1])

    done = finished(plan)
    # The largest bucket alone (every row bucket pads into it): what any call could finish.
    largest = plan_packed(pending, buckets[-1:], piece, lambda of: buckets[-1] if rows(of) else None, urgent=first)
    assert done >= min(want, finished(largest))
    for b in buckets:  # no smaller compiled bucket finishes as many of the wanted
        if b < rows(used):
            alone = plan_packed(pending, (b,), piece, lambda of, b=b: b if rows(of) and rows(of) <= b else None,
                                urgent=first)
            assert min(want, finished(alone)) < min(want, done) or finished(alone) == 0 == done


def test_make_room_evicts_least_recent_evictable_programs_then_refuses(monkeypatch):
    """mappings.make_room, counted at 100 mappings per program: evicts what `evictable` allows, least
    recently used first, stops as soon as `need` fit, and refuses (naming vm.max_map_count) when the
    rest cannot go. Control: with nothing evictable the same need is refused at once."""
    import collections

    from jaxspec.engine import mappings

    def setup():
        compiled = {k: object() for k in ("a", "g1", "b", "g2")}
        last_used = collections.OrderedDict((k, None) for k in ("a", "g1", "b", "g2"))  # least recent first
        monkeypatch.setattr(mappings, "count", lambda: 1000 + 100 * len(compiled))
        budget = mappings.MapBudget(max_maps=int((1000 + 100 * 5) / (1 - mappings.RESERVE_FRACTION)) + 1)
        budget.per_program = 100
        return compiled, last_used, budget

    compiled, last_used, budget = setup()  # 4 resident, room for 5: one more fits as is
    mappings.make_room(budget, last_used, compiled, 1, lambda k: True)
    assert list(compiled) == ["a", "g1", "b", "g2"]
    grammar = lambda k: k.startswith("g")  # noqa: E731
    mappings.make_room(budget, last_used, compiled, 2, grammar)  # one must go: the least recent build
    assert list(compiled) == ["a", "b", "g2"] and list(last_used) == ["a", "b", "g2"]
    with pytest.raises(mappings.MapLimitError, match="vm.max_map_count is"):
        mappings.make_room(budget, last_used, compiled, 4, grammar)  # g2 goes too, a and b may not
    assert list(compiled) == ["a", "b"]
    compiled, last_used, budget = setup()
    mappings.make_room(budget, last_used, compiled, 3, lambda k: True)  # offline: anything, oldest first
    assert list(compiled) == ["b", "g2"]
    compiled, last_used, budget = setup()
    with pytest.raises(mappings.MapLimitError):
        mappings.make_room(budget, last_used, compiled, 2, lambda k: False)
    assert len(compiled) == 4


def test_follow_ups_count_ends_and_the_grace_waits_only_while_one_is_missing():
    """serve/follow_ups.py without a server: ends open the window, arrivals close it; the grace holds
    while fewer requests are queued than expected and ends by itself when none comes (a client that
    stopped). Controls: window 0 counts nothing; grace 0 never holds."""
    import threading

    from jaxspec.serve.follow_ups import FollowUps

    wake, stop = threading.Event(), threading.Event()
    f = FollowUps(window=60.0, grace=0.05)
    f.ended(), f.ended()
    assert f.expected == 2 and f.due()
    f.wait(lambda: 2, wake, stop)  # both already queued: no hold
    assert f.num_waits == 0
    f.wait(lambda: 1, wake, stop)  # one missing: holds until the grace ends
    assert f.num_waits == 1
    f.arrived(), f.arrived(), f.arrived()
    assert f.expected == 0 and not f.due()
    f.wait(lambda: 0, wake, stop)  # nothing expected: no hold
    assert f.num_waits == 1
    off = FollowUps(window=0.0, grace=0.05)
    off.ended()
    assert off.expected == 0 and not off.due()
    no_grace = FollowUps(window=60.0, grace=0.0)
    no_grace.ended()
    no_grace.wait(lambda: 0, wake, stop)
    assert no_grace.due() and no_grace.num_waits == 0


def test_trace_is_a_no_op_when_off_and_names_the_setting_when_it_cannot_write(tmp_path):
    """serve/trace.py: "" writes nothing; a directory that cannot be made (a file is in the way) is an
    OSError naming serve.trace and the path, which the server's start-up prints as "error: ..."."""
    from types import SimpleNamespace

    from jaxspec.serve.trace import Trace

    off = Trace("")
    off.call("decode", 0.0, 1.0, [SimpleNamespace(seq_id=1)], k=0)  # no file, no error
    assert not list(tmp_path.iterdir())
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match=r"serve\.trace: cannot write .*file/trace-\d+\.jsonl"):
        Trace(str(blocker), prefix_cache=True)
    on = Trace(str(tmp_path / "dir"), prefix_cache=True)  # control: a writable directory gets its file
    on.call("prefill", 0.0, 1.0, [SimpleNamespace(seq_id=3)], rows=1, tokens=5)
    assert on.path.read_text().splitlines()[1].startswith('{"ev": "prefill", "t0": 0.0')
