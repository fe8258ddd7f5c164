"""The plain decode engine against Hugging Face, on tiny random models.

Covers the Llama, Qwen2 (qkv bias) and Qwen3 (q/k norm) variants, ragged
batches, page sizes 1 and 16, seeded sampling, stop tokens, page accounting and
the no-recompile guarantee.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxspec.config import EngineSection
from jaxspec.engine import Engine, Request, RequestError
from jaxspec.sampling_params import SamplingParams
from jaxspec.models.loading import load_model
from tests.reference import assert_greedy_equal, chi_square_pvalue, compile_events, hf_first_two_marginals, hf_greedy

PROMPTS = [[5, 17, 33, 9, 100, 42, 7], [200, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23], [99]]


def make_engine(path, **engine_kw):
    model = load_model(str(path), progress=False)
    kw = dict(max_batch_size=4, max_context=128, length_buckets=(16, 32, 64, 128), page_size=16)
    kw.update(engine_kw)
    return Engine(model.params, model.config, EngineSection(**kw), progress=False)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_matches_hf_batched_ragged(tiny_dirs, kind, page_size):
    path, hf = tiny_dirs[kind]
    engine = make_engine(path, page_size=page_size)
    n = 24
    results = engine.generate([Request(p, SamplingParams(max_tokens=n)) for p in PROMPTS])
    for prompt, res in zip(PROMPTS, results):
        assert_greedy_equal(hf, prompt, res.output_ids, hf_greedy(hf, prompt, n))
        assert res.finish_reason == "length"
    assert engine.runner.allocator.num_used == 0


def test_a_max_context_between_length_buckets(tiny_dirs):
    """max_context 96 under length buckets (.., 64, 128): a 70-token prompt used to be padded to a
    128-token prefill chunk and refused ("context 128 exceeds the largest bucket 96"); it fits."""
    path, hf = tiny_dirs["llama"]
    engine = make_engine(path, max_context=96)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 250, 70)]
    res = engine.generate([Request(prompt, SamplingParams(max_tokens=8))])[0]
    assert_greedy_equal(hf, prompt, res.output_ids, hf_greedy(hf, prompt, 8))


def test_batched_equals_batch_one(tiny_dirs):
    path, _ = tiny_dirs["llama"]
    engine = make_engine(path)
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9)
    reqs = [Request(p, sp, seed=i) for i, p in enumerate(PROMPTS)]
    batched = [r.output_ids for r in engine.generate(reqs)]
    single = [engine.generate([r])[0].output_ids for r in reqs]
    assert batched == single


def test_seeded_sampling_is_batch_independent_and_reproducible(tiny_dirs):
    path, _ = tiny_dirs["qwen2"]
    engine = make_engine(path)
    req = Request(PROMPTS[0], SamplingParams(max_tokens=20, temperature=1.5), seed=1234)
    alone = engine.generate([req])[0].output_ids
    assert engine.generate([req])[0].output_ids == alone, "the same seed must reproduce exactly"
    other = Request(PROMPTS[1], SamplingParams(max_tokens=5, temperature=1.0), seed=9)
    with_others = engine.generate([other, req])[1].output_ids
    assert alone == with_others


def test_sampled_tokens_follow_the_hf_model_distribution(tiny_dirs):
    """4096 requests with seeds 0..4095: the first token (prefill) and the second
    (a decode step) follow softmax(HF logits / T), computed in torch/numpy. The
    same samples reject the distribution at another temperature, so the test has
    the power to see a sampler that ignores or misapplies the temperature."""

    path, hf = tiny_dirs["qwen2"]
    engine = make_engine(path, max_batch_size=64)
    prompt, temp, n, batch = PROMPTS[0], 0.7, 4096, 64
    out = []
    for start in range(0, n, batch):
        res = engine.generate([Request(prompt, SamplingParams(max_tokens=2, temperature=temp), seed=s)
                               for s in range(start, start + batch)])
        out += [r.output_ids for r in res]
    out = np.asarray(out)
    assert out.shape == (n, 2) and ((out >= 0) & (out < 256)).all()
    marginals = hf_first_two_marginals(hf, prompt)
    alpha = 1e-3
    c1, c2 = (np.bincount(out[:, i], minlength=256) for i in range(2))
    p1, p2 = marginals(temp)
    assert chi_square_pvalue(c1, p1) > alpha
    assert chi_square_pvalue(c2, p2) > alpha
    for wrong in (1.0, 0.6):  # positive controls on the same samples
        w1, w2 = marginals(wrong)
        assert chi_square_pvalue(c1, w1) < alpha, wrong
        assert chi_square_pvalue(c2, w2) < alpha, wrong


def test_stop_token_ends_sequence_and_is_last(tiny_dirs):
    path, hf = tiny_dirs["llama"]
    engine = make_engine(path)
    ref = hf_greedy(hf, PROMPTS[0], 20)
    stop = ref[5]
    first = ref.index(stop)
    res = engine.generate([Request(PROMPTS[0], SamplingParams(max_tokens=20), stop_token_ids=(stop,)),
                           Request(PROMPTS[1], SamplingParams(max_tokens=20))])
    assert res[0].output_ids == ref[: first + 1]
    assert res[0].finish_reason == "stop"
    assert len(res[1].output_ids) == 20


def test_second_request_of_compiled_bucket_does_not_compile(tiny_dirs):
    path, _ = tiny_dirs["llama"]
    engine = make_engine(path)
    # Bucket (batch 1, prompt <= 16, context <= 32) for both requests.
    engine.generate([Request(PROMPTS[0], SamplingParams(max_tokens=20))])
    # Same bucket, different contents and sampling parameters.
    req = Request(PROMPTS[2], SamplingParams(max_tokens=10, temperature=0.7), seed=3)
    assert compile_events(lambda: engine.generate([req])) == []
    # And the listener does see compilation when a new bucket is needed.
    compiles = compile_events(lambda: engine.generate([Request(PROMPTS[2], SamplingParams(max_tokens=40))]))
    assert compiles, "the compile listener saw nothing: the test would be vacuous"


def test_bad_requests_raise_clear_errors_and_leak_nothing(tiny_dirs):
    path, _ = tiny_dirs["llama"]
    engine = make_engine(path)
    with pytest.raises(RequestError, match="exceeds the context"):
        engine.generate([Request(list(range(1, 100)), SamplingParams(max_tokens=64))])
    with pytest.raises(RequestError, match="outside the vocabulary"):
        engine.generate([Request([1, 300], SamplingParams(max_tokens=4))])
    with pytest.raises(RequestError, match="empty prompt"):
        engine.generate([Request([], SamplingParams(max_tokens=4))])
    assert engine.runner.allocator.num_used == 0
    # The engine still serves after the errors.
    assert len(engine.generate([Request(PROMPTS[1], SamplingParams(max_tokens=3))])[0].output_ids) == 3


def test_out_of_pages_is_a_clear_error_and_frees_partial_allocations(tiny_dirs):
    from jaxspec.cache.paged import OutOfPagesError

    path, _ = tiny_dirs["llama"]
    engine = make_engine(path, page_size=4, num_pages=9)  # 8 usable pages = 32 slots
    with pytest.raises(OutOfPagesError, match="out of pages"):
        engine.generate([Request(PROMPTS[0], SamplingParams(max_tokens=20)),
                         Request(PROMPTS[2], SamplingParams(max_tokens=20))])
    assert engine.runner.allocator.num_used == 0
    np.testing.assert_equal(len(engine.generate([Request(PROMPTS[1], SamplingParams(max_tokens=8))])[0].output_ids), 8)


def test_failed_device_call_frees_pages_and_engine_recovers(tiny_dirs):
    path, hf = tiny_dirs["llama"]
    engine = make_engine(path)
    req = Request(PROMPTS[0], SamplingParams(max_tokens=6))
    first = engine.generate([req])[0].output_ids
    key = next(k for k in engine.runner._compiled if k[0] == "decode")
    real = engine.runner._compiled[key]

    def failing_decode(*args):
        raise RuntimeError("simulated device failure")

    engine.runner._compiled[key] = failing_decode
    with pytest.raises(RuntimeError, match="simulated"):
        engine.generate([req])  # the prefill already donated the cache
    assert engine.runner.allocator.num_used == 0
    engine.runner._compiled[key] = real
    assert engine.generate([req])[0].output_ids == first


def test_bfloat16_weights_and_cache_track_float32(tiny_dirs):
    """bfloat16 mode: same code path; logits within bf16 rounding of the float32 reference."""
    import jax.numpy as jnp

    from jaxspec.cache.paged import KVCache
    from jaxspec.models.llama import forward, prepare_params

    path, _ = tiny_dirs["llama"]
    outs = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        model = load_model(str(path), dtype=dtype, progress=False)
        c = model.config
        assert model.params["embed"].dtype == dtype
        cache = KVCache.zeros(c.num_layers, 9, 4, c.num_kv_heads, c.head_dim, dtype)
        tokens = jnp.asarray([PROMPTS[2]])
        t = tokens.shape[1]
        outs[dtype] = np.asarray(forward(
            prepare_params(model.params, c), c, tokens, jnp.arange(t)[None], cache, jnp.arange(1, 9)[None],
            q_start=jnp.zeros(1, jnp.int32), kv_len=jnp.array([t]),
        ).logits)
    ref, got = outs[jnp.float32], outs[jnp.bfloat16]
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    # And the engine generates in bfloat16 end to end.
    bf = load_model(str(path), dtype=jnp.bfloat16, progress=False)
    engine = Engine(bf.params, bf.config, EngineSection(max_batch_size=1, max_context=64, length_buckets=(16, 64)),
                    progress=False)
    assert engine.runner.cache.k.dtype == jnp.bfloat16
    assert len(engine.generate([Request(PROMPTS[0], SamplingParams(max_tokens=8))])[0].output_ids) == 8
