"""The multi-device half of tests/test_mesh.py, run in a subprocess.

XLA's host device count is fixed when JAX starts, so the test starts this
script with XLA_FLAGS=--xla_force_host_platform_device_count=8 and reads back
one JSON report. Single-device references are computed here too, in the same
process and on the same (CPU) backend, so equality is exact.

    python tests/mesh_worker.py OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MESHES = ("4x2", "2x4", "8x1")
# Speculation and the server run on the meshes that split the model; 8x1 (data only) is plain's.
SPLIT_MESHES = ("4x2", "2x4")
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [200, 3, 200, 3, 17], [11, 12, 13, 14, 11, 12, 13, 14, 11], [99]]
NEW = 12
# Heads 8 / kv heads 4 / MLP 128 divide by every TP size used; qkv bias and q/k
# norms on (Qwen3 with attention_bias) so every sharding rule is exercised.
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 8, "max_position_embeddings": 256, "attention_bias": True, "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
}


# SmolLM2's awkward 9 query / 3 KV heads, and an MLP width 4 and 8 do not divide: no TP size > 1
# fits without the Engine's zero-padding (jaxspec.models.padding).
AWKWARD = {**CONFIG, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 90}


def write_tiny_checkpoint(path: Path, config: dict = CONFIG) -> None:
    """Random HF-format weights (no torch needed), LM head sharpened like tests/conftest.py does."""
    from safetensors.numpy import save_file

    from jaxspec.models.config import HF_LAYER_KEYS, ModelConfig, layer_keys
    from jaxspec.models.loading import expected_shapes

    cfg = ModelConfig.from_hf_dict(config)
    rng = np.random.default_rng(0)
    normal = lambda *s: rng.normal(0.0, 0.1, s).astype(np.float32)  # noqa: E731
    d, v = cfg.hidden_size, cfg.vocab_size
    tensors = {"model.embed_tokens.weight": normal(v, d), "model.norm.weight": np.ones(d, np.float32),
               "lm_head.weight": 8.0 * normal(v, d)}
    for n in range(cfg.num_layers):
        for key in layer_keys(cfg):
            shape = expected_shapes(cfg)[key]
            value = 1.0 + normal(*shape) if key.endswith("norm") else normal(*shape)
            tensors[f"model.layers.{n}.{HF_LAYER_KEYS[key]}"] = value
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


def make_engine(model, mesh, spec, layer_loop="auto"):
    from jaxspec.config import EngineSection, SpecSection
    from jaxspec.engine import Engine

    ecfg = EngineSection(max_batch_size=4, max_context=64, length_buckets=(16, 32, 64), page_size=4,
                         layer_loop=layer_loop)
    spec = SpecSection(**spec) if spec else None
    return Engine(model.params, model.config, ecfg, progress=False, spec=spec, mesh=mesh)


def count_compiles(fn) -> int:
    from tests.reference import compile_events

    return len(compile_events(fn))


def engines_report(model) -> dict:
    """Greedy outputs per mesh and mode, plus layouts and recompile counts."""
    from jaxspec.engine import Request
    from jaxspec.sampling_params import SamplingParams
    from jaxspec.mesh import make_mesh

    modes = {"plain": None, "ngram": {"algorithm": "ngram", "topk": 2, "num_steps": 3, "num_draft_tokens": 8}}
    reqs = [Request(p, SamplingParams(max_tokens=NEW)) for p in PROMPTS]
    # Same (batch 4, prompt <= 16, context <= 32) bucket, other contents.
    again = [Request(list(reversed(p)), SamplingParams(max_tokens=NEW - 3)) for p in PROMPTS]
    report = {}
    for mode, spec in modes.items():
        single = make_engine(model, None, spec)
        res = single.generate(reqs)
        rows = {"single": [r.output_ids for r in res], "single_accept": [r.accept_lengths for r in res],
                "single_again": [r.output_ids for r in single.generate(again)]}
        rows["meshes"] = list(MESHES if mode == "plain" else SPLIT_MESHES)
        for shape in rows["meshes"]:
            engine = make_engine(model, make_mesh(shape), spec)
            res = engine.generate(reqs)
            rows[shape] = [r.output_ids for r in res]
            rows[f"{shape}_accept"] = [r.accept_lengths for r in res]
            box = {}
            rows[f"{shape}_compiles_again"] = count_compiles(lambda: box.update(out=engine.generate(again)))
            rows[f"{shape}_again"] = [r.output_ids for r in box["out"]]
            layers = engine.runner.params["layers"]
            layer0 = layers[0] if isinstance(layers, list) else layers  # unstacked on CPU
            rows[f"{shape}_specs"] = {
                "cache": str(engine.runner.cache.k.sharding.spec), "wq": str(layer0["wq"].sharding.spec),
                "wo": str(layer0["wo"].sharding.spec), "bk": str(layer0["bk"].sharding.spec),
                "head": str(engine.runner.params["head"].sharding.spec), "embed": str(engine.runner.params["embed"].sharding.spec),
            }
            rows[f"{shape}_pages_used"] = engine.runner.allocator.num_used
            # Pages split over "data": each device holds 1/data of the page axis.
            rows[f"{shape}_cache_pages"] = [engine.runner.cache.k.shape[1], engine.runner.cache.k.addressable_shards[0].data.shape[1]]
            if shape == "2x4" and mode == "plain":
                # Stacked [L, ...] layers under lax.scan: the GPU/TPU layout.
                scan = make_engine(model, make_mesh(shape), spec, layer_loop="scan")
                rows["2x4_scan"] = [r.output_ids for r in scan.generate(reqs)]
                rows["2x4_scan_wq"] = str(scan.runner.params["layers"]["wq"].sharding.spec)
            if shape == "4x2" and mode == "plain":
                hlo = engine.runner._compiled[next(k for k in engine.runner._compiled if k[0] == "decode")].as_text()
                rows["4x2_decode_all_reduce"] = "all-reduce" in hlo
                # The listener does see compiles when a new bucket is needed (not vacuous).
                rows["4x2_compiles_new_bucket"] = count_compiles(
                    lambda: engine.generate([Request(PROMPTS[0], SamplingParams(max_tokens=40))]))
        report[mode] = rows
    return report


def int8_report(model) -> dict:
    """Weight-only int8 on XLA's dot (`layers.Int8Weight`) under a 4x2 mesh equals one device's."""
    from jaxspec.config import EngineSection, SpecSection
    from jaxspec.engine import Engine, Request
    from jaxspec.mesh import make_mesh
    from jaxspec.sampling_params import SamplingParams

    reqs = [Request(p, SamplingParams(max_tokens=NEW)) for p in PROMPTS]
    out = {}
    # n-gram on 4x2 only: its reference is plain on one device (speculation is exact), and its verify
    # and decode run the same int8 forward a plain 4x2 engine would (one engine less to compile).
    for mode, spec, shapes in (("plain", None, (None,)),
                               ("ngram", SpecSection(algorithm="ngram", num_draft_tokens=4), ("4x2",))):
        for shape in shapes:
            ecfg = EngineSection(max_batch_size=4, max_context=64, length_buckets=(16, 32, 64), page_size=4,
                                 quantize="int8", cpu_kernels="xla")
            engine = Engine(model.params, model.config, ecfg, progress=False, spec=spec,
                            mesh=make_mesh(shape) if shape else None)
            out[f"{mode}_{shape or 'single'}"] = [r.output_ids for r in engine.generate(reqs)]
            if shape:
                layers = engine.runner.params["layers"]
                wq = (layers[0] if isinstance(layers, list) else layers)["wq"]
                out["specs"] = [str(wq.q.sharding.spec), str(wq.scale.sharding.spec), str(wq.q.dtype)]
    return out


def standalone_report(model) -> dict:
    """The standalone drafter's own paged cache splits over "data" too: 4x2 equals one device."""
    from jaxspec.config import EngineSection, SpecSection
    from jaxspec.engine import Engine, Request
    from jaxspec.sampling_params import SamplingParams
    from jaxspec.mesh import make_mesh
    from jaxspec.speculative.drafters.standalone import truncate_layers

    ecfg = EngineSection(max_batch_size=4, max_context=64, length_buckets=(16, 32, 64), page_size=4)
    spec = SpecSection(algorithm="standalone", topk=2, num_steps=2, num_draft_tokens=5)
    draft = truncate_layers(model.params, model.config, 1)
    out = {}
    for shape in ("single", "4x2"):
        engine = Engine(model.params, model.config, ecfg, progress=False, spec=spec, draft=draft,
                        mesh=None if shape == "single" else make_mesh(shape))
        out[shape] = [r.output_ids for r in engine.generate([Request(p, SamplingParams(max_tokens=6))
                                                             for p in PROMPTS])]
        out[f"{shape}_draft_cache"] = str(getattr(engine.runner.draft_cache.k.sharding, "spec", None))
    return out


