"""The server's KV pages split over "data" (`build_server(mesh=...)`, the default with data > 1).

Each sequence is pinned to one data shard, takes its pages from that shard's pool
and its batch rows from that shard's slice of every bucket. Greedy tokens through
the scheduler under 4x2 and 2x4 meshes (8 host devices, in a subprocess:
tests/serve_mesh_worker.py) must equal one device's, with rows joining and
leaving, through preemption, for plain, n-gram and EAGLE-3 decoding; each device
holds 1/data of the pages. The layout logic itself is checked here on one device.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.xla_env import subprocess_env

ROOT = Path(__file__).resolve().parent.parent
MESHES = ("4x2", "2x4")
CASES = ("plain", "ngram", "preempt", "eagle3")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve_mesh") / "report.json"
    env = subprocess_env(8, PYTHONPATH=str(ROOT))
    env.pop("JAXSPEC_KERNELS", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "serve_mesh_worker.py"), str(out)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_split_pages_serve_equals_single_device(report, case):
    assert report["devices"] == 8
    rows = report[case]
    single = rows["single"]
    assert "error" not in single, single
    assert all(len(t) > 0 for t in single["tokens"]) and set(single["finish"]) == {"length"}
    for shape in MESHES:
        got = rows[shape]
        assert "error" not in got, (shape, got)
        assert got["tokens"] == single["tokens"], shape
        assert got["split"] and got["pages_used"] == 0, shape
        assert got["shards_used"] == int(shape.split("x")[0]), shape  # every shard served rows
        assert all(b % int(shape.split("x")[0]) == 0 for b in got["batch_buckets"] + got["prefill_batches"])


def test_preemption_happens_per_shard(report):
    """Each shard's pool runs dry on its own: rows are preempted and recomputed, tokens still equal."""
    for shape in ("single",) + MESHES:  # 13 pages per shard everywhere (one device: 13 in all)
        assert report["preempt"][shape]["preemptions"] > 0, shape


@pytest.mark.parametrize("case", CASES)
def test_each_device_holds_its_shard_of_the_pages(report, case):
    for shape in MESHES:
        got = report[case][shape]
        total, local = got["cache_pages"]
        assert local * int(shape.split("x")[0]) == total, shape
        assert got["cache_spec"] == "P(None, 'data', None, 'model')", shape
        # The drafter-state store splits over "data" too (each shard its own slots).
        assert all(s == "PartitionSpec('data',)" or s.startswith("P('data'") for s in got["store_spec"]), got


def test_prefix_cache_per_shard_hits_on_the_shard_that_holds_it(report):
    first, second = report["prefix_4x2"]
    assert first["tokens"] == second["tokens"] == report["ngram"]["single"]["tokens"]
    # Five prompts have a full page and its lookahead token; a shard's pool only hits its own pages,
    # so a hit means the scheduler sent the prompt back to the shard that cached it (two batch
    # slots per shard may send some elsewhere).
    assert sum(first["cached"]) == 0 and sum(c > 0 for c in second["cached"]) >= 3
    assert all(c % 4 == 0 for c in second["cached"]) and second["pages_used"] == 0


def test_replicated_pool_switch_still_exact(report):
    got = report["replicated_4x2"]
    assert not got["split"] and got["tokens"] == report["ngram"]["single"]["tokens"]
    total, local = got["cache_pages"]
    assert local == total and got["cache_spec"] == "P(None, None, None, 'model')"


# ---- one device: the batch layout ---------------------------------------------------------


def test_place_lays_rows_out_by_shard():
    from jaxspec.engine.runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    runner.split_pages, runner.num_shards = True, 4
    # Shard 2 has two rows: bucket 8 gives every shard 2 positions.
    assert runner.place([2, 0, 2, 3], (4, 8)) == [1, None, None, None, 0, 2, 3, None]
    assert runner.place([1, 3], (4, 8)) == [None, 0, None, 1]
    with pytest.raises(ValueError, match="3 rows on one data shard"):
        runner.place([0, 0, 0], (4, 8))
    runner.split_pages, runner.num_shards = False, 1
    assert runner.place([0, 0, 0], (4, 8)) == [0, 1, 2]


def test_rows_on_the_wrong_shard_are_refused():
    import numpy as np

    from jaxspec.engine.runner import ModelRunner, RowInput

    runner = ModelRunner.__new__(ModelRunner)
    runner.split_pages, runner.num_shards = True, 2
    row = RowInput(tokens=[1, 2], prompt_len=2, page_row=np.zeros(4, np.int32), slot=0, shard=1)
    runner._check_shard(2, 4, row)
    with pytest.raises(ValueError, match="batch row 1 of 4 runs on data shard 0"):
        runner._check_shard(1, 4, row)
