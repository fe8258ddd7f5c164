"""Shared fixtures: tiny random Hugging Face checkpoints and the embedded SmolLM2.

Tiny models are built with transformers (torch CPU), saved with
`save_pretrained`, and loaded by jaxspec, so every test crosses the real
loading path. The torch model is kept alongside as the reference.
"""

from __future__ import annotations

import os

import pytest

from tests.xla_env import with_test_flags

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Before any test starts a backend: XLA reads its flags once per process (tests/xla_env.py says why).
os.environ["XLA_FLAGS"] = with_test_flags(os.environ.get("XLA_FLAGS", ""))


def make_tiny_hf(kind: str, **overrides):
    import torch
    import transformers as tf

    torch.manual_seed({"llama": 0, "qwen2": 1, "qwen3": 2, "mistral": 3}[kind])
    common = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2,
    )
    common.update(overrides)
    if kind == "llama":
        cfg = tf.LlamaConfig(**common)
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**common)
        model = tf.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**{"head_dim": 32, **common})
        model = tf.Qwen3ForCausalLM(cfg)
    elif kind == "mistral":
        cfg = tf.MistralConfig(**common)
        model = tf.MistralForCausalLM(cfg)
    else:
        raise ValueError(kind)
    # Random init gives near-uniform logits, where fp32 rounding flips argmax
    # ties constantly; sharpen the LM head so greedy paths are well separated.
    with torch.no_grad():
        head = model.lm_head.weight if not cfg.tie_word_embeddings else model.model.embed_tokens.weight
        head.mul_(8.0)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """{kind: (saved dir, torch model)} for llama, qwen2, qwen3."""
    out = {}
    for kind in ("llama", "qwen2", "qwen3"):
        model = make_tiny_hf(kind)
        path = tmp_path_factory.mktemp(f"tiny_{kind}")
        model.save_pretrained(path)
        out[kind] = (path, model)
    return out


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M-Instruct, converted once to the jaxspec cache."""
    from jaxspec.models.loading import load_model

    return load_model("default", progress=False)


@pytest.fixture(scope="session")
def smollm_hf(smollm):
    import torch
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(smollm.path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    """Tiny random Llama + the SmolLM2 tokenizer files, in Hugging Face format."""
    import shutil

    from jaxspec.models.loading import cached_gguf_dir, default_gguf_path

    src = cached_gguf_dir(default_gguf_path(), progress=False)
    d = tmp_path_factory.mktemp("tiny_chat")
    make_tiny_hf("llama", vocab_size=49152).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).exists():
            shutil.copy(src / f, d / f)
    return d


@pytest.fixture(scope="session")
def served(chat_model_dir):
    from jaxspec.serve.app import create_app
    from jaxspec.serve.server import build_server
    from tests.serve_util import ServerThread, serve_config

    server = build_server(serve_config(chat_model_dir), progress=False)
    thread = ServerThread(create_app(server)).start()
    server.warm_up()
    yield server, thread.url
    thread.stop()
    server.shutdown()


# Tests patch functions and module constants (wrong-q controls, select tiers) and then build
# engines: they must compile what they patched, never load a stored executable keyed by the
# unpatched source (jaxspec/aot.py). Subprocesses (CLI tests) inherit it; test_aot turns it on.
os.environ.setdefault("JAXSPEC_EXECUTABLE_CACHE", "off")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each module's compiled programs when it ends. Every XLA:CPU executable maps its JIT
    code into the process: one process running the suite held 32,700 mappings at 60% and was on
    course for the kernel's limit (vm.max_map_count 65,530), where an mmap fails and the process
    dies of SIGSEGV (as CI's run did, at 93%). Clearing after a module brings ~5,300 mappings back
    to ~1,100."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
