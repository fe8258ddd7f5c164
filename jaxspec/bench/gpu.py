"""`python -m jaxspec.bench gpu`: the GPU checks, as one script that runs in a few minutes.

1. Every Pallas kernel compiled for the GPU (not interpret mode) against its jnp
   reference: paged attention (decode, prefill, tree), tree build, greedy verify,
   target-only sampling, rejection sampling.
2. Plain decode tokens/s of a Llama-3-8B-shaped model with random bf16 weights at
   batch 1 and 64, against the HBM roofline (measured copy bandwidth).
3. The synthetic-acceptance sweep (L = 1..8) at batch 1 and 32 on the same model.

Each section reports and carries on if another fails; exit status 1 if any
kernel check fails. `--dry-run` runs the same code on CPU with tiny shapes and
interpret-mode kernels (that is how the test suite keeps this script honest).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.common import median, print_table, timed

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5,
    rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
)
TINY = dict(LLAMA3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def _close(name, got, want, tol) -> bool:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    ok = got.shape == want.shape and err <= tol * max(1.0, float(np.max(np.abs(want))) if want.size else 1.0)
    print(f"  {'ok ' if ok else 'BAD'} {name}: max err {err:.3g}")
    return ok


def random_tree(rng, b, n):
    parents = np.zeros((b, n), np.int32)
    parents[:, 0] = -1
    for i in range(1, n):
        parents[:, i] = rng.integers(0, i, size=b)
    return parents


def check_kernels(interpret: bool, small: bool) -> bool:
    """Section 1. Returns True when every kernel equals its reference."""
    from jaxspec.bench.gpu_attention import check, make_case
    from jaxspec.pallas.tree_build import build_tree_pallas
    from jaxspec.pallas.verify import verify_greedy_pallas, verify_rejection_pallas, verify_target_only_pallas
    from jaxspec.speculative.tree import build_tree_ref
    from jaxspec.speculative.verify import verify_greedy_ref, verify_rejection_ref, verify_target_only_ref

    rng = np.random.default_rng(0)
    ok = True
    shape = dict(h=4, kvh=2, hd=16, max_len=40) if small else dict(h=32, kvh=8, hd=128, max_len=2048)
    b = 2 if small else 8
    for name, t, tree in (("decode", 1, False), ("prefill", 16, False), ("tree verify", 16, True)):
        case = make_case(rng, b=b, t=t, page_size=16, tree=tree, dtype=jnp.bfloat16 if not small else jnp.float32,
                         **shape)
        ok &= check(f"paged attention {name}", case, shape["hd"] ** -0.5, interpret=interpret)

    n, v, depth = (8, 300, 7) if small else (16, 128256, 15)
    parents = jnp.asarray(random_tree(rng, b, n))
    tokens = jnp.asarray(rng.integers(0, v, size=(b, n)), jnp.int32)
    prefix = jnp.asarray(rng.integers(0, 100, size=b), jnp.int32)
    got = build_tree_pallas(tokens, parents, prefix, interpret=interpret)
    want = build_tree_ref(tokens, parents, prefix)
    for field in ("depth", "positions", "mask", "retrieve_next_token", "retrieve_next_sibling"):
        ok &= _close(f"tree build {field}", getattr(got, field), getattr(want, field), 0)

    nt, ns = want.retrieve_next_token, want.retrieve_next_sibling
    # Make acceptance likely: the target's argmax at each parent is one of its children's tokens.
    predict = jnp.asarray(rng.integers(0, v, size=(b, n)), jnp.int32)
    first_child = np.asarray(nt)
    predict = jnp.where(first_child >= 0, jnp.take_along_axis(tokens, jnp.maximum(first_child, 0), 1), predict)
    ok &= all(_close(f"greedy verify {i}", g, w, 0) for i, (g, w) in enumerate(zip(
        verify_greedy_pallas(tokens, nt, ns, predict, max_depth=depth, interpret=interpret),
        verify_greedy_ref(tokens, nt, ns, predict, max_depth=depth))))
    logits = jnp.asarray(rng.normal(size=(b, n, v)) * 3, jnp.float32)
    probs = jax.nn.softmax(logits, -1)
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, n, v)) * 3, jnp.float32), -1)
    u = jnp.asarray(rng.random((b, n)), jnp.float32)
    e = jnp.asarray(rng.exponential(size=(b, v)) + 1e-6, jnp.float32)
    ok &= all(_close(f"target-only verify {i}", g, w, 0) for i, (g, w) in enumerate(zip(
        verify_target_only_pallas(tokens, nt, ns, probs, u, e, 1.0, 1.0, max_depth=depth, interpret=interpret),
        verify_target_only_ref(tokens, nt, ns, probs, u, e, 1.0, 1.0, max_depth=depth))))
    ok &= all(_close(f"rejection verify {i}", g, w, 0) for i, (g, w) in enumerate(zip(
        verify_rejection_pallas(tokens, nt, ns, probs, q, u, e, max_depth=depth, interpret=interpret),
        verify_rejection_ref(tokens, nt, ns, probs, q, u, e, max_depth=depth))))
    return bool(ok)


def random_model(hf_config: dict, dtype):
    """A Llama-shaped model with random weights (std 0.02), in the loader's layout."""
    from jaxspec.models.config import ModelConfig, layer_keys

    cfg = ModelConfig.from_hf_dict(hf_config)
    d, i, v, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    shapes = {"attn_norm": (L, d), "mlp_norm": (L, d), "wq": (L, cfg.q_size, d), "wk": (L, cfg.kv_size, d),
              "wv": (L, cfg.kv_size, d), "wo": (L, d, cfg.q_size), "w_gate": (L, i, d), "w_up": (L, i, d),
              "w_down": (L, d, i)}
    key = jax.random.key(0)
    layers = {}
    for n, k in enumerate(layer_keys(cfg)):
        shape = shapes[k]
        layers[k] = (jnp.ones(shape, dtype) if k.endswith("norm") else
                     (0.02 * jax.random.normal(jax.random.fold_in(key, n), shape, jnp.float32)).astype(dtype))
    params = {"embed": (0.02 * jax.random.normal(jax.random.fold_in(key, 100), (v, d))).astype(dtype),
              "lm_head": (0.02 * jax.random.normal(jax.random.fold_in(key, 101), (v, d))).astype(dtype),
              "final_norm": jnp.ones((d,), dtype), "layers": layers}
    return cfg, params