def padding_report(model_dir: Path, tmp: Path) -> dict:
    """The CLI on a 9 q / 3 kv head model (MLP 90) under 2x4: heads and MLP columns are zero-padded,
    not refused. (Tensor-parallel 2 pads the heads only: embedded_serve_report's SmolLM2 under 4x2.)

    Not --quiet, so the start-up line reporting the padding is captured too."""
    import contextlib
    import io

    out = {}
    for shape in ("single", "2x4"):  # 8x1 splits no heads: "single" checks the unpadded run
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            res = cli_report(model_dir, tmp, None if shape == "single" else shape, quiet=False)
        out[shape] = res["outputs"] if res["rc"] == 0 else {"rc": res["rc"], "stderr": err.getvalue()[-2000:]}
        out[f"{shape}_stderr"] = [line for line in err.getvalue().splitlines() if "pads" in line or "padding" in line]
    return out


def kernel_report() -> dict:
    """The Pallas attention kernel (interpret mode) per shard under a mesh equals the reference."""
    import jax
    import jax.numpy as jnp

    from jaxspec.cache.attention import paged_attention, paged_attention_ref
    from jaxspec import mesh as shd

    os.environ["JAXSPEC_KERNELS"] = "interpret"
    mesh = shd.make_mesh("2x4")
    rng = np.random.default_rng(1)
    out = {}
    for name, b, t, tree in (("causal_b4", 4, 3, False), ("tree_b1", 1, 4, True)):
        h, kvh, hd, pages, ps = 8, 4, 16, 12, 4
        q = jnp.asarray(rng.normal(size=(b, t, h, hd)), jnp.float32)
        k = jnp.asarray(rng.normal(size=(pages, ps, kvh, hd)), jnp.float32)
        v = jnp.asarray(rng.normal(size=(pages, ps, kvh, hd)), jnp.float32)
        table = jnp.asarray(rng.permutation(np.arange(1, pages))[: b * 2].reshape(b, 2), jnp.int32)
        q_start = jnp.full((b,), 4, jnp.int32)
        kv_len = q_start + t
        mask = jnp.asarray(np.tril(rng.random((b, t, t)) < 0.6) | np.eye(t, dtype=bool)) if tree else None
        args = (q, k, v, table, q_start, kv_len, mask)
        fn = jax.jit(lambda *a: paged_attention(*a, scale=hd**-0.5))
        # Inputs laid out as in the engine: heads over "model".
        heads = jax.sharding.NamedSharding(mesh, jax.P(None, None, "model", None))
        placed = (jax.device_put(q, heads), jax.device_put(k, heads), jax.device_put(v, heads), *args[3:])
        with shd.mesh_context(mesh):
            got = fn(*placed)
            text = str(jax.make_jaxpr(fn)(*placed))
        want = paged_attention_ref(*args, scale=hd**-0.5)
        out[name] = {"max_err": float(jnp.max(jnp.abs(got - want))), "shard_map": "shard_map" in text}
    # The row kernels (tree build, greedy verify) run per shard too (`shard_kernel_rows`).
    from jaxspec.speculative.tree import build_tree, build_tree_ref
    from jaxspec.speculative.verify import verify_greedy, verify_greedy_ref

    b, n = 4, 6
    tokens = jnp.asarray(rng.integers(1, 50, (b, n)), jnp.int32)
    parents = jnp.asarray(np.stack([[-1] + [int(rng.integers(0, i)) for i in range(1, n)] for _ in range(b)]),
                          jnp.int32)
    prefix = jnp.asarray([3, 5, 0, 7], jnp.int32)
    # The target "predicts" each node's first child, so verification accepts a whole path.
    tok, par = np.asarray(tokens), np.asarray(parents)
    pred = jnp.asarray([[next((tok[r, j] for j in range(n) if par[r, j] == i), 0) for i in range(n)]
                        for r in range(b)], jnp.int32)

    def rows(tree_fn, verify_fn):
        info = tree_fn(tokens, parents, prefix)
        res = verify_fn(tokens, info.retrieve_next_token, info.retrieve_next_sibling, pred, max_depth=n - 1)
        return info.positions, info.retrieve_next_token, res.accept_index, res.bonus_token

    kernel_fn = jax.jit(lambda: rows(build_tree, verify_greedy))
    with shd.mesh_context(mesh):
        got = kernel_fn()
        text = str(jax.make_jaxpr(kernel_fn)())
    want = rows(build_tree_ref, verify_greedy_ref)
    out["rows_b4"] = {"max_err": float(max(jnp.max(jnp.abs(g - w)) for g, w in zip(got, want))),
                      "shard_map": text.count("shard_map") >= 2, "accepted": int(jnp.sum(want[2][:, 1:] >= 0))}
    os.environ.pop("JAXSPEC_KERNELS")
    return out


