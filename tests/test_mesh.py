"""Device-mesh sharding (`--mesh DPxTP`, jaxspec.mesh).

Greedy outputs must equal single-device outputs: plain decoding under 4x2, 2x4
and 8x1 meshes, n-gram speculation under the model-splitting 4x2 and 2x4 (8x1
splits only the batch, which plain covers). The server's scheduler under meshes
is tests/test_serve_mesh_pages.py's (plus the embedded model here). Eight host devices need XLA_FLAGS
before JAX starts, so that part runs once in a subprocess (tests/mesh_worker.py)
that also computes the single-device reference; the tests below read its report.
Argument and validation errors are checked here, on the one default device.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxspec import mesh as shd
from jaxspec.models.config import ModelConfig
from tests.xla_env import subprocess_env

ROOT = Path(__file__).resolve().parent.parent
MESHES = ("4x2", "2x4", "8x1")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh") / "report.json"
    env = subprocess_env(8, PYTHONPATH=str(ROOT))
    env.pop("JAXSPEC_KERNELS", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "mesh_worker.py"), str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["plain", "ngram"])
def test_greedy_under_mesh_equals_single_device(report, mode):
    assert report["devices"] == 8
    rows = report["engines"][mode]
    assert rows["meshes"] == (list(MESHES) if mode == "plain" else ["4x2", "2x4"])  # 8x1: plain's only
    for shape in rows["meshes"]:
        assert rows[shape] == rows["single"], f"{mode} {shape}"
        assert rows[f"{shape}_again"] == rows["single_again"], f"{mode} {shape} second call"
        assert rows[f"{shape}_pages_used"] == 0
        if mode == "ngram":
            assert rows[f"{shape}_accept"] == rows["single_accept"]
    if mode == "ngram":  # the repetitive prompt gets multi-token accepts, so verify paths really ran
        assert max(max(a) for a in rows["single_accept"]) > 1


def test_params_and_cache_layouts(report):
    specs = report["engines"]["plain"]["2x4_specs"]
    assert specs["cache"] == "P(None, 'data', None, 'model')"  # pages over "data", KV heads over "model"
    assert specs["wq"] == "P(None, 'model')"  # column split: [in, out]
    assert specs["wo"] == "P('model', None)"  # row split
    assert specs["bk"] == "P('model',)"
    assert specs["head"] == "P(None, 'model')"  # vocab split
    assert specs["embed"] == "P()"
    assert report["engines"]["plain"]["4x2_decode_all_reduce"], "row-split layers must all-reduce"


def test_int8_under_mesh_equals_single_device(report):
    """Weight-only int8 through XLA's dot: the column-split matrices keep their scales with their
    columns, and n-gram speculation on 4x2 (its verify and decode the int8 forward) decodes what plain
    decoding does on one device."""
    rows = report["int8"]
    assert rows["ngram_4x2"] == rows["plain_single"]
    assert rows["specs"] == ["P(None, 'model')", "P('model',)", "int8"]


def test_pages_split_over_data(report):
    """Each device holds 1/data of the page axis (one pool per data shard, each with its null page)."""
    for mode in ("plain", "ngram"):
        for shape in report["engines"][mode]["meshes"]:
            total, local = report["engines"][mode][f"{shape}_cache_pages"]
            assert local * int(shape.split("x")[0]) == total, (mode, shape)
    rows = report["standalone"]
    assert rows["4x2"] == rows["single"] and all(len(r) == 6 for r in rows["single"])
    assert rows["4x2_draft_cache"] == "P(None, 'data', None, 'model')"


def test_stacked_layers_under_mesh(report):
    rows = report["engines"]["plain"]
    assert rows["2x4_scan_wq"] == "P(None, None, 'model')"  # [L, in, out]
    assert rows["2x4_scan"] == rows["single"]


def test_second_generate_under_mesh_does_not_recompile(report):
    for mode in ("plain", "ngram"):
        for shape in report["engines"][mode]["meshes"]:
            assert report["engines"][mode][f"{shape}_compiles_again"] == 0, f"{mode} {shape}"
    assert report["engines"]["plain"]["4x2_compiles_new_bucket"] > 0, "the listener would be vacuous"


def test_pallas_attention_runs_per_shard_under_mesh(report):
    for case in ("causal_b4", "tree_b1", "rows_b4"):  # batch 4 splits over "data"; batch 1 is replicated
        assert report["kernel"][case]["shard_map"], case
        assert report["kernel"][case]["max_err"] < 1e-5, case
    assert report["kernel"]["rows_b4"]["accepted"] > 0  # verification really walked the trees


def test_cli_mesh_flag(report):
    assert report["cli"]["rc"] == 0
    assert report["cli"]["outputs"] == report["engines"]["plain"]["single"]


def test_awkward_heads_are_padded_through_the_cli(report):
    """9 q / 3 kv heads and MLP 90 under 2x4: zero-padded heads and MLP columns, same greedy tokens as one
    device (tensor-parallel 2's head padding: test_embedded_model_serves_under_4x2)."""
    rows = report["padding"]
    assert isinstance(rows["single"], list) and all(len(r) > 0 for r in rows["single"]), rows["single"]
    assert rows["2x4"] == rows["single"]
    assert len(rows["2x4_stderr"]) == 1 and rows["2x4_stderr"][0].startswith(
        "jaxspec: model: tensor-parallel size 4 pads +3 query heads (9 -> 12) and +1 KV heads (3 -> 4)")
    assert "+2 MLP columns (90 -> 92)" in rows["2x4_stderr"][0] and "(zero weights: outputs unchanged)" in rows["2x4_stderr"][0]
    assert rows["single_stderr"] == []


def test_embedded_model_serves_under_4x2(report):
    """SmolLM2-135M through the server's scheduler (n-gram speculation) on a 4x2 mesh equals one device."""
    rows = report["embedded"]
    assert rows["4x2"] == rows["single"] and all(len(r) == 5 for r in rows["single"])
    assert rows["single_heads"] == [9, 3] and rows["4x2_heads"] == [12, 4]


def test_two_processes_share_one_mesh(report, tmp_path):
    """--coordinator/--num-processes/--process-id: two CPU processes x 2 host devices form one 2x2
    mesh (gloo collectives); each writes the single-device output."""
    import socket

    from tests.mesh_worker import NEW, PROMPTS, write_tiny_checkpoint

    write_tiny_checkpoint(tmp_path / "tiny")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = subprocess_env(2)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jaxspec.generate", "--model", str(tmp_path / "tiny"),
         "--prompts", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / f"out{i}.jsonl"), "--quiet",
         "--max-new-tokens", str(NEW), "--ignore-eos", "--batch-size", "4", "--page-size", "4",
         "--max-context", "64", "--set", "engine.length_buckets=16,32,64", "--mesh", "2x2",
         "--coordinator", f"localhost:{port}", "--num-processes", "2", "--process-id", str(i)],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
    finally:  # one failed process leaves the other waiting for its peer
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for i in range(2):
        rows = [json.loads(line)["output_ids"] for line in (tmp_path / f"out{i}.jsonl").read_text().splitlines()]
        assert rows == report["engines"]["plain"]["single"], f"process {i}"


