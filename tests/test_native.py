"""The native XLA:CPU kernels (jaxspec/native) against their jnp references.

* packed matmul == XLA's dot on the unpacked weight, any M, K, N (partial tiles);
  each output row is bit-identical whatever the batch around it;
* paged attention == `paged_attention_ref`, causal and tree masks, page sizes 1
  and 16, GQA groups, ragged lengths, head dims that are not multiples of 16;
* the engine with native kernels and with XLA's ops both equal Hugging Face;
* a missing compiler is a clear error ("native") or a warned fallback ("auto").
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxspec.cache.attention import paged_attention_ref
from jaxspec.native.build import NativeKernelError, use_native_kernels
from jaxspec.native.packed_matmul import pack_weight, packed_matmul, unpack_weight
from jaxspec.native.paged_attention import paged_attention_native
from tests.test_paged_attention import ancestor_mask, random_parents

matmul = jax.jit(packed_matmul)
attention_ref = jax.jit(paged_attention_ref, static_argnames="scale")
attention_native = jax.jit(paged_attention_native, static_argnames="scale")


@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (8, 64, 128), (13, 70, 130), (3, 5, 7), (40, 32, 64), (2, 16, 200)])
def test_packed_matmul_equals_xla_dot(m, k, n):
    rng = np.random.default_rng(m * 1000 + n)
    x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((k, n), dtype=np.float32))
    pw = pack_weight(w)
    assert pw.shape == (k, n) and pw.tiles.shape == (-(-n // 64), k, 64)
    np.testing.assert_array_equal(np.asarray(unpack_weight(pw)), np.asarray(w))
    got = np.asarray(matmul(x, pw))
    np.testing.assert_allclose(got, np.asarray(jnp.einsum("...i,io->...o", x, unpack_weight(pw))), rtol=1e-5, atol=1e-4 * np.sqrt(k))
    np.testing.assert_allclose(got, np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-4 * np.sqrt(k))


def test_packed_matmul_leading_axes_and_stacked_weights():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((3, 24, 80), dtype=np.float32))  # stacked layers [L, K, N]
    pw = pack_weight(w)
    assert pw.shape == (3, 24, 80) and pw.tiles.shape == (3, 2, 24, 64)
    x = jnp.asarray(rng.standard_normal((2, 5, 24), dtype=np.float32))  # [B, T, K]
    layer1 = jax.tree.map(lambda a: a[1], pw)
    np.testing.assert_allclose(np.asarray(matmul(x, layer1)), np.einsum("bti,io->bto", x, w[1]), rtol=1e-5,
                               atol=1e-4)
    with pytest.raises(ValueError, match="one layer's weight"):
        packed_matmul(x, pw)
    with pytest.raises(ValueError, match="last axis"):
        packed_matmul(x[..., :5], layer1)
    with pytest.raises(TypeError, match="float32 x and float32 or int8"):
        packed_matmul(x.astype(jnp.bfloat16), layer1)


def test_packed_matmul_rows_are_batch_invariant():
    # Each row is summed in the same order whatever M is and wherever it sits, so
    # speculative verify (T rows) and plain decode (1 row) see bit-identical logits.
    rng = np.random.default_rng(1)
    w = pack_weight(jnp.asarray(rng.standard_normal((300, 150), dtype=np.float32)))
    x = jnp.asarray(rng.standard_normal((19, 300), dtype=np.float32))
    full = np.asarray(matmul(x, w))
    for m in (1, 2, 7, 8, 9, 16):
        for start in (0, 3, 19 - m):
            part = np.asarray(matmul(x[start:start + m], w))
            np.testing.assert_array_equal(part, full[start:start + m])


def _attention_case(rng, b, t, h, kvh, hd, page_size, tree, num_layers=2):
    max_pages = max(4, -(-(t + 60) // page_size))
    num_pages = b * max_pages + 1
    cache_k = rng.standard_normal((num_layers, num_pages, page_size, kvh, hd), dtype=np.float32)
    cache_v = rng.standard_normal((num_layers, num_pages, page_size, kvh, hd), dtype=np.float32)
    q = rng.standard_normal((b, t, h, hd), dtype=np.float32)
    # Distinct shuffled pages per sequence; unused table entries point at the null page.
    perm = rng.permutation(np.arange(1, num_pages))
    page_table = perm[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    kv_len = rng.integers(t, max_pages * page_size + 1, size=b).astype(np.int32)
    for i in range(b):
        page_table[i, -(-int(kv_len[i]) // page_size):] = 0
    q_start = kv_len - t
    mask = None
    if tree:
        mask = np.broadcast_to(ancestor_mask(random_parents(rng, t)), (b, t, t)).copy()
    return [jnp.asarray(a) for a in (q, cache_k, cache_v, page_table, q_start, kv_len)] + [
        None if mask is None else jnp.asarray(mask)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from([(1, 1, 9, 3, 64), (2, 8, 4, 2, 16), (3, 5, 6, 3, 8), (2, 4, 4, 4, 24), (1, 16, 8, 2, 72),
                           (1, 6, 4, 1, 32)]),  # last: one KV head, so the query block is split over threads
    page_size=st.sampled_from([1, 16]),
    tree=st.booleans(),
)
def test_native_paged_attention_equals_reference(seed, shape, page_size, tree):
    rng = np.random.default_rng(seed)
    b, t, h, kvh, hd = shape
    q, ck, cv, pt, qs, kl, mask = _attention_case(rng, b, t, h, kvh, hd, page_size, tree)
    scale = hd**-0.5
    for layer in range(ck.shape[0]):
        got = attention_native(q, ck, cv, layer, pt, qs, kl, mask, scale=scale)
        want = attention_ref(q, ck[layer], cv[layer], pt, qs, kl, mask, scale=scale)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("shape,page_size", [((1, 256, 9, 3, 64), 16), ((2, 96, 6, 3, 16), 4), ((3, 64, 4, 1, 8), 1)],
                         ids=["smollm2-chunk", "two-rows", "one-kv-head"])
def test_native_attention_on_prefill_chunks_equals_reference(shape, page_size):
    """Prefill chunks (64 to MAX_QUERIES queries) run the kernel with the query block split over
    threads; a row whose chunk is shorter than the block (its kv_len short of q_start + T) keeps the
    reference's semantics for every query."""
    from jaxspec.native.paged_attention import MAX_QUERIES

    rng = np.random.default_rng(sum(shape) + page_size)
    b, t, h, kvh, hd = shape
    assert t <= MAX_QUERIES
    q, ck, cv, pt, qs, kl, _ = _attention_case(rng, b, t, h, kvh, hd, page_size, False)
    kl = kl.at[-1].add(-(t // 3))  # a partial last chunk
    for layer in range(ck.shape[0]):
        got = attention_native(q, ck, cv, layer, pt, qs, kl, None, scale=hd**-0.5)
        want = attention_ref(q, ck[layer], cv[layer], pt, qs, kl, None, scale=hd**-0.5)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)


def test_native_attention_empty_row_is_zero_not_nan():
    rng = np.random.default_rng(3)
    q, ck, cv, pt, qs, kl, _ = _attention_case(rng, 2, 3, 4, 2, 16, 4, False)
    kl = kl.at[1].set(0)  # an empty padding sequence: nothing visible
    qs = qs.at[1].set(0)
    out = np.asarray(attention_native(q, ck, cv, 0, pt, qs, kl, None, scale=0.25))
    assert np.all(out[1] == 0)
    want = attention_ref(q, ck[0], cv[0], pt, qs, kl, None, scale=0.25)
    np.testing.assert_allclose(out[0], np.asarray(want)[0], rtol=1e-5, atol=2e-6)


def test_policy_refuses_native_where_it_cannot_run():
    assert use_native_kernels("xla", jnp.float32, None) is False
    assert use_native_kernels("auto", jnp.bfloat16, None) is False
    with pytest.raises(NativeKernelError, match="bfloat16, not float32"):
        use_native_kernels("native", jnp.bfloat16, None)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    with pytest.raises(NativeKernelError, match="mesh"):
        use_native_kernels("native", jnp.float32, mesh)


def test_engine_with_and_without_native_kernels_matches_hf(tiny_dirs):
    from jaxspec.config import EngineSection
    from jaxspec.engine import Engine, Request
    from jaxspec.sampling_params import SamplingParams
    from jaxspec.models.loading import load_model
    from jaxspec.native.packed_matmul import PackedWeight
    from tests.reference import assert_greedy_equal, hf_greedy

    path, hf = tiny_dirs["qwen2"]
    model = load_model(str(path), progress=False)
    prompts = [[5, 17, 33, 9, 100, 42, 7], [200, 3]]
    # Unrolled layers (the CPU default) and lax.scan over stacked packed weights.
    for mode, loop, packed in (("native", "auto", True), ("native", "scan", True), ("xla", "auto", False)):
        ecfg = EngineSection(max_batch_size=2, max_context=128, length_buckets=(16, 32, 64, 128), cpu_kernels=mode,
                             layer_loop=loop)
        engine = Engine(model.params, model.config, ecfg, progress=False)
        assert isinstance(engine.runner.params["head"], PackedWeight) is packed
        layers = engine.runner.params["layers"]
        first = layers[0] if isinstance(layers, list) else layers
        # Packed params run Q/K/V and gate/up as one kernel call each (what this test holds to HF).
        assert ({"wqkv", "w_gate_up"} <= set(first)) is packed and ("wq" in first) is not packed
        for prompt, res in zip(prompts, engine.generate([Request(p, SamplingParams(max_tokens=16)) for p in prompts])):
            assert_greedy_equal(hf, prompt, res.output_ids, hf_greedy(hf, prompt, 16))


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_missing_compiler_is_a_clear_error_or_a_warned_fallback(tmp_path):
    env = {"CXX": "no-such-compiler", "PATH": "/nonexistent", "JAXSPEC_CACHE": str(tmp_path)}
    strict = _run("""
        import jax.numpy as jnp
        from jaxspec.native.build import NativeKernelError, use_native_kernels
        try:
            use_native_kernels("native", jnp.float32, None)
        except NativeKernelError as e:
            print("ERROR", e)
        """, env)
    assert "ERROR no C++ compiler found" in strict.stdout, strict.stderr
    auto = _run("""
        import jax.numpy as jnp
        from jaxspec.native.build import use_native_kernels
        print("USED", use_native_kernels("auto", jnp.float32, None))
        """, env)
    assert "USED False" in auto.stdout, auto.stderr
    assert "warning: no C++ compiler found" in auto.stderr


@pytest.mark.parametrize("t", [20, 64])
def test_native_attention_with_a_block_wider_than_its_page_table(t):
    """The scorer's forward (engine/scoring.py): no prefix, a one-page table (16 slots) and the
    whole prompt as the in-flight block. The block's slots are not bounded by the table. The kernel
    clamped them to it, latent while every scorer block (128+ queries) went to the reference; when
    blocks of up to 256 queries moved to the kernel, prompt logprobs went wrong from the 17th token."""
    from jaxspec.cache.attention import attention_with_block_ref

    rng = np.random.default_rng(t)
    b, h, kvh, hd, page_size = 1, 4, 2, 16, 16
    ck = jnp.asarray(rng.standard_normal((2, 1, page_size, kvh, hd), dtype=np.float32))
    cv = jnp.asarray(rng.standard_normal((2, 1, page_size, kvh, hd), dtype=np.float32))
    q = jnp.asarray(rng.standard_normal((b, t, h, hd), dtype=np.float32))
    k_block = jnp.asarray(rng.standard_normal((b, t, kvh, hd), dtype=np.float32))
    v_block = jnp.asarray(rng.standard_normal((b, t, kvh, hd), dtype=np.float32))
    pt, qs = jnp.zeros((b, 1), jnp.int32), jnp.zeros((b,), jnp.int32)
    got = attention_native(q, ck, cv, 0, pt, qs, qs + t, None, k_block, v_block, scale=0.25)
    want = attention_with_block_ref(q, ck[0], cv[0], pt, qs, k_block, v_block, None, scale=0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("tree", [False, True])
def test_native_attention_with_inflight_block_equals_reference(tree):
    from jaxspec.cache.attention import attention_with_block_ref

    rng = np.random.default_rng(5 + tree)
    b, t, h, kvh, hd = 2, 6, 6, 3, 16
    q, ck, cv, pt, qs, kl, mask = _attention_case(rng, b, t, h, kvh, hd, 4, tree)
    k_block = jnp.asarray(rng.standard_normal((b, t, kvh, hd), dtype=np.float32))
    v_block = jnp.asarray(rng.standard_normal((b, t, kvh, hd), dtype=np.float32))
    got = attention_native(q, ck, cv, 1, pt, qs, qs + t, mask, k_block, v_block, scale=0.25)
    want = attention_with_block_ref(q, ck[1], cv[1], pt, qs, k_block, v_block, mask, scale=0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)
    with pytest.raises(ValueError, match="both"):
        paged_attention_native(q, ck, cv, 1, pt, qs, qs + t, mask, k_block, None, scale=0.25)

