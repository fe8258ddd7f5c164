"""`python -m jaxspec.bench lower`: every entry point lowered for CUDA and TPU from this CPU host.

Lowering runs Pallas' Triton / Mosaic lowering rules but no device compiler, so
this needs no accelerator. The CUDA run is the positive control: there every
entry point must contain the Triton attention kernel, every spec loop the
verify kernels, every tree loop the tree-build kernel; the analysis that
finds them is the one that checks the TPU lowering.

No silent fallback on TPU: a spec loop (n-gram, standalone, EAGLE, EAGLE-3,
Medusa, the server's decode buckets) whose TPU lowering has no Mosaic verify
call fails `test_tpu_spec_loops_verify_with_mosaic`; an entry point without the
Mosaic paged-attention kernel (jaxspec/pallas/paged_attention_tpu.py) fails
`test_tpu_entry_points_attend_with_mosaic`.
"""

from __future__ import annotations

import json

import pytest

from jaxspec.bench import lower
from tests.xla_env import subprocess_env

NAMES = ["prefill", "decode_plain", "spec_ngram_chain", "spec_ngram_tree", "prefill_standalone",
         "spec_standalone_chain", "spec_standalone_tree", "spec_eagle_chain", "prefill_eagle3", "spec_eagle3_tree",
         "spec_medusa_tree", "prefill_dflash", "spec_dflash_chain", "spec_dspark_chain", "serve_prefill_b2_c16_ctx32", "serve_decode_k0_b2_ctx32", "serve_decode_k3_b2_ctx32"]
# Plain decoding is the loop's k = 0 plan: its one-node verify is a loop like the others.
LOOPS = [n for n in NAMES if n.startswith(("spec_", "serve_decode", "decode_plain"))]
TREES = [n for n in LOOPS if "tree" in n]
ARGS = ["--model", "tiny", "--dtype", "float32", "--batch", "2", "--prompt-len", "16", "--context", "32"]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    from jaxspec.pallas import kernel_backend

    assert kernel_backend() is None  # a CPU host: kernels are chosen by lowering_for alone
    out = {}
    for platform in ("cuda", "tpu"):
        dump = tmp_path_factory.mktemp(platform)
        args = lower.build_parser().parse_args(["--platform", platform, "--dump", str(dump), *ARGS])
        out[platform] = (lower.lower_all(lower.load(args), args), dump)
    assert kernel_backend() is None  # lowering_for left nothing behind
    return out


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_report_structure_and_dump(reports, platform):
    rows, dump = reports[platform]
    assert [r["name"] for r in rows] == NAMES
    for r in rows:
        assert set(r) >= {"custom_calls", "kernels", "kernel_calls", "platform_kernels", "roles", "hlo_ops",
                          "heavy_ops", "stablehlo_chars"}
        text = (dump / f"{r['name']}.mlir").read_text()
        assert text.startswith("module @") and len(text) == r["stablehlo_chars"]
        assert r["hlo_ops"] > 100 and r["heavy_ops"].get("dot_general", 0) > 0
        assert sum(r["kernel_calls"].values()) <= sum(r["custom_calls"].values())
    assert [r["name"] for r in json.loads((dump / "report.json").read_text())] == NAMES


def test_cuda_lowering_finds_every_triton_kernel(reports):
    rows, _ = reports["cuda"]
    for r in rows:
        assert set(r["kernels"]) == {"Triton"}, r["name"]
        assert r["roles"]["attention"], r["name"]
        assert r["roles"]["verify"] == (r["name"] in LOOPS), r["name"]
        assert r["roles"]["tree_build"] == (r["name"] in TREES), r["name"]
    assert all(line.endswith("that need it") for line in lower.role_summary(rows))  # nothing fell back


def test_tpu_lowering_has_no_gpu_kernels_and_builds_trees_with_mosaic(reports):
    rows, _ = reports["tpu"]
    for r in rows:
        assert "Triton" not in r["kernels"] and "Mosaic GPU" not in r["kernels"], r["name"]
        assert r["roles"]["tree_build"] == (r["name"] in TREES), r["name"]
        if r["roles"]["tree_build"]:
            assert "build_tree" in r["kernels"]["Mosaic TPU"] and r["custom_calls"]["tpu_custom_call"] >= 1
    summary = {line.split(":")[0]: line for line in lower.role_summary(rows)}
    assert summary["tree_build"].endswith(f"kernel in {len(TREES)} of {len(TREES)} entry points that need it")