# ---- single-device checks ----------------------------------------------------------


def test_mesh_shape_parse():
    assert shd.MeshShape.parse("4x2") == shd.MeshShape(4, 2)
    assert shd.MeshShape.parse(" 1X8 ").size == 8
    assert str(shd.MeshShape(2, 4)) == "2x4"
    for bad in ("4x", "0x2", "2x0", "abc", "4x2x1", "-1x2", ""):
        with pytest.raises(shd.MeshError, match=f"mesh '{bad}'"):
            shd.MeshShape.parse(bad)


def test_make_mesh_checks_device_count():
    one = jax.devices()[:1]
    with pytest.raises(shd.MeshError, match=r"needs 4 devices .* but 1 are available"):
        shd.make_mesh("2x2", devices=one)
    mesh = shd.make_mesh("1x1", devices=one)
    assert mesh.axis_names == ("data", "model") and mesh.devices.shape == (1, 1)


def test_validate_for_model_names_the_quantity():
    cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=1,
                      num_heads=8, num_kv_heads=2, head_dim=8)
    shd.validate_for_model(shd.MeshShape(8, 2), cfg)
    with pytest.raises(shd.MeshError, match="num_kv_heads = 2 .* axis size 4"):
        shd.validate_for_model(shd.MeshShape(1, 4), cfg)
    with pytest.raises(shd.MeshError, match="num_heads = 8 .* axis size 16"):
        shd.validate_for_model(shd.MeshShape(1, 16), dataclasses.replace(cfg, num_kv_heads=16))
    with pytest.raises(shd.MeshError, match="intermediate_size = 96 .* axis size 64"):
        shd.validate_for_model(shd.MeshShape(1, 64), dataclasses.replace(cfg, num_heads=64, num_kv_heads=64))


@pytest.mark.parametrize("tp, heads, kv, inter", [(1, 9, 3, 90), (2, 12, 4, 90), (3, 9, 3, 90), (4, 12, 4, 92),
                                                   (8, 24, 8, 96)])
def test_padded_config_keeps_the_group_and_divides(tp, heads, kv, inter):
    from jaxspec.models.padding import padded_config

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=90, num_layers=1,
                      num_heads=9, num_kv_heads=3, head_dim=8)
    padded, info = padded_config(cfg, tp)
    assert (padded.num_heads, padded.num_kv_heads, padded.intermediate_size) == (heads, kv, inter)
    assert padded.num_heads // padded.num_kv_heads == 3  # query head h still reads KV head h // 3
    shd.validate_for_model(shd.MeshShape(1, tp), padded)
    assert info.none == (tp in (1, 3))


