"""The multi-device half of tests/test_serve_mesh_pages.py, run in a subprocess (8 host devices).

The server's scheduler (no HTTP) with pages split over "data": each case runs on
one device, then under 4x2 and 2x4 meshes, in this process, and the report holds
the tokens, page usage and cache layouts per mesh.

    python tests/serve_mesh_worker.py OUT.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import tempfile
from pathlib import Path

MESHES = ("4x2", "2x4")
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [200, 3, 200, 3, 17], [11, 12, 13, 14, 11, 12, 13, 14, 11], [99],
           [7, 7, 7, 7], [30, 31, 32, 30, 31, 32, 30], [1, 2, 3], [150, 151, 152, 153, 154, 155, 156, 157]]
# Arrivals: how many sequences join before each scheduler step (rows join while others run).
WAVES = (3, 0, 2, 1, 0, 2)


def config(model_dir: Path, **extra):
    from jaxspec.config import apply_overrides, load_config

    return apply_overrides(load_config(None), {
        "model.path": str(model_dir), "spec.verify": "rejection", "serve.adaptive": False,
        "engine.max_batch_size": 8, "engine.batch_buckets": "8", "engine.layer_loop": "scan",
        "engine.max_context": 64, "engine.page_size": 4,
        "engine.length_buckets": "16,64", "serve.context_buckets": "64", "serve.prefill_chunk": 16,
        "serve.max_prefill_batch": 4, "serve.steps_per_call": 3, "serve.compilation_cache": "off", **extra})


CASES = {
    "plain": {"spec.algorithm": "none"},
    "ngram": {"spec.algorithm": "ngram", "spec.num_draft_tokens": 4},
    # 13 pages per data shard (`main`): 12 usable, 48 slots, so the longest row just fits and eight
    # rows of 28 new tokens outgrow every shard's pool.
    "preempt": {"spec.algorithm": "ngram", "spec.num_draft_tokens": 4},
}


def run_case(server, new) -> dict:
    import jax

    from jaxspec.sampling_params import SamplingParams
    from jaxspec.serve.scheduler import Seq, Status

    sched, got, seqs, shards, first_shard = server.scheduler, {}, [], {}, {}
    pending = list(range(len(PROMPTS)))
    waves = list(WAVES)
    for _ in range(10_000):
        for _ in range(waves.pop(0) if waves else len(pending)):
            if pending:
                i = pending.pop(0)
                assert sched.check(len(PROMPTS[i]), SamplingParams(max_tokens=new[i])) is None
                seqs.append(Seq(list(PROMPTS[i]), SamplingParams(max_tokens=new[i]),
                                lambda e, i=i: got.setdefault(i, []).extend(e.token_ids)))
                sched.submit(seqs[-1])
        if not pending and all(s.status == Status.FINISHED for s in seqs):
            break
        sched.step()
        for s in sched.prefilling + sched.running:  # pinned: one shard for the whole stay
            assert shards.setdefault((s.seq_id, s.num_preemptions), s.shard) == s.shard
            first_shard.setdefault(next(i for i, q in enumerate(seqs) if q is s), s.shard)

    k = server.runner.cache.k
    return {
        "tokens": [got.get(i, []) for i in range(len(PROMPTS))],
        "finish": [s.finish_reason for s in seqs],
        "pages_used": server.runner.allocator.num_used,
        "preemptions": sum(s.num_preemptions for s in seqs),
        "split": server.runner.split_pages,
        "shards_used": len({d for d in shards.values()}),
        "cache_spec": str(getattr(k.sharding, "spec", None)),
        "cache_pages": [k.shape[1], k.addressable_shards[0].data.shape[1]],
        "store_spec": [str(getattr(x.sharding, "spec", None)) for x in jax.tree.leaves(server.runner.store[1])],
        "batch_buckets": list(server.runner.batch_buckets), "prefill_batches": list(server.runner.prefill_batches),
        "first_shard": [first_shard.get(i) for i in range(len(seqs))], "cached": [s.cached_tokens for s in seqs],
    }


def main(out_path: str) -> None:
    import jax

    from jaxspec.models.loading import load_model
    from jaxspec.mesh import make_mesh
    from jaxspec.serve.server import build_server
    from tests.heads_fixtures import write_eagle3_head
    from tests.mesh_worker import AWKWARD, write_tiny_checkpoint

    report = {"devices": jax.device_count()}
    new = [14 + 2 * i for i in range(len(PROMPTS))]  # rows leave at different steps
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # SmolLM2's awkward 9 q / 3 kv heads, MLP 90: TP 2 and 4 zero-pad them, as with the embedded model.
        write_tiny_checkpoint(tmp / "tiny", AWKWARD)
        model = load_model(str(tmp / "tiny"), progress=False)
        cases = dict(CASES)
        # The head's own attention is not padded for TP: 8 q / 4 kv heads divide 2 and 4.
        head_cfg = dataclasses.replace(model.config, num_heads=8, num_kv_heads=4)
        eagle = write_eagle3_head(tmp / "eagle3", head_cfg, layer_ids=[0, 1, 2], convention="input")
        cases["eagle3"] = {"spec.algorithm": "eagle3", "spec.draft_model": str(eagle), "spec.eagle3_layer_ids": "input",
                           "spec.num_draft_tokens": 3}
        for name, extra in cases.items():
            rows = {}
            for shape in ("single",) + MESHES:
                t0 = time.perf_counter()
                if name == "preempt":
                    extra = {**extra, "engine.num_pages": 13 * (1 if shape == "single" else int(shape[0]))}
                try:
                    server = build_server(config(tmp / "tiny", **extra), model=model, progress=False,
                                          mesh=None if shape == "single" else make_mesh(shape))
                    rows[shape] = run_case(server, [28] * len(PROMPTS) if name == "preempt" else new)
                    if (name, shape) == ("ngram", "4x2"):
                        # The prefix cache per data shard: the same prompts again on this server hit
                        # the first round's pages, each on the shard that holds them.
                        report["prefix_4x2"] = [rows[shape], run_case(server, new)]
                except Exception as e:  # noqa: BLE001 - the report says which case failed and why
                    rows[shape] = {"error": f"{type(e).__name__}: {e}"}
                print(f"{name} {shape}: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
            report[name] = rows
        # The switch: one replicated pool under a mesh still serves the same tokens.
        server = build_server(config(tmp / "tiny", **CASES["ngram"]), model=model, progress=False,
                              mesh=make_mesh("4x2"), split_pages=False)
        report["replicated_4x2"] = run_case(server, new)
    Path(out_path).write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