def test_tpu_spec_loops_verify_with_mosaic(reports):
    """The no-silent-fallback check for verification: every spec loop's TPU program calls a Mosaic
    verify kernel (jaxspec.pallas.verify_tpu), and no verify walk is left to the jnp reference."""
    rows, _ = reports["tpu"]
    by_name = {r["name"]: r for r in rows}
    fallbacks = [n for n in LOOPS if not by_name[n]["roles"]["verify"]]
    assert not fallbacks, f"TPU lowering verifies with the jnp reference (plain HLO) in {fallbacks}"
    for n in LOOPS:
        verify = [k for k in by_name[n]["kernels"]["Mosaic TPU"] if k.startswith("verify_")]
        # Greedy rows use the greedy kernel, and so do sampled rows under the default (coupled)
        # rule: the greedy walk over the target's own races (`verify.verify_coupled`).
        assert "verify_greedy" in verify, (n, verify)
    for r in rows:
        assert r["roles"]["verify"] == (r["name"] in LOOPS), r["name"]  # prefill verifies nothing
    summary = {line.split(":")[0]: line for line in lower.role_summary(rows)}
    assert summary["verify"].endswith(f"kernel in {len(LOOPS)} of {len(LOOPS)} entry points that need it")


def test_tpu_entry_points_attend_with_mosaic(reports):
    """The no-silent-fallback check for attention: every entry point's TPU program calls the
    Mosaic paged-attention kernel (a kernel name containing "attention")."""
    rows, _ = reports["tpu"]
    fallbacks = [r["name"] for r in rows if not r["roles"]["attention"]]
    assert not fallbacks, f"TPU lowering attends with the jnp reference (plain HLO) in {fallbacks}"


def test_analyze_reads_kernel_names():
    text = ('%0 = stablehlo.custom_call @tpu_custom_call(%a) {backend_config = "", kernel_name = "paged_attention"}\n'
            '%1 = stablehlo.custom_call @__gpu$xla.gpu.triton(%b) {mhlo.backend_config = {name = "verify_greedy"}}\n'
            '%2 = stablehlo.custom_call @Sharding(%c)\n%3 = stablehlo.dot_general %x, %y\n')
    r = lower.analyze("x", text, "tpu")
    assert r["kernels"] == {"Mosaic TPU": ["paged_attention"], "Triton": ["verify_greedy"]}
    assert r["custom_calls"] == {"tpu_custom_call": 1, "__gpu$xla.gpu.triton": 1, "Sharding": 1}
    assert r["platform_kernels"] == 1 and r["roles"] == {"attention": True, "verify": False, "tree_build": False}
    assert r["heavy_ops"] == {"dot_general": 1}


@pytest.mark.parametrize("argv, message", [
    (["--platform", "tpu", "--prompt-len", "64", "--context", "64"], "--prompt-len 64 must be below --context 64"),
    (["--platform", "tpu", "--batch", "0"], "--batch must be >= 1"),
])
def test_bad_arguments(argv, message, capsys):
    assert lower.main(argv) == 2
    assert message in capsys.readouterr().err


def test_sharded_tpu_lowering_puts_kernels_under_shard_map(tmp_path):
    """--mesh 4x2 on 8 host devices: Mosaic calls cannot be auto-partitioned, so the tree-build and
    verify kernels must sit under shard_map (`sharding.shard_kernel_rows`) for the TPU lowering to succeed at all."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = subprocess_env(8, PYTHONPATH=str(root))
    env.pop("JAXSPEC_KERNELS", None)
    argv = ["--platform", "tpu", "--mesh", "4x2", "--dump", str(tmp_path), *ARGS]
    argv[argv.index("--batch") + 1] = "4"  # the batch "data" splits
    proc = subprocess.run([sys.executable, "-m", "jaxspec.bench", "lower", *argv], env=env, cwd=root,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "report.json").read_text())
    assert all(r["mesh"] == "4x2" for r in rows) and len(rows) == len(NAMES)
    trees = [r for r in rows if r["roles"]["tree_build"]]
    assert [r["name"] for r in trees] == TREES
    # Every Mosaic row kernel (tree build, verify) sits under shard_map, in every spec loop.
    for r in rows:
        if r["name"].startswith(("spec_", "serve_decode")):
            assert r["roles"]["verify"], r["name"]
            assert "manual_computation" in (tmp_path / f"{r['name']}.mlir").read_text(), r["name"]


def test_int8_weights_reach_the_tpu_programs():
    """`--quantize int8`: the lowered TPU prefill and decode read int8 weights (XLA's dot over
    `layers.Int8Weight`), and float32 lowering reads none (the counter's negative control)."""
    counts = {}
    for q in ("none", "int8"):
        args = lower.build_parser().parse_args(["--platform", "tpu", "--quantize", q, *ARGS])
        model = lower.load(args)
        rows = []
        for name, trace in list(lower.engine_entry_points(model, args))[:2]:  # prefill, decode_plain
            from jaxspec.pallas import lowering_for

            with lowering_for("tpu"):
                rows.append(lower.analyze(name, trace().lower(lowering_platforms=("tpu",)).as_text(), "tpu"))
        counts[q] = [r["int8_ops"] for r in rows]
    assert counts["none"] == [0, 0] and all(n > 0 for n in counts["int8"]), counts
