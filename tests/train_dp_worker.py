"""The multi-device half of tests/test_train.py::test_data_parallel_equals_one_device.

Run with XLA_FLAGS=--xla_force_host_platform_device_count=4: trains a tiny EAGLE-3 and a Medusa
head for a few steps on one device and with data_parallel = 4, in one process on the same CPU
backend, and writes how far the two sets of weights are apart (a reduction reordered over
shards, so close, not bitwise).

    python tests/train_dp_worker.py OUT.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(out: str) -> None:
    from jaxspec.config import ConfigValueError
    from jaxspec.models.loading import load_model
    from jaxspec.train import trainer as tr
    from tests.conftest import make_tiny_hf

    tmp = Path(tempfile.mkdtemp())
    make_tiny_hf("llama", num_hidden_layers=4).save_pretrained(tmp / "target")
    model = load_model(str(tmp / "target"), progress=False)
    h, v, t, n = model.config.hidden_size, model.config.vocab_size, 24, 32
    rng = np.random.default_rng(0)
    rows = {"tokens": rng.integers(3, v, (n, t)).astype(np.int32), "lengths": np.full(n, t, np.int32),
            "loss_mask": np.arange(t)[None].repeat(n, 0) >= 6,
            "aux": rng.standard_normal((n, t, 3 * h)).astype(np.float16),
            "final": rng.standard_normal((n, t, h)).astype(np.float16)}
    source = tr.ArraySource(rows)
    seen: list[int] = []
    place = tr._place

    def spy(tree, mesh, rows_axis):
        placed = place(tree, mesh, rows_axis)
        if mesh is not None:
            seen.append(len(jax.tree.leaves(placed)[0].sharding.device_set))
        return placed

    tr._place = spy
    report = {}
    for kind in ("eagle3", "medusa"):
        cfg = tr.TrainConfig(drafter=kind, lr=3e-3, warmup_ratio=0.0, total_steps=4, batch_size=8, max_len=t,
                             ttt_length=2, draft_vocab_size=64, feature_layers=(1, 2, 3), num_medusa_heads=2,
                             medusa_head="target", log_every=1, save_every=100)
        init = tr.init_train_params(tr.make_head_config(cfg, model.config), tr.shared_target(model), cfg.seed,
                                    None if kind != "eagle3" else np.arange(64))
        one = tr.train(cfg, model, source, tmp / f"{kind}1", progress=False, export=False)
        seen.clear()
        dp = tr.train(dataclasses.replace(cfg, data_parallel=4), model, source, tmp / f"{kind}4", progress=False,
                      export=False)
        a, b = jax.tree.leaves(one.params), jax.tree.leaves(dp.params)
        rel = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / (np.max(np.abs(np.asarray(x))) + 1e-12))
                  for x, y in zip(a, b))
        moved = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, jax.tree.leaves(init)))
        report[kind] = {"max_rel_diff": rel, "moved": moved, "batch_devices": max(seen, default=0),
                        "param_devices": min(seen, default=0)}
    try:
        tr.data_mesh(8)
        report["too_many"] = ""
    except ConfigValueError as e:
        report["too_many"] = str(e)
    Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
