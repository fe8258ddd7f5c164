"""The Pallas paged-attention kernel (interpret mode on CPU) equals the jnp reference.

Shapes stay tiny: each new shape costs an interpret-mode compile (~1 s on these
CPUs), while reruns of a compiled shape are free, so the property test varies
values at fixed shapes.
"""

from __future__ import annotations

import jax
import numpy as np
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxspec.cache.attention import paged_attention, paged_attention_blocked, paged_attention_ref, visibility_mask
from jaxspec.cache.paged import NULL_PAGE
from jaxspec.pallas.paged_attention import paged_attention_pallas

F32_TOL = dict(atol=1e-5, rtol=1e-5)
# Small blocks so the tiny cases still run several query blocks and key-loop steps.
SMALL_BLOCKS = dict(block_q=16, block_k=16)
# Jitted: eager dispatch compiles every op per new shape, costing more than the kernel.
ref_jit = jax.jit(paged_attention_ref, static_argnames="scale")


def ancestor_mask(parents: np.ndarray) -> np.ndarray:  # [T] -> [T, T] bool
    """Node i sees itself and its ancestors; parents[i] < i, root has -1."""
    t = len(parents)
    mask = np.eye(t, dtype=bool)
    for i in range(t):
        p = parents[i]
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    return mask


def random_parents(rng: np.random.Generator, n: int) -> np.ndarray:  # [n] int
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int64)