def copy_bandwidth(nbytes: int) -> float:
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    f(x).block_until_ready()
    return 2 * nbytes / median(timed(lambda: f(x).block_until_ready(), 10))  # read + write


def decode_rates(cfg, params, batches, new_tokens: int, prompt_len: int, spec=None,
                 quantize: str = "none") -> dict[int, float]:
    from jaxspec.config import EngineSection
    from jaxspec.engine import Engine, Request
    from jaxspec.sampling_params import SamplingParams

    ecfg = EngineSection(max_batch_size=max(batches), max_context=prompt_len + new_tokens + 32,
                         length_buckets=(prompt_len, 2 * prompt_len, 4 * prompt_len, 8 * prompt_len),
                         layer_loop="scan", quantize=quantize)
    engine = Engine(params, cfg, ecfg, progress=False, spec=spec, benchmark=True)
    rng = np.random.default_rng(1)
    out = {}
    for b in batches:
        reqs = [Request(rng.integers(3, cfg.vocab_size, prompt_len).tolist(), SamplingParams(max_tokens=new_tokens))
                for _ in range(b)]
        engine.generate(reqs)  # compile + warm
        rates = []
        for _ in range(3):
            engine.generate(reqs)
            rates.append(engine.last_timing["new_tokens"] / engine.last_timing["decode_s"])
        out[b] = median(rates)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxspec.bench gpu")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, interpret-mode kernels")
    p.add_argument("--skip", default="", help="comma list of sections to skip: kernels,decode,sweep")
    args = p.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    dry = args.dry_run
    if not dry and jax.default_backend() != "gpu":
        print(f"no GPU backend (found {jax.default_backend()}); nothing to check (use --dry-run on CPU)")
        return 0
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}")
    kernels_ok = True
    if "kernels" not in skip:
        print("\n1. Pallas kernels vs jnp references" + (" (interpret mode)" if dry else " (compiled)"))
        try:
            kernels_ok = check_kernels(interpret=dry, small=dry)
        except Exception:  # report and carry on: later sections still produce numbers
            traceback.print_exc()
            kernels_ok = False

    hf = TINY if dry else LLAMA3_8B
    dtype = jnp.float32 if dry else jnp.bfloat16
    new, plen = (8, 16) if dry else (128, 128)
    if "decode" not in skip or "sweep" not in skip:
        cfg, params = random_model(hf, dtype)
        weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) - params["embed"].nbytes
    if "decode" not in skip:
        try:
            bw = copy_bandwidth(1 << 24 if dry else 1 << 32)
            batches = (1, 4) if dry else (1, 64)
            rates = decode_rates(cfg, params, batches, new, plen)
            roof = bw / weight_bytes
            print(f"\n2. plain decode, {'tiny' if dry else 'Llama-3-8B-shaped'} random weights, {dtype.__name__}, "
                  f"copy bandwidth {bw / 1e9:.0f} GB/s, weights {weight_bytes / 2**30:.2f} GiB")
            # Weight-only int8 through XLA's dot (layers.Int8Weight): about half bfloat16's bytes a step.
            int8 = decode_rates(cfg, params, batches, new, plen, quantize="int8")
            roof8 = bw / (weight_bytes / jnp.dtype(dtype).itemsize)
            print_table(["weights", "batch", "tok/s", "roofline tok/s (weights only)", "of roofline",
                         f"vs {dtype.__name__}"],
                        [[dtype.__name__, b, r, b * roof, f"{100 * r / (b * roof):.0f}%", 1.0] for b, r in rates.items()]
                        + [["int8", b, r, b * roof8, f"{100 * r / (b * roof8):.0f}%", r / rates[b]]
                           for b, r in int8.items()])
        except Exception:
            traceback.print_exc()
    if "sweep" not in skip:
        from jaxspec.config import SpecSection

        try:
            batches = (1, 2) if dry else (1, 32)
            base = decode_rates(cfg, params, batches, new, plen)
            rows = []
            for L in range(1, 9):
                spec = SpecSection(algorithm="ngram", topk=1, num_draft_tokens=9, simulate_accept_length=L)
                rates = decode_rates(cfg, params, batches, new, plen, spec=dataclasses.replace(spec))
                rows.append([L] + [f"{rates[b]:.0f} ({rates[b] / base[b]:.2f}x)" for b in batches])
            print("\n3. synthetic acceptance sweep (n-gram chain of 8, acceptance forced to L; NOT exact)")
            print_table(["L"] + [f"batch {b} tok/s (vs plain)" for b in batches], rows)
        except Exception:
            traceback.print_exc()
    return 0 if kernels_ok else 1
