"""`python -m jaxspec.bench lower`: every entry point lowered for CUDA and TPU from this CPU host.

Lowering runs Pallas' Triton / Mosaic lowering rules but no device compiler, so
this needs no accelerator. The CUDA run is the positive control: there every
entry point must contain the Triton attention kernel, every spec loop the
verify kernels, every tree loop the tree-build kernel; the analysis that
finds them is the one that reports what the TPU lowering lacks.
"""

from __future__ import annotations

import json

import pytest

from jaxspec.bench import lower

NAMES = ["prefill", "decode_plain", "spec_ngram_chain", "spec_ngram_tree", "prefill_standalone",
         "spec_standalone_chain", "spec_standalone_tree", "serve_prefill_b2_c16", "serve_decode_k0_b2_ctx32",
         "serve_decode_k3_b2_ctx32"]
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
        loop = r["name"].startswith(("spec_", "serve_decode"))
        assert r["roles"]["verify"] == loop, r["name"]
        assert r["roles"]["tree_build"] == ("tree" in r["name"]), r["name"]
    assert all(line.endswith("that need it") for line in lower.role_summary(rows))  # nothing fell back


def test_tpu_lowering_reports_what_falls_back(reports):
    """No Triton call may reach a TPU program; the tree-build kernel lowers through Mosaic. Attention and
    verify have no Mosaic kernel yet, and the summary must say so (update this when they land)."""
    rows, _ = reports["tpu"]
    for r in rows:
        assert "Triton" not in r["kernels"] and "Mosaic GPU" not in r["kernels"], r["name"]
        assert r["roles"]["tree_build"] == ("tree" in r["name"]), r["name"]
        if r["roles"]["tree_build"]:
            assert r["kernels"]["Mosaic TPU"] == ["build_tree"] and r["custom_calls"]["tpu_custom_call"] >= 1
    summary = {line.split(":")[0]: line for line in lower.role_summary(rows)}
    assert "kernel in 0 of 10" in summary["attention"] and "jnp reference" in summary["attention"]
    assert "kernel in 2 of 2" in summary["tree_build"]


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
    """--mesh 4x2 on 8 host devices: Mosaic calls cannot be auto-partitioned, so the tree-build kernel
    must sit under shard_map (`sharding.shard_kernel_rows`) for the TPU lowering to succeed at all."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(root)}
    env.pop("JAXSPEC_KERNELS", None)
    argv = ["--platform", "tpu", "--mesh", "4x2", "--dump", str(tmp_path), *ARGS]
    argv[argv.index("--batch") + 1] = "4"  # the batch "data" splits
    proc = subprocess.run([sys.executable, "-m", "jaxspec.bench", "lower", *argv], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "report.json").read_text())
    assert all(r["mesh"] == "4x2" for r in rows) and len(rows) == len(NAMES)
    trees = [r for r in rows if r["roles"]["tree_build"]]
    assert [r["name"] for r in trees] == ["spec_ngram_tree", "spec_standalone_tree"]
    for r in trees:
        assert "manual_computation" in (tmp_path / f"{r['name']}.mlir").read_text()