def make_case(
    rng: np.random.Generator,
    *,
    q_start: list[int],
    n_new: list[int],
    t: int,
    kvh: int,
    group: int,
    hd: int,
    page_size: int,
    max_pages: int,
    tree: bool = False,
    dtype=jnp.float32,
    num_pages: int | None = None,
):
    """Random q and cache, with each sequence's pages scattered through the pool.

    `n_new[b] <= t` real tokens follow `q_start[b]`; rows past them are padding.
    Table entries past a sequence's pages point at the null page, which holds
    large garbage so that reading it through a masked slot would show.
    """
    b = len(q_start)
    kv_len = np.asarray(q_start) + np.asarray(n_new)
    need = [-(-int(n) // page_size) for n in kv_len]
    assert max(need) <= max_pages
    if num_pages is None:
        num_pages = 1 + sum(need) + 3  # a few spare pages nobody owns
    perm = rng.permutation(np.arange(1, num_pages))
    table = np.full((b, max_pages), NULL_PAGE, np.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used : used + n]
        used += n
    h = kvh * group
    q = rng.normal(size=(b, t, h, hd))
    k = rng.normal(size=(num_pages, page_size, kvh, hd))
    v = rng.normal(size=(num_pages, page_size, kvh, hd))
    k[NULL_PAGE] = 50.0
    v[NULL_PAGE] = -50.0
    tree_mask = None
    if tree:
        tree_mask = np.zeros((b, t, t), bool)
        for i in range(b):
            tree_mask[i, : n_new[i], : n_new[i]] = ancestor_mask(random_parents(rng, n_new[i]))
            tree_mask[i, n_new[i] :] = np.eye(t, dtype=bool)[n_new[i] :]  # padding nodes
        tree_mask = jnp.asarray(tree_mask)
    return dict(
        q=jnp.asarray(q, dtype),
        k_pages=jnp.asarray(k, dtype),
        v_pages=jnp.asarray(v, dtype),
        page_table=jnp.asarray(table),
        q_start=jnp.asarray(q_start, jnp.int32),
        kv_len=jnp.asarray(kv_len, jnp.int32),
        tree_mask=tree_mask,
    )


def run_both(case, scale, **kernel_kw):
    """Kernel and reference outputs as f32 numpy, rows that see no slot zeroed in both.

    Such rows (kv_len == 0, or a padding tree node with no prefix) are garbage by
    contract: the reference averages V over every gathered slot, the kernel returns
    0. They must still be finite, which is checked here.
    """
    args = (
        case["q"], case["k_pages"], case["v_pages"], case["page_table"],
        case["q_start"], case["kv_len"], case["tree_mask"],
    )
    got = paged_attention_pallas(*args, scale=scale, interpret=True, **kernel_kw)
    want = ref_jit(*args, scale=scale)
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    assert np.isfinite(got).all()
    b, t = got.shape[:2]
    num_slots = case["page_table"].shape[1] * case["k_pages"].shape[1]
    sees = visibility_mask(case["q_start"], case["kv_len"], t, num_slots, case["tree_mask"])
    sees = np.asarray(sees.any(axis=-1))[:, :, None, None]  # [B, T, 1, 1]
    return np.where(sees, got, 0.0), np.where(sees, want, 0.0)


# (q_start, n_new, T) per mode; the largest sequence ends at slot 39.
MODES = {
    # T = 1: one new token after 0, 16 and 39 committed ones.
    "decode": ([0, 16, 39], [1, 1, 1], 1),
    # Ragged causal prefill: a fresh prompt, a chunk after 13 slots with padding rows,
    # and a full chunk after 31 (neither prefix is page aligned).
    "prefill": ([0, 13, 31], [8, 5, 8], 8),
    # Draft trees of 8 nodes (one padded to 6) after 0, 9 and 31 committed slots.
    "tree": ([0, 9, 31], [8, 6, 8], 8),
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_matches_reference(mode, group, page_size):
    q_start, n_new, t = MODES[mode]
    max_pages = -(-40 // page_size) + 2  # spare null entries at the end of every row
    rng = np.random.default_rng(hash((mode, group, page_size)) % 2**32)
    case = make_case(
        rng, q_start=q_start, n_new=n_new, t=t, kvh=2, group=group, hd=16,
        page_size=page_size, max_pages=max_pages, tree=mode == "tree",
    )
    got, want = run_both(case, scale=0.25, **SMALL_BLOCKS)
    np.testing.assert_allclose(got, want, **F32_TOL)


def test_default_blocks_and_padded_head_dim():
    """Default (large) blocks, and a head_dim that is not a power of two (24 -> 32)."""
    rng = np.random.default_rng(1)
    case = make_case(
        rng, q_start=[3, 20], n_new=[4, 2], t=4, kvh=1, group=2, hd=24,
        page_size=4, max_pages=8, tree=True,
    )
    got, want = run_both(case, scale=24**-0.5)
    np.testing.assert_allclose(got, want, **F32_TOL)


def test_padding_rows_stay_finite():
    """kv_len == 0 (a padded batch row) is finite; kv_len == 1 is exact."""
    rng = np.random.default_rng(2)
    case = make_case(
        rng, q_start=[0, 0, 10], n_new=[0, 1, 3], t=4, kvh=2, group=3, hd=16,
        page_size=4, max_pages=4,
    )
    got, want = run_both(case, scale=0.25, **SMALL_BLOCKS)  # checks finiteness
    np.testing.assert_allclose(got, want, **F32_TOL)


def test_bf16():
    rng = np.random.default_rng(3)
    case = make_case(
        rng, q_start=[0, 13, 30], n_new=[8, 5, 8], t=8, kvh=2, group=3, hd=16,
        page_size=4, max_pages=12, tree=True, dtype=jnp.bfloat16,
    )
    got, want = run_both(case, scale=0.25, **SMALL_BLOCKS)
    # bf16 outputs carry ~3 significant digits, and the kernel rounds unnormalised
    # probabilities to bf16 where the reference rounds normalised ones.
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), tree=st.booleans())
def test_random_layouts(seed, tree):
    """Fixed shapes (one compile each for causal and tree), random everything else."""
    rng = np.random.default_rng(seed)
    b, t, page_size, max_pages = 3, 6, 2, 12
    q_start = [int(x) for x in rng.integers(0, 2 * max_pages - t + 1, size=b)]
    n_new = [int(x) for x in rng.integers(1, t + 1, size=b)]
    case = make_case(
        rng, q_start=q_start, n_new=n_new, t=t, kvh=2, group=2, hd=16,
        page_size=page_size, max_pages=max_pages, tree=tree,
        num_pages=1 + b * max_pages + 3,  # fixed, so every example reuses one compile
    )
    got, want = run_both(case, scale=0.25, **SMALL_BLOCKS)
    np.testing.assert_allclose(got, want, **F32_TOL)


def test_dispatcher_uses_kernel_in_interpret_mode(monkeypatch):
    """`JAXSPEC_KERNELS=interpret` routes the public entry point through the kernel."""
    rng = np.random.default_rng(4)
    case = make_case(
        rng, q_start=[2], n_new=[3], t=3, kvh=1, group=1, hd=16, page_size=4, max_pages=2,
    )
    want = paged_attention_ref(**case, scale=0.5)
    monkeypatch.setenv("JAXSPEC_KERNELS", "interpret")
    got = paged_attention(**case, scale=0.5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **F32_TOL)


@pytest.mark.parametrize("block_pages", [1, 2, 16])
@pytest.mark.parametrize("page_size", [1, 4])
def test_blocked_prefill_attention_matches_reference(block_pages, page_size):
    """The CPU prefill path (a while_loop over key blocks, online softmax) against the reference:
    ragged rows whose kv_len spans zero, one and several blocks, a row of padding only, prefixes off
    page boundaries, and a table wider than any row needs (the trip count stops short of it)."""
    rng = np.random.default_rng(11 + block_pages + page_size)
    max_pages = -(-48 // page_size) + 3
    case = make_case(rng, q_start=[0, 13, 31, 0], n_new=[9, 5, 12, 0], t=12, kvh=2, group=3, hd=16,
                     page_size=page_size, max_pages=max_pages)
    case.pop("tree_mask")
    want = np.asarray(ref_jit(*case.values(), scale=0.3))
    fn = jax.jit(lambda *a: paged_attention_blocked(*a, scale=0.3, block_pages=block_pages))
    got = np.asarray(fn(*case.values()))
    assert np.isfinite(got).all()
    real = np.arange(12)[None, :] < np.asarray(case["kv_len"] - case["q_start"])[:, None]  # [B, T] real queries
    np.testing.assert_allclose(got[real], want[real], **F32_TOL)
    # Padding queries of a real row see what the reference lets them see, too.
    np.testing.assert_allclose(got[:3], want[:3], **F32_TOL)


def test_dispatcher_runs_blocked_attention_for_long_causal_blocks_on_cpu(monkeypatch):
    """A causal block of more than BLOCKED_MIN_QUERIES queries takes the blocked path; a tree mask
    or a short block takes the reference (positive control: the patched blocked path is reached)."""
    import jaxspec.cache.attention as attn

    t = attn.BLOCKED_MIN_QUERIES + 1
    rng = np.random.default_rng(12)
    case = make_case(rng, q_start=[3, 40], n_new=[t, t - 7], t=t, kvh=1, group=2, hd=16, page_size=4,
                     max_pages=24)
    got = paged_attention(**case, scale=0.5)
    np.testing.assert_allclose(np.asarray(got)[0], np.asarray(paged_attention_ref(**case, scale=0.5))[0], **F32_TOL)

    def boom(*_, **__):
        raise _KernelCalled

    monkeypatch.setattr(attn, "paged_attention_blocked", boom)
    with pytest.raises(_KernelCalled):
        paged_attention(**case, scale=0.5)
    short = make_case(rng, q_start=[3], n_new=[4], t=4, kvh=1, group=2, hd=16, page_size=4, max_pages=4)
    paged_attention(**short, scale=0.5)  # the reference: no exception
    tree = make_case(rng, q_start=[3], n_new=[t], t=t, kvh=1, group=2, hd=16, page_size=4, max_pages=24, tree=True)
    paged_attention(**tree, scale=0.5)  # a long tree block: the reference, no exception


class _KernelCalled(Exception):
    pass


def test_dispatcher_runs_mosaic_kernel_on_tpu(monkeypatch):
    """The Triton kernel's TPU fallback lives in the dispatcher: on TPU the Mosaic
    kernel (jaxspec.pallas.paged_attention_tpu) runs and the Triton one is never
    called; on GPU the Triton one is."""
    import jaxspec.pallas as kernels
    import jaxspec.pallas.paged_attention as pa
    import jaxspec.pallas.paged_attention_tpu as pat

    def boom(*_, **__):
        raise _KernelCalled

    rng = np.random.default_rng(5)
    case = make_case(
        rng, q_start=[1], n_new=[2], t=2, kvh=1, group=2, hd=16, page_size=4, max_pages=2,
    )
    monkeypatch.setattr(pa, "paged_attention_pallas", boom)
    # The Mosaic kernel cannot run here: stand in the reference, checking it is reached.
    monkeypatch.setattr(pat, "paged_attention_mosaic", lambda *a, **k: paged_attention_ref(*a, **k))
    monkeypatch.setattr(kernels, "kernel_backend", lambda: "tpu")
    got = paged_attention(**case, scale=0.5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(paged_attention_ref(**case, scale=0.5)),
                               **F32_TOL)
    # Positive control: the same call on GPU does reach the (stubbed) Triton kernel.
    monkeypatch.setattr(kernels, "kernel_backend", lambda: "gpu")
    with pytest.raises(_KernelCalled):
        paged_attention(**case, scale=0.5)


def test_kernel_refuses_tpu_instead_of_importing_the_reference(monkeypatch):
    rng = np.random.default_rng(6)
    case = make_case(
        rng, q_start=[0], n_new=[1], t=1, kvh=1, group=1, hd=16, page_size=4, max_pages=1,
    )
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    # __wrapped__: the raise happens at trace time, so bypass jit's trace cache.
    with pytest.raises(NotImplementedError, match="jaxspec.cache.attention.paged_attention"):
        paged_attention_pallas.__wrapped__(**case, scale=0.5)


def test_rejects_bad_shapes():
    q = jnp.zeros((1, 2, 3, 16))
    pages = jnp.zeros((4, 2, 2, 16))  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_pallas(
            q, pages, pages, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32),
            jnp.ones((1,), jnp.int32), scale=1.0, interpret=True,
        )


@pytest.mark.parametrize(
    "dtype,hd,page_size,group,tree",
    [
        (jnp.bfloat16, 128, 16, 4, False),  # Llama-like decode/prefill
        (jnp.bfloat16, 128, 16, 4, True),  # tree verification
        (jnp.float32, 64, 1, 3, True),  # SmolLM2 heads, single-slot pages
        (jnp.float32, 24, 4, 2, False),  # padded head_dim
    ],
)
def test_lowers_to_triton_on_cpu(dtype, hd, page_size, group, tree):
    """Export for CUDA from this CPU host: runs the whole Pallas -> Triton IR lowering
    (power-of-two shapes, supported primitives, gathers), short of PTX codegen."""
    from jax import export

    b, t, kvh, num_pages, max_pages = 2, 16, 2, 64, 8
    args = [
        jax.ShapeDtypeStruct((b, t, kvh * group, hd), dtype),
        jax.ShapeDtypeStruct((num_pages, page_size, kvh, hd), dtype),
        jax.ShapeDtypeStruct((num_pages, page_size, kvh, hd), dtype),
        jax.ShapeDtypeStruct((b, max_pages), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b, t, t), jnp.bool_) if tree else None,
    ]
    fn = jax.jit(lambda *a: paged_attention_pallas(*a, scale=0.1))
    exported = export.export(
        fn,
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*args)
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


def test_gpu_check_script_is_a_no_op_on_cpu(capsys):
    from jaxspec.bench import gpu_attention as gpu_check_attention

    if jax.default_backend() == "gpu":
        pytest.skip("runs the real check on GPU; too slow for the unit suite")
    assert gpu_check_attention.main([]) == 0
    assert "no GPU" in capsys.readouterr().out
