"""GGUF-native compute (engine.quantize = "gguf", issue 29): the block kernel against llama.cpp's own
numpy dequantizer (gguf-py), and the engine on a GGUF's Q4_0 / Q4_1 / Q8_0 blocks against Hugging
Face running the dequantized weights."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from jaxspec import LLM, SamplingParams  # noqa: E402
from jaxspec.models.config import LoadError  # noqa: E402
from jaxspec.native.block_matmul import (  # noqa: E402
    BLOCK_BYTES, block_matmul, decode_blocks, dequantize, pack_blocks)

Q = gguf.GGMLQuantizationType
ENGINE = dict(max_batch_size=2, max_context=128, length_buckets=(16, 32, 64, 128), page_size=8)
HF_LINEARS = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
              "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}


def random_blocks(rng, kind: str, n: int, k: int) -> np.ndarray:  # [n, k / 32 * bytes] uint8, sane scales
    raw = rng.integers(0, 256, (n, k // 32 * BLOCK_BYTES[kind]), dtype=np.uint8)
    b = raw.reshape(n, k // 32, -1)
    halves = lambda lo, hi: rng.uniform(lo, hi, b.shape[:2]).astype(np.float16)[..., None].view(np.uint8)  # noqa: E731
    b[..., :2] = halves(-0.05, 0.05)
    if kind == "Q4_1":
        b[..., 2:4] = halves(-0.1, 0.1)
    return raw


def gguf_dequantized(raw: np.ndarray, kind: str) -> np.ndarray:  # [n, k] float32, llama.cpp's numpy reference
    return np.asarray(gguf.quants.dequantize(raw, getattr(Q, kind)), np.float32).reshape(raw.shape[0], -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", [(64, 32), (200, 96), (130, 576)])
def test_block_kernel_equals_numpy_dequantize_then_matmul(kind, n, k):
    rng = np.random.default_rng([n, k, len(kind)])
    raw = random_blocks(rng, kind, n, k)
    w = gguf_dequantized(raw, kind)  # [n, k]
    bw = pack_blocks(*decode_blocks(raw, kind))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda b: jnp.einsum("...i,io->...o", jnp.eye(k), dequantize(b)))(bw)), w.T)
    x = rng.standard_normal((9, k)).astype(np.float32)
    for m in range(1, 10):  # 1..8 rows share a weight load; 9 = a block of 8 and one more
        got = np.asarray(jax.jit(block_matmul)(jnp.asarray(x[:m]), bw))
        want = x[:m].astype(np.float64) @ w.T.astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())  # float32 summation


def test_block_kernel_detects_swapped_nibbles():
    """Positive control: the same bytes with each byte's two 4-bit values swapped (the other nibble
    order a packer might use) give a different product."""
    rng = np.random.default_rng(0)
    raw = random_blocks(rng, "Q4_1", 64, 64)
    q, d, m = decode_blocks(raw, "Q4_1")
    halves = q.reshape(64, 2, 2, 16)
    swapped = np.concatenate([halves[:, :, 1], halves[:, :, 0]], axis=-1).reshape(64, 64)
    x = jnp.asarray(rng.standard_normal((2, 64)).astype(np.float32))
    want = np.asarray(x) @ gguf_dequantized(raw, "Q4_1").T
    assert np.abs(np.asarray(block_matmul(x, pack_blocks(swapped, d, m))) - want).max() > 1e-2


def test_block_kernel_rows_are_batch_invariant():
    rng = np.random.default_rng(1)
    bw = pack_blocks(*decode_blocks(random_blocks(rng, "Q4_1", 150, 128), "Q4_1"))
    x = jnp.asarray(rng.standard_normal((19, 128)).astype(np.float32))
    full = np.asarray(jax.jit(block_matmul)(x, bw))
    for m in (1, 3, 8, 9):
        for start in (0, 19 - m):
            np.testing.assert_array_equal(np.asarray(jax.jit(block_matmul)(x[start:start + m], bw)),
                                          full[start:start + m])


def test_smollm2_tensors_through_the_kernel():
    """The embedded GGUF's own Q4_1 matrices and Q8_0 embedding (the tied LM head), 1 to 8 rows."""
    from jaxspec.models.loading import default_gguf_path

    reader = gguf.GGUFReader(str(default_gguf_path()))
    tensors = {t.name: t for t in reader.tensors}
    rng = np.random.default_rng(2)
    for name, kind in (("blk.3.ffn_down.weight", "Q4_1"), ("blk.17.attn_q.weight", "Q4_1"),
                       ("token_embd.weight", "Q8_0")):
        t = tensors[name]
        assert t.tensor_type.name == kind
        raw = np.asarray(t.data)[:4096]  # rows = output columns; the LM head's first 4096 tokens
        w = gguf_dequantized(raw, kind)
        bw = pack_blocks(*decode_blocks(raw, kind))
        for m in (1, 4, 8):
            x = rng.standard_normal((m, w.shape[1])).astype(np.float32)
            want = x.astype(np.float64) @ w.T
            np.testing.assert_allclose(np.asarray(block_matmul(jnp.asarray(x), bw)), want, rtol=0,
                                       atol=2e-6 * np.abs(want).max())


