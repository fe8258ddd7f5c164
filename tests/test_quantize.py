"""Weight-only int8 (issue 29, first part): the native kernel against a numpy dequantize-then-matmul,
the engine against Hugging Face running the same dequantized weights, speculation against plain
decoding on the quantized target, and the refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxspec import LLM, SamplingParams
from jaxspec.native.packed_matmul import pack_weight, packed_matmul, quantize_int8, unpack_weight

ENGINE = dict(max_batch_size=2, max_context=128, length_buckets=(16, 32, 64, 128), page_size=8)


@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (8, 64, 128), (13, 70, 130), (3, 5, 7), (9, 32, 200)])
def test_int8_kernel_equals_numpy_dequantized_matmul(m, k, n):
    rng = np.random.default_rng(m * 100 + n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[:, 1] = 0.0  # a zero column: scale 1, weights 0
    q, scale = (np.asarray(a) for a in quantize_int8(w))
    assert q.dtype == np.int8 and np.abs(q).max() <= 127 and scale[1] == 1.0
    assert np.all(np.abs(q.astype(np.float32) * scale - w) <= scale / 2 + 1e-6)  # round to nearest
    deq = q.astype(np.float64) * scale
    x = rng.standard_normal((m, k)).astype(np.float32)
    pw = pack_weight(w, int8=True)
    assert pw.tiles.dtype == jnp.int8 and pw.shape == (k, n) and pw.tiles.nbytes == pw.tiles.size  # a byte each
    got = np.asarray(jax.jit(packed_matmul)(x, pw))
    tol = 1e-5 * np.sqrt(k) * np.abs(deq).max() * np.abs(x).max()
    np.testing.assert_allclose(got, x @ deq, rtol=1e-5, atol=tol)
    np.testing.assert_allclose(np.asarray(jnp.einsum("...i,io->...o", x, unpack_weight(pw))), x @ deq, rtol=1e-5, atol=tol)


def test_int8_kernel_rows_are_batch_invariant():
    """Verify blocks (T rows) and plain decode (1 row) see bit-identical results, as in float32."""
    rng = np.random.default_rng(2)
    pw = pack_weight(rng.standard_normal((300, 150)).astype(np.float32), int8=True)
    x = jnp.asarray(rng.standard_normal((19, 300)).astype(np.float32))
    full = np.asarray(jax.jit(packed_matmul)(x, pw))
    for m in (1, 2, 7, 8, 9):
        for start in (0, 3, 19 - m):
            np.testing.assert_array_equal(np.asarray(jax.jit(packed_matmul)(x[start:start + m], pw)),
                                          full[start:start + m])


def dequantized_hf(hf):
    """A copy of `hf` whose every Linear (the LM head included, untied from the embedding) holds the
    int8-dequantized weight the engine computes with: the reference for exactness."""
    import copy

    ref = copy.deepcopy(hf)
    for name, mod in ref.named_modules():
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight.detach().numpy().T  # runtime [in, out]: a scale per output column
            q, scale = (np.asarray(a) for a in quantize_int8(w))
            mod.weight = torch.nn.Parameter(torch.from_numpy((q.astype(np.float32) * scale).T.copy()))
    return ref


@pytest.fixture(scope="module")
def int8_llms(tiny_dirs):
    path, hf = tiny_dirs["llama"]
    return hf, {None: LLM(str(path), quantize="int8", progress=False, **ENGINE)}  # speculation: test_gguf_blocks


def test_int8_engine_equals_hf_on_dequantized_weights(int8_llms):
    from tests.reference import assert_greedy_equal, hf_greedy

    hf, llms = int8_llms
    ref = dequantized_hf(hf)
    prompts = [[5, 17, 33, 9, 100, 42, 7], [200, 3]]
    outs = llms[None].generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert_greedy_equal(ref, prompt, out.outputs[0].token_ids, hf_greedy(ref, prompt, 16))
    # Positive control: the float32 model is a different reference (int8 moved the logits).
    with torch.no_grad():
        a = hf(torch.tensor([prompts[0]])).logits[0, -1].numpy()
        b = ref(torch.tensor([prompts[0]])).logits[0, -1].numpy()
    assert np.abs(a - b).max() > 1e-4


def test_int8_on_xla_ops_equals_hf_on_dequantized_weights(tiny_dirs):
    """Without the native kernels (engine.cpu_kernels = xla: the TPU / GPU / mesh path), int8 runs as
    `layers.Int8Weight` through XLA's dot, on the same dequantized weights; a bad value is refused."""
    from jaxspec.models.layers import Int8Weight
    from tests.reference import assert_greedy_equal, hf_greedy

    path, hf = tiny_dirs["llama"]
    llm = LLM(str(path), quantize="int8", cpu_kernels="xla", progress=False, **ENGINE)
    assert isinstance(llm.engine.runner.params["head"], Int8Weight)
    ref = dequantized_hf(hf)
    prompt = [5, 17, 33, 9, 100, 42, 7]
    out = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids
    assert_greedy_equal(ref, prompt, out, hf_greedy(ref, prompt, 16))
    with pytest.raises(ValueError, match="engine.quantize must be none, int8 or gguf"):
        LLM(str(path), quantize="int4", progress=False, **ENGINE)


def test_bench_decode_helpers(int8_llms, tiny_dirs):
    """`bench decode --quantize`'s measures: the bytes a step streams (int8 about a quarter of float32's)
    and the greedy agreement it reports."""
    from jaxspec.bench.decode import agreement, streamed_bytes

    path, _ = tiny_dirs["llama"]
    f32 = LLM(str(path), progress=False, **ENGINE)
    ratio = streamed_bytes(int8_llms[1][None].engine.runner.params) / streamed_bytes(f32.engine.runner.params)
    assert 0.2 < ratio < 0.4, ratio
    assert agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == (0.75, 1)


