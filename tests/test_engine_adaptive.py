"""The engine's adaptive speculation (`Engine(adaptive=True)`, `spec.adaptive`): per batch bucket,
plain decoding, the configured draft shape or a shorter chain, chosen by measured cost and acceptance.

Whichever program a bucket runs, the tokens are plain decoding's: greedy equal to a plain engine,
sampled equal to plain sampling with the same seeds (the coupled rule). The policy itself is held
to the E(k) / cost(k) rule on injected costs (no timing is asserted anywhere).
"""

from __future__ import annotations

import pytest

from jaxspec.config import ConfigValueError, EngineSection, SpecSection, load_config
from jaxspec.engine import Engine, Request, RequestError
from jaxspec.sampling_params import SamplingParams
from jaxspec.engine.adaptive import EngineAdaptive
from jaxspec.models.loading import load_model

PROMPTS = [[5, 17, 33, 9, 100, 42, 7], [200, 3], [11, 12, 13, 14, 15, 16, 17], [99, 98, 97]]
ENGINE = dict(max_batch_size=4, max_context=128, length_buckets=(16, 32, 64, 128), page_size=16)


def test_policy_picks_the_program_with_more_tokens_per_second():
    pol = EngineAdaptive({0: 1, 3: 4}, prior_rate=0.5)  # E(3) = 1 + .5 + .25 + .125 = 1.875
    pol.calibrate((1, 64), {0: 0.010, 3: 0.015})  # spec 1.5x the cost: 125 vs 100 tokens/s
    pol.calibrate((8, 64), {0: 0.020, 3: 0.050})  # spec 2.5x: 37.5 vs 50
    assert pol.choose((1, 64)) == 3 and pol.choose((8, 64)) == 0
    # Measured acceptance lower than the prior: at batch 1 plain now wins by more than the hysteresis.
    pol.observe(3, (1, 64), [1] * 9 + [2], 0.015)  # r1 = 0.1: E(3) = 1.1
    assert pol.choose((1, 64)) == 0
    assert "batch 1 ctx 64: plain x1, k=3 x1" in pol.summary() and "batch 8 ctx 64: plain x1" in pol.summary()


def test_policy_chooses_among_draft_lengths_with_interpolated_costs():
    pol = EngineAdaptive({0: 1, 1: 2, 3: 4}, prior_rate=0.5, hysteresis=0.0)
    # Calibrated: plain 20 ms, the chain of 3 62 ms; the chain of 1 is priced by width: 20 + 42 / 3 = 34 ms.
    pol.calibrate((8, 64), {0: 0.020, 3: 0.062})
    assert pol.steps.cost[(1, (8, 64))] == pytest.approx(0.034)
    assert pol.choose((8, 64)) == 0  # tokens/s: plain 50, k=1 1.5 / .034 = 44, k=3 1.875 / .062 = 30
    pol.observe(1, (1, 64), [2] * 8 + [1] * 2, None)  # r1 = 0.8: k=1 52.9, k=3 2.952 / .062 = 47.6
    assert pol.choose((8, 64)) == 1
    # The chain of 1's first real batch replaces the estimate: at 45 ms (40 tokens/s) plain wins again.
    pol.observe(1, (8, 64), [2] * 8 + [1] * 2, 0.045)
    assert pol.steps.cost[(1, (8, 64))] == pytest.approx(0.045) and pol.choose((8, 64)) == 0
    assert "batch 8 ctx 64: plain x2, k=1 x1" in pol.summary()
    with pytest.raises(ValueError, match="needs plain decoding"):
        EngineAdaptive({1: 2, 3: 4})

def test_adaptive_auto_is_on_for_the_default_shape_only():
    assert SpecSection(algorithm="eagle3").adaptive_on()
    assert not SpecSection(algorithm="eagle3", num_draft_tokens=6).adaptive_on()
    assert not SpecSection(algorithm="eagle3", topk=4, num_steps=4, num_draft_tokens=16).adaptive_on()
    assert not SpecSection(algorithm="ngram", simulate_accept_length=3).adaptive_on()
    assert SpecSection(algorithm="eagle3", num_draft_tokens=6, adaptive="on").adaptive_on()
    assert not SpecSection(algorithm="eagle3", adaptive="off").adaptive_on()
    with pytest.raises(ConfigValueError, match="spec.adaptive must be auto, on or off"):
        load_config(None, {"spec.adaptive": "sometimes"})


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    model = load_model(str(tiny_dirs["llama"][0]), progress=False)
    plain = Engine(model.params, model.config, EngineSection(**ENGINE), progress=False)
    spec = SpecSection(algorithm="ngram", num_draft_tokens=4, ngram_draft_tokens_by_match=())
    adaptive = Engine(model.params, model.config, EngineSection(**ENGINE), progress=False, spec=spec, adaptive=True)
    return plain, adaptive


def _fresh(engine):
    r = engine.runner
    return EngineAdaptive({k: r.plans[k].num_draft_tokens for k in r.candidates})