# --------------------------------------------------------------------------- #
# The engine on a GGUF's blocks
# --------------------------------------------------------------------------- #


def quantized_reference(hf, kinds: dict[str, str]):
    """(params["gguf"] for `hf`'s matrices quantized by gguf-py as `kinds` says, a copy of `hf` holding
    the dequantized weights). kinds: MATRICES key or "lm_head" -> block type."""
    ref = copy.deepcopy(hf)
    layers = ref.model.layers
    blocks: dict = {"layers": {}}
    for key, kind in kinds.items():
        mods = [ref.lm_head] if key == "lm_head" else [layer.get_submodule(HF_LINEARS[key]) for layer in layers]
        parts = []
        for mod in mods:
            raw = gguf.quants.quantize(mod.weight.detach().numpy(), getattr(Q, kind))
            mod.weight = torch.nn.Parameter(torch.from_numpy(gguf_dequantized(raw, kind)))
            parts.append(decode_blocks(raw, kind))
        stacked = tuple(None if a[0] is None else np.stack(a) for a in zip(*parts))
        if key == "lm_head":
            blocks["lm_head"] = tuple(None if a is None else a[0] for a in stacked)
        else:
            blocks["layers"][key] = stacked
    blocks["types"] = dict(kinds)
    return blocks, ref.eval()


@pytest.fixture(scope="module")
def q4_model(tiny_dirs):
    from jaxspec.models.loading import load_model

    path, hf = tiny_dirs["llama"]
    model = load_model(str(path), progress=False)
    kinds = {**{k: "Q4_1" for k in HF_LINEARS}, "wv": "Q4_0", "lm_head": "Q8_0"}
    model.params["gguf"], ref = quantized_reference(hf, kinds)
    return model, hf, ref


def test_engine_on_blocks_equals_hf_on_the_dequantized_weights(q4_model):
    from tests.reference import assert_greedy_equal, hf_greedy

    model, hf, ref = q4_model
    llm = LLM(model, quantize="gguf", progress=False, **ENGINE)
    layer = llm.engine.runner.params["layers"][0]
    assert layer["wqkv"].bits == 4 and llm.engine.runner.params["head"].bits == 8  # the block kernels ran
    prompts = [[5, 17, 33, 9, 100, 42, 7], [200, 3]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert_greedy_equal(ref, prompt, out.outputs[0].token_ids, hf_greedy(ref, prompt, 16))
    # Positive control: the float model is a different reference (4-bit blocks moved the logits).
    with torch.no_grad():
        a = hf(torch.tensor([prompts[0]])).logits[0, -1].numpy()
        b = ref(torch.tensor([prompts[0]])).logits[0, -1].numpy()
    assert np.abs(a - b).max() > 1e-2


@pytest.mark.parametrize("quantize", ["gguf", "int8"])
def test_speculation_on_quantized_weights_equals_plain(q4_model, tiny_dirs, tmp_path, quantize):
    """Exact on GGUF blocks and on int8, every drafter family: n-gram, the truncated target, and heads
    that share the target's quantized LM head and embedding (EAGLE, EAGLE-3 tree, Medusa, MLP
    speculator, DFLASH) or read its KV (FROZEN_KV_MTP) give plain decoding's tokens, at batch 2."""
    from tests import heads_fixtures as hx

    model, hf, _ = q4_model
    plain = LLM(model, quantize=quantize, progress=False, **ENGINE)
    prompts = [[5, 17, 33, 9, 5, 17, 33, 9, 5], [11, 12, 13, 11, 12, 13, 11]]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp)]
    chain = {"topk": 1, "num_steps": 3, "num_draft_tokens": 4, "adaptive": "off"}
    cases = {
        "ngram": ({"algorithm": "ngram", "adaptive": "off"}, None),
        "standalone": ({"algorithm": "standalone", "draft_layers": 1, **chain}, None),
        "eagle": ({"algorithm": "eagle", **chain}, hx.write_eagle_head(tmp_path / "e1", hf)),
        "eagle3-tree": ({"algorithm": "eagle3", "topk": 2, "num_steps": 2, "num_draft_tokens": 5, "adaptive": "off"},
                        hx.write_eagle3_head(tmp_path / "e3", hf, layer_ids=[0, 1, 1], convention="input")),
        "medusa": ({"algorithm": "medusa", **chain}, hx.write_medusa_head(tmp_path / "medusa", hf, num_heads=3)),
        "mlp_speculator": ({"algorithm": "mlp_speculator", **chain},
                           hx.write_mlp_speculator(tmp_path / "mlp", hf, n_predict=3)),
        "dflash": ({"algorithm": "dflash", "num_draft_tokens": 8, "adaptive": "off"},
                   hx.write_block_head(tmp_path / "dflash", hf, kind="dflash", block_size=8, layer_ids=(0, 1))),
        "frozen_kv_mtp": ({"algorithm": "frozen_kv_mtp", **chain}, hx.write_frozen_kv_head(tmp_path / "fkv", hf)),
    }
    ran = {}
    for name, (spec, draft) in cases.items():
        llm = LLM(model, spec=spec, draft_model=None if draft is None else str(draft), quantize=quantize,
                  progress=False, **ENGINE)
        outs = llm.generate(prompts, sp)
        assert [o.outputs[0].token_ids for o in outs] == want, name
        ran[name] = all(o.outputs[0].accept_lengths for o in outs)
    assert all(ran.values()), ran  # every drafter ran its verify loop


