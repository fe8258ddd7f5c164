"""Compile the paged-attention kernel on a GPU and hold it to the jnp reference.

    python -m jaxspec.bench.gpu_attention            # correctness + timing
    python -m jaxspec.bench.gpu_attention --sweep    # also try block sizes

On a machine without a GPU it says so and exits 0, so it is safe in any CI step.
Each case prints the max error over rows that see at least one slot, and median
kernel vs reference wall time. Exit status 1 if any case is off.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.common import timed
from jaxspec.cache.attention import paged_attention_ref, visibility_mask
from jaxspec.pallas.paged_attention import paged_attention_pallas

# Relative to max |reference|: bf16 keeps ~3 digits; f32 dots are IEEE in Triton.
TOLERANCE = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float32): 1e-4}


def ancestor_masks(rng: np.random.Generator, b: int, t: int) -> np.ndarray:  # [b, t, t] bool
    """Random draft trees: node i's parent is a random earlier node."""
    masks = np.zeros((b, t, t), bool)
    for i in range(b):
        parents = [-1] + [int(rng.integers(0, j)) for j in range(1, t)]
        for j in range(t):
            p = j
            while p >= 0:
                masks[i, j, p] = True
                p = parents[p]
    return masks


def make_case(rng, *, b, t, h, kvh, hd, page_size, max_len, tree, dtype, pad_row=False):
    """Sequences of random committed length, pages scattered through a shuffled pool."""
    max_pages = -(-max_len // page_size)
    kv_len = rng.integers(t, max_len + 1, size=b).astype(np.int32)
    kv_len[0] = max_len  # one sequence always at the longest length
    q_start = (kv_len - t).astype(np.int32)
    if pad_row:
        kv_len[-1], q_start[-1] = 0, 0  # a padded batch row: sees nothing, must be finite
    num_pages = 1 + b * max_pages + 8
    perm = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    table = np.zeros((b, max_pages), np.int32)  # null page past each sequence
    for i in range(b):
        n = -(-int(kv_len[i]) // page_size)
        table[i, :n] = perm[i * max_pages : i * max_pages + n]
    shape = (num_pages, page_size, kvh, hd)
    return dict(
        q=jnp.asarray(rng.normal(size=(b, t, h, hd)), dtype),
        k_pages=jnp.asarray(rng.normal(size=shape), dtype),
        v_pages=jnp.asarray(rng.normal(size=shape), dtype),
        page_table=jnp.asarray(table),
        q_start=jnp.asarray(q_start),
        kv_len=jnp.asarray(kv_len),
        tree_mask=jnp.asarray(ancestor_masks(rng, b, t)) if tree else None,
    )


def median_time(fn, reps: int = 20) -> float:
    jax.block_until_ready(fn())  # compile outside the timing
    return float(np.median(timed(lambda: jax.block_until_ready(fn()), reps)))


def check(name: str, case: dict, scale: float, interpret: bool = False, **kernel_kw) -> bool:
    kernel = jax.jit(
        lambda c: paged_attention_pallas(**c, scale=scale, interpret=interpret, **kernel_kw)
    )
    ref = jax.jit(lambda c: paged_attention_ref(**c, scale=scale))
    try:
        got = np.asarray(kernel(case).astype(jnp.float32))
    except Exception as e:  # a lowering/compile failure is a result worth printing
        print(f"{name:44s} FAILED to compile/run: {type(e).__name__}: {e}")
        return False
    want = np.asarray(ref(case).astype(jnp.float32))
    b, t = got.shape[:2]
    num_slots = case["page_table"].shape[1] * case["k_pages"].shape[1]
    sees = visibility_mask(case["q_start"], case["kv_len"], t, num_slots, case["tree_mask"])
    sees = np.asarray(sees.any(-1))[:, :, None, None]
    err = float(np.abs(np.where(sees, got - want, 0.0)).max())
    rel = err / max(float(np.abs(want).max()), 1e-30)
    ok = bool(np.isfinite(got).all()) and rel <= TOLERANCE[case["q"].dtype]
    t_kernel = median_time(lambda: kernel(case))
    t_ref = median_time(lambda: ref(case))
    print(
        f"{name:44s} max_err {err:.2e} (rel {rel:.1e}) "
        f"kernel {t_kernel * 1e3:7.3f} ms  ref {t_ref * 1e3:7.3f} ms  "
        f"{'ok' if ok else 'MISMATCH'}"
    )
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="time block_k / num_warps variants")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print(f"no GPU present (backend: {jax.default_backend()}); nothing to check")
        return 0
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    rng = np.random.default_rng(0)
    bf16, f32 = jnp.bfloat16, jnp.float32
    llama = dict(h=32, kvh=8, hd=128)  # Llama-3-8B-like attention, GQA group 4
    cases = [
        ("decode B=8 T=1 ps=16 bf16", dict(b=8, t=1, **llama, page_size=16, max_len=2048,
                                           tree=False, dtype=bf16, pad_row=True)),
        ("verify tree B=8 T=16 ps=16 bf16", dict(b=8, t=16, **llama, page_size=16,
                                                 max_len=2048, tree=True, dtype=bf16)),
        ("chunked prefill B=8 T=16 ps=16 f32", dict(b=8, t=16, **llama, page_size=16,
                                                    max_len=2048, tree=False, dtype=f32)),
        ("prefill B=2 T=512 ps=16 bf16", dict(b=2, t=512, **llama, page_size=16,
                                              max_len=2048, tree=False, dtype=bf16)),
        # SmolLM2-135M attention (group 3, rows padded) with single-slot pages.
        ("smollm decode+tree B=4 T=8 ps=1 bf16", dict(b=4, t=8, h=9, kvh=3, hd=64,
                                                      page_size=1, max_len=512, tree=True,
                                                      dtype=bf16)),
        # head_dim 96 is padded to 128 inside the wrapper (a cache copy).
        ("odd head_dim=96 B=4 T=4 ps=8 f32", dict(b=4, t=4, h=8, kvh=2, hd=96, page_size=8,
                                                  max_len=256, tree=False, dtype=f32)),
    ]
    ok = True
    for name, spec in cases:
        case = make_case(rng, **spec)
        ok &= check(name, case, scale=spec["hd"] ** -0.5)
    if args.sweep:
        for t, tree in ((1, False), (16, True)):
            case = make_case(rng, b=8, t=t, **llama, page_size=16, max_len=2048, tree=tree,
                             dtype=bf16)
            for block_k in (32, 64, 128):
                for num_warps in (4, 8):
                    ok &= check(f"sweep T={t} block_k={block_k} warps={num_warps}", case,
                                scale=128**-0.5, block_k=block_k, num_warps=num_warps)
    print("all ok" if ok else "SOME CASES FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