def _force(engine, monkeypatch, plain_buckets, shape_cost: float = 1e-3):
    """Calibrate so that batch buckets in `plain_buckets` run plain and the others speculate (at the
    configured shape while it costs `shape_cost` plain steps)."""
    def fake(bucket):
        b = bucket[0]
        return {0: 1.0, engine.adaptive.depth: 1e3 if b in plain_buckets else shape_cost}

    monkeypatch.setattr(engine, "_calibrate", fake)
    engine.adaptive.steps.hysteresis = 1e9  # live costs and acceptance never switch a bucket here


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "T 0.9 top-p 0.9"])
def test_every_bucket_emits_plain_decodings_tokens(tiny, monkeypatch, sampled):
    plain, adaptive = tiny
    adaptive.adaptive = _fresh(adaptive)
    _force(adaptive, monkeypatch, plain_buckets={4})
    kw = dict(temperature=0.9, top_p=0.9) if sampled else {}
    reqs = [Request(p * 3, SamplingParams(max_tokens=20, **kw), seed=7 + i) for i, p in enumerate(PROMPTS)]
    want = [r.output_ids for r in plain.generate(reqs)]
    batched = adaptive.generate(reqs)  # batch bucket 4: plain
    single = [adaptive.generate([r])[0] for r in reqs]  # batch bucket 1: speculation
    assert [r.output_ids for r in batched] == want
    assert [r.output_ids for r in single] == want
    assert all(r.accept_lengths is None for r in batched), "bucket 4 was calibrated to plain decoding"
    assert all(r.accept_lengths for r in single), "bucket 1 was calibrated to speculate"
    if not sampled:  # (the random model's sampled rows seldom take an n-gram draft)
        assert sum(n - 1 for r in single for n in r.accept_lengths) > 0, "the repeated prompts must accept drafts"
    choices = adaptive.adaptive.choices  # {(batch, context): [k of each batch run there]}
    assert [k for (b, _), ks in choices.items() if b == 4 for k in ks] == [0]
    assert [k for (b, _), ks in choices.items() if b == 1 for k in ks] == [adaptive.adaptive.depth] * 4
    assert "plain x1" in adaptive.adaptive.summary()
    assert adaptive.runner.allocator.num_used == 0


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "T 0.9 top-p 0.9"])
def test_a_shorter_chain_compiles_when_chosen_and_emits_plain_decodings_tokens(tiny, monkeypatch, sampled):
    plain, adaptive = tiny
    adaptive.adaptive = _fresh(adaptive)
    assert adaptive.runner.candidates == (0, 1, 3), "the default spec.adaptive_lengths adds a chain of 1"
    # The configured chain of 3 at 1.6 plain steps, so the chain of 1 (1.2 by width) scores highest.
    _force(adaptive, monkeypatch, plain_buckets=set(), shape_cost=1.6)
    kw = dict(temperature=0.9, top_p=0.9) if sampled else {}
    reqs = [Request(p * 3, SamplingParams(max_tokens=20, **kw), seed=3 + i) for i, p in enumerate(PROMPTS[:2])]
    bucket = adaptive.plan(reqs)[0][1]
    adaptive.compile([bucket])
    key = ("decode", 1, bucket[0], bucket[2])
    assert sampled or key not in adaptive.runner._compiled, "compile() builds only the calibrated programs"
    got = adaptive.generate(reqs)
    assert [r.output_ids for r in got] == [r.output_ids for r in plain.generate(reqs)]
    assert adaptive.adaptive.choices[(bucket[0], bucket[2])] == [1]
    assert key in adaptive.runner._compiled
    lens = [n for r in got for n in r.accept_lengths]
    assert lens and set(lens) <= {1, 2}, "a chain of 1 commits one or two tokens per step"
    if not sampled:
        assert 2 in lens, "the repeated prompts must accept drafts"
    assert adaptive.runner.allocator.num_used == 0


def test_calibration_times_plain_and_the_shape_and_prices_shorter_chains_between(tiny):
    _, adaptive = tiny
    adaptive.adaptive = _fresh(adaptive)
    adaptive.compile([(2, 16, 64)])
    assert adaptive.adaptive.calibrated((2, 64))
    cost = {k: c for (k, bucket), c in adaptive.adaptive.steps.cost.items() if bucket == (2, 64)}
    assert set(cost) == {0, 1, 3}
    assert cost[1] == pytest.approx(cost[0] + (cost[3] - cost[0]) / 3)  # widths 1, 2 and 4
    assert adaptive.runner.allocator.num_used == 0


def test_adaptive_lengths_past_the_shape_are_refused(tiny_dirs):
    model = load_model(str(tiny_dirs["llama"][0]), progress=False)
    spec = SpecSection(algorithm="ngram", num_draft_tokens=3, adaptive_lengths=(1, 4))
    with pytest.raises(RequestError, match=r"spec.adaptive_lengths \(1, 4\).*depth, 2"):
        Engine(model.params, model.config, EngineSection(**ENGINE), progress=False, spec=spec, adaptive=True)