def cli_report(model_dir: Path, tmp: Path, mesh: str | None = "2x4", quiet: bool = True) -> dict:
    from jaxspec.generate import main

    prompts = tmp / "in.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    out = tmp / "out.jsonl"
    argv = ["--model", str(model_dir), "--prompts", str(prompts), "--output", str(out),
            "--max-new-tokens", str(NEW), "--ignore-eos", "--batch-size", "4", "--page-size", "4",
            "--max-context", "64", "--set", "engine.length_buckets=16,32,64"]
    argv += ["--quiet"] if quiet else []
    argv += ["--mesh", mesh] if mesh else []
    rc = main(argv)
    rows = [json.loads(line)["output_ids"] for line in out.read_text().splitlines()] if rc == 0 else []
    return {"rc": rc, "outputs": rows}


def embedded_serve_report() -> dict:
    """The embedded SmolLM2-135M (9 q / 3 kv heads) through the server's scheduler, one device vs 4x2.

    A few tokens and stacked layers (fewer HLO ops to compile) keep it short."""
    from jaxspec.config import apply_overrides, load_config
    from jaxspec.models.loading import load_model
    from jaxspec.mesh import make_mesh
    from jaxspec.sampling_params import SamplingParams
    from jaxspec.serve.scheduler import Seq
    from jaxspec.serve.server import build_server

    cfg = apply_overrides(load_config(None), {
        "model.path": "default", "spec.algorithm": "ngram", "spec.num_draft_tokens": 3, "serve.adaptive": False,
        "engine.max_batch_size": 4, "engine.batch_buckets": "4", "engine.max_context": 32, "engine.page_size": 8,
        "engine.length_buckets": "16,32", "serve.context_buckets": "32", "serve.prefill_chunk": 16,
        "serve.max_prefill_batch": 4, "serve.steps_per_call": 2, "engine.layer_loop": "scan"})
    model = load_model("default", progress=False)
    prompts = [model.tokenizer.encode(t) for t in ("The cat sat on the mat. The cat sat on the", "1, 2, 3, 4,")]
    out = {}
    for shape in ("single", "4x2"):
        server = build_server(cfg, mesh=None if shape == "single" else make_mesh(shape), progress=False, model=model)
        got, seqs = {}, []
        for i, p in enumerate(prompts):
            seqs.append(Seq(p, SamplingParams(max_tokens=5), lambda e, i=i: got.setdefault(i, []).extend(e.token_ids)))
            server.scheduler.submit(seqs[-1])
        while any(s.finish_reason is None for s in seqs):
            server.scheduler.step()
        out[shape] = [got[i] for i in range(len(seqs))]
        out[f"{shape}_heads"] = [server.runner.cfg.num_heads, server.runner.cfg.num_kv_heads]
    return out


def main(out_path: str) -> None:
    import jax

    from jaxspec.models.loading import load_model

    report = {"devices": jax.device_count(), "seconds": {}}

    def part(name, fn, *args):  # seconds per part, so the slow ones show when the suite is trimmed
        t0 = time.perf_counter()
        report[name] = fn(*args)
        report["seconds"][name] = round(time.perf_counter() - t0, 1)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_tiny_checkpoint(tmp / "tiny")
        model = load_model(str(tmp / "tiny"), progress=False)
        part("engines", engines_report, model)
        part("standalone", standalone_report, model)
        part("int8", int8_report, model)
        part("kernel", kernel_report)
        part("cli", cli_report, tmp / "tiny", tmp)
        write_tiny_checkpoint(tmp / "awkward", AWKWARD)
        part("padding", padding_report, tmp / "awkward", tmp)
        part("embedded", embedded_serve_report)
    Path(out_path).write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