def write_w8a16(src, dst, fmt: str) -> dict:
    """`src` (a float HF checkpoint) re-saved as compressed-tensors W8A16, written here from the format's
    documented semantics: each decoder Linear symmetric int8 with a scale per output channel, scale =
    amax / 127.5 in bfloat16 (llm-compressor's min-max observer: the channel's largest |q| may be 128),
    "pack-quantized" as four q + 128 bytes per int32 word (first value in the low byte) plus
    weight_shape, "int-quantized" as int8 `weight`; lm_head left in float (`ignore`).
    Returns {Linear name: (q [out, in] int8, scale [out] float32)}."""
    import json
    import shutil

    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors, out, own = load_file(str(dst / "model.safetensors")), {}, {}
    for name, w in tensors.items():
        if not (name.endswith("proj.weight") and w.ndim == 2):
            out[name] = w
            continue
        base = name.removesuffix(".weight")
        scale = (np.abs(w).max(axis=1) / 127.5).astype(ml_dtypes.bfloat16)
        s = scale.astype(np.float32)
        q = np.clip(np.round(w / s[:, None]), -128, 127).astype(np.int8)
        if fmt == "pack-quantized":
            u = np.pad((q.astype(np.int16) + 128).astype(np.uint32), [(0, 0), (0, -q.shape[1] % 4)])
            words = u[:, 0::4] | u[:, 1::4] << 8 | u[:, 2::4] << 16 | u[:, 3::4] << 24
            out[base + ".weight_packed"] = words.view(np.int32)
            out[base + ".weight_shape"] = np.array(q.shape, np.int32)
        else:
            out[base + ".weight"] = q
        out[base + ".weight_scale"] = scale[:, None]
        own[name] = (q, s)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                  "strategy": "channel", "group_size": None, "dynamic": False}}}}
    (dst / "config.json").write_text(json.dumps(cfg))
    return own


@pytest.mark.parametrize("fmt", ["pack-quantized", "int-quantized"])
def test_w8a16_checkpoint_runs_on_its_own_int8_weights(tiny_dirs, tmp_path, fmt):
    """A compressed-tensors W8A16 checkpoint loads as its dequantized weights (q * scale): greedy output
    equals Hugging Face running those weights in float, with quantize none and int8 (native kernels and
    XLA's dot). Under int8 the runtime computes on the checkpoint's own q and scales; re-quantizing
    the dequantized weights (the control) would change the q of channels whose largest |q| is 128."""
    from jaxspec.models.layers import Int8Weight
    from jaxspec.models.loading import load_model
    from tests.reference import assert_greedy_equal, hf_greedy

    path, hf = tiny_dirs["llama"]
    own = write_w8a16(path, tmp_path / "w8a16", fmt)
    loaded = load_model(str(tmp_path / "w8a16"), progress=False)
    wq = "model.layers.1.self_attn.q_proj.weight"
    q, s = own[wq]
    np.testing.assert_array_equal(np.asarray(loaded.params["layers"]["wq"][1]), q.astype(np.float32) * s[:, None])
    np.testing.assert_array_equal(np.asarray(loaded.params["int8"]["wq"][0][1]), q)

    import copy

    ref = copy.deepcopy(hf)  # Hugging Face on the dequantized weights
    state = ref.state_dict()
    for name, (qq, ss) in own.items():
        state[name].copy_(torch.from_numpy(qq.astype(np.float32) * ss[:, None]))
    prompt = [5, 17, 33, 9, 100, 42, 7]
    want = hf_greedy(ref, prompt, 16)
    for opts in ({}, {"quantize": "int8"}, {"quantize": "int8", "cpu_kernels": "xla"}):
        llm = LLM(str(tmp_path / "w8a16"), progress=False, **opts, **ENGINE)
        out = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0].outputs[0].token_ids
        assert_greedy_equal(ref, prompt, out, want)
    layer = llm.engine.runner.params["layers"][1]["wq"]
    assert isinstance(layer, Int8Weight)
    np.testing.assert_array_equal(np.asarray(layer.q), q.T)
    np.testing.assert_array_equal(np.asarray(layer.scale), s)
    # Control: our own quantization of the same weights differs (128 -> 127 rescaled).
    assert (np.abs(q.astype(np.int16)).max(axis=1) == 128).any()
    assert not np.array_equal(np.asarray(quantize_int8((q.astype(np.float32) * s[:, None]).T)[0]), q.T)


@pytest.mark.parametrize("field,value,match", [
    ("quant_method", "gptq", "quant_method is 'gptq'"),
    ("format", "float-quantized", "format is 'float-quantized'"),
    ("num_bits", 4, r"group_0.weights.num_bits is 4"),
    ("strategy", "group", r"group_0.weights.strategy is 'group'"),
    ("input_activations", {"num_bits": 8}, "activation quantization"),
])
def test_w8a16_refuses_other_quantizations(tiny_dirs, tmp_path, field, value, match):
    import json

    from jaxspec.models.config import LoadError
    from jaxspec.models.loading import load_model

    path, _ = tiny_dirs["llama"]
    write_w8a16(path, tmp_path / "q", "pack-quantized")
    load_model(str(tmp_path / "q"), progress=False)  # positive control: the W8A16 one loads
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    qc, group = cfg["quantization_config"], cfg["quantization_config"]["config_groups"]["group_0"]
    (qc if field in qc else group if field in group and field != "weights" else group["weights"])[field] = value
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match=match):
        load_model(str(tmp_path / "q"), progress=False)
