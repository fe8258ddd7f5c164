"""The engine's adaptive speculation (`Engine(adaptive=True)`, `spec.adaptive`): per batch bucket,
plain decoding or the configured draft shape, chosen by measured cost and acceptance.

Whichever program a bucket runs, the tokens are plain decoding's: greedy equal to a plain engine,
sampled equal to plain sampling with the same seeds (the coupled rule). The policy itself is held
to the E(k) / cost(k) rule on injected costs (no timing is asserted anywhere).
"""

from __future__ import annotations

import pytest

from jaxspec.config import ConfigValueError, EngineSection, SpecSection, load_config
from jaxspec.engine import Engine, Request
from jaxspec.sampling_params import SamplingParams
from jaxspec.engine.adaptive import EngineAdaptive
from jaxspec.models.loading import load_model

PROMPTS = [[5, 17, 33, 9, 100, 42, 7], [200, 3], [11, 12, 13, 14, 15, 16, 17], [99, 98, 97]]
ENGINE = dict(max_batch_size=4, max_context=128, length_buckets=(16, 32, 64, 128), page_size=16)


def test_policy_picks_the_program_with_more_tokens_per_second():
    pol = EngineAdaptive(3, prior_rate=0.5)  # E(3) = 1 + .5 + .25 + .125 = 1.875
    pol.calibrate((1, 64), {0: 0.010, 3: 0.015})  # spec 1.5x the cost: 125 vs 100 tokens/s
    pol.calibrate((8, 64), {0: 0.020, 3: 0.050})  # spec 2.5x: 37.5 vs 50
    assert pol.choose((1, 64)) == 3 and pol.choose((8, 64)) == 0
    # Measured acceptance lower than the prior: at batch 1 plain now wins by more than the hysteresis.
    pol.observe(3, (1, 64), [1] * 9 + [2], 0.015)  # r1 = 0.1: E(3) = 1.1
    assert pol.choose((1, 64)) == 0
    assert "batch 1 ctx 64: plain x1, k=3 x1" in pol.summary() and "batch 8 ctx 64: plain x1" in pol.summary()


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


def _force(engine, monkeypatch, plain_buckets):
    """Calibrate so that batch buckets in `plain_buckets` run plain and the others speculate."""
    def fake(bucket):
        b = bucket[0]
        return {0: 1.0, engine.adaptive.depth: 1e3 if b in plain_buckets else 1e-3}

    monkeypatch.setattr(engine, "_calibrate", fake)
    engine.adaptive.steps.hysteresis = 1e9  # live costs and acceptance never switch a bucket here


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "T 0.9 top-p 0.9"])
def test_every_bucket_emits_plain_decodings_tokens(tiny, monkeypatch, sampled):
    plain, adaptive = tiny
    adaptive.adaptive = EngineAdaptive(adaptive.spec_plan.max_depth)
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


def test_calibration_times_both_programs_in_the_bucket(tiny):
    _, adaptive = tiny
    adaptive.adaptive = EngineAdaptive(adaptive.spec_plan.max_depth)
    adaptive.compile([(2, 16, 64)])
    assert adaptive.adaptive.calibrated((2, 64))
    assert {k for k, bucket in adaptive.adaptive.steps.cost if bucket == (2, 64)} == {0, adaptive.adaptive.depth}
    assert adaptive.runner.allocator.num_used == 0