def test_padded_params_change_no_logit():
    """One device, no mesh: the zero-padded model (bias, q/k norm, GQA) gives the same logits as the original."""
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.cache.paged import KVCache
    from jaxspec.models.llama import forward, prepare_params
    from jaxspec.models.padding import pad_params, padded_config

    cfg = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=90, num_layers=2,
                      num_heads=6, num_kv_heads=3, head_dim=8, qkv_bias=True, qk_norm=True)
    rng = np.random.default_rng(0)
    n = lambda *s: jnp.asarray(rng.normal(0, 0.3, s), jnp.float32)  # noqa: E731
    L, d, q, kv, i = 2, 32, 48, 24, 90
    layers = {"attn_norm": 1 + n(L, d), "wq": n(L, q, d), "wk": n(L, kv, d), "wv": n(L, kv, d), "wo": n(L, d, q),
              "bq": n(L, q), "bk": n(L, kv), "bv": n(L, kv), "q_norm": 1 + n(L, 8), "k_norm": 1 + n(L, 8),
              "mlp_norm": 1 + n(L, d), "w_gate": n(L, i, d), "w_up": n(L, i, d), "w_down": n(L, d, i)}
    params = {"embed": n(64, d), "final_norm": 1 + n(d), "lm_head": n(64, d), "layers": layers}
    tokens = jnp.asarray(rng.integers(0, 64, (2, 5)), jnp.int32)

    def logits(p, c):
        cache = KVCache.zeros(c.num_layers, 5, 4, c.num_kv_heads, c.head_dim)
        table = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
        out = forward(prepare_params(p, c), c, tokens, pos, cache, table, q_start=jnp.zeros(2, jnp.int32),
                      kv_len=jnp.asarray([5, 3], jnp.int32))
        return np.asarray(out.logits)

    padded, info = padded_config(cfg, 4)
    padded_params = pad_params(params, cfg, padded)
    assert (padded.num_heads, padded.num_kv_heads, padded.intermediate_size) == (8, 4, 92) and not info.none
    assert padded_params["layers"]["wo"].shape == (L, d, 64) and padded_params["layers"]["bk"].shape == (L, 32)
    np.testing.assert_allclose(logits(padded_params, padded), logits(params, cfg), rtol=0, atol=1e-5)


def test_sharded_page_allocator_keeps_rows_on_their_shard():
    from jaxspec.cache.paged import OutOfPagesError, ShardedPageAllocator

    alloc = ShardedPageAllocator(num_shards=2, pages_per_shard=4, page_size=4)  # 3 usable pages per shard
    assert alloc.total == 6 and alloc.num_pages == 8
    alloc.allocate("a", 12, shard=0)  # 3 pages: shard 0 is full
    alloc.allocate("b", 5, shard=1)
    assert alloc.page_table_row("a", 4).tolist() == [1, 2, 3, 0]  # shard-local ids, null page 0
    assert alloc.page_table_row("b", 3).tolist() == [1, 2, 0]
    with pytest.raises(OutOfPagesError, match="data shard 0"):
        alloc.allocate("c", 1, shard=0)
    with pytest.raises(ValueError, match="holds pages on shard 1, not 0"):
        alloc.allocate("b", 9, shard=0)
    assert alloc.num_used == 5 and alloc.free("a") == 3 and alloc.free("c") == 0
    alloc.allocate("c", 1, shard=0)
    for seq in ("b", "c"):
        alloc.free(seq)
    assert alloc.usage() == {"total": 6, "used": 0, "free": 6}


def test_helpers_are_identity_without_mesh():
    x = {"a": jax.numpy.ones((2, 3))}
    assert shd.shard_params(x, None, None) is x
    assert shd.constrain_state(x, None) is x
    assert shd.abstract_state(x, None) is x


@pytest.mark.parametrize("argv, message", [
    (["--mesh", "abc"], "error: mesh 'abc': expected DATAxMODEL"),
    (["--mesh", "3x3"], "error: mesh 3x3 needs 9 devices"),
    (["--coordinator", "localhost:1234"], "missing --num-processes, --process-id"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], "--process-id 2 must be in"),
])
def test_cli_mesh_errors(argv, message, capsys):
    from jaxspec.generate import main

    assert main(["--prompt", "hi", *argv]) == 2
    assert message in capsys.readouterr().err


def test_setup_mesh_without_flags_is_none():
    import argparse

    p = argparse.ArgumentParser()
    shd.add_mesh_args(p)
    assert shd.setup_mesh(p.parse_args([])) is None
    assert shd.setup_mesh(p.parse_args(["--mesh", "1x1"])).shape == {"data": 1, "model": 1}


def test_serve_cli_rejects_a_mesh_that_does_not_fit(capsys):
    from jaxspec.serve.launch import main

    assert main(["--mesh", "4x2"]) == 2  # one device here
    err = capsys.readouterr().err
    assert err.startswith("error:") and "8" in err
    assert main(["--mesh", "4x"]) == 2
    assert "4x" in capsys.readouterr().err