def test_quantized_gguf_file_loads_its_blocks(tmp_path):
    """A GGUF written with Q4_1 matrices and a Q8_0 LM head (by llama.cpp's numpy quantizer) runs on
    its own blocks; the converted (dequantized) directory is Hugging Face's reference."""
    import transformers as tf

    from jaxspec.models.loading import load_model
    from tests.reference import assert_greedy_equal, hf_greedy
    from tests.test_loading import tiny_model, write_tiny_gguf

    src = tiny_model(tf.LlamaConfig, tied=False, seed=3, intermediate_size=64)
    path = tmp_path / "tiny.Q4_1.gguf"
    write_tiny_gguf(src, path, quant=lambda name: Q.Q8_0 if name == "output.weight" else Q.Q4_1)
    model = load_model(str(path), progress=False, gguf_blocks=True, cache_dir=tmp_path / "cache")
    assert model.params["gguf"]["types"] == {**{k: "Q4_1" for k in HF_LINEARS}, "lm_head": "Q8_0"}
    ref = tf.AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    llm = LLM(str(path), quantize="gguf", cache_dir=str(tmp_path / "cache"), progress=False, **ENGINE)  # by path
    assert llm.engine.runner.params["head"].bits == 8
    prompt = [5, 17, 33, 9, 100, 42, 7]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    assert_greedy_equal(ref, prompt, out, hf_greedy(ref, prompt, 12))


def test_gguf_refusals(tmp_path, tiny_dirs):
    import transformers as tf

    from jaxspec.models import gguf_convert
    from jaxspec.models.loading import load_model
    from tests.test_loading import tiny_model, write_tiny_gguf

    src = tiny_model(tf.LlamaConfig, tied=True, seed=4, intermediate_size=64)
    f16 = tmp_path / "f16.gguf"
    write_tiny_gguf(src, f16, quant=lambda name: None if name == "blk.1.attn_v.weight" else Q.Q4_1)
    with pytest.raises(LoadError, match=r"blk\.1\.attn_v\.weight as F32 \(use --quantize int8 or none\)"):
        gguf_convert.read_blocks(f16)
    mixed = tmp_path / "mixed.gguf"
    write_tiny_gguf(src, mixed, quant=lambda name: Q.Q8_0 if name == "blk.0.ffn_up.weight" else Q.Q4_1)
    with pytest.raises(LoadError, match=r"w_up as \['Q4_1', 'Q8_0'\]"):
        gguf_convert.read_blocks(mixed)
    # Control: the same model with one type per matrix reads, and the tied embedding is the Q4_1 head.
    ok = tmp_path / "ok.gguf"
    write_tiny_gguf(src, ok, quant=lambda name: Q.Q4_1)
    assert gguf_convert.read_blocks(ok)["types"]["embed"] == "Q4_1"
    # A model that is not a GGUF, and a GGUF on XLA's ops: errors that say what to do instead.
    hf_dir = load_model(str(tiny_dirs["llama"][0]), progress=False)
    with pytest.raises(LoadError, match="not loaded from a GGUF"):
        LLM(hf_dir, quantize="gguf", progress=False, **ENGINE)
    blocks = load_model(str(ok), progress=False, gguf_blocks=True, cache_dir=tmp_path / "cache")
    with pytest.raises(LoadError, match="native CPU kernels only"):
        LLM(blocks, quantize="gguf", cpu_kernels="xla", progress=False, **ENGINE)
