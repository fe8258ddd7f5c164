"""The embedded SmolLM2-135M-Instruct against Hugging Face (float32, CPU).

Slow-ish (the real model): greedy tokens for 6 chat prompts x 64 tokens, logits,
and speculative greedy decoding (n-gram, the truncated-target drafter, random EAGLE/EAGLE-3 heads).
Outputs are checked against HF by teacher forcing (one forward over prompt + output: every token
HF's argmax given the ones before it), one prompt also against HF's token-by-token `generate`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxspec.bench.common import CHAT_PROMPTS, chat_ids
from jaxspec.cache.paged import KVCache
from jaxspec.config import EngineSection, SpecSection
from jaxspec.engine import Engine, Request
from jaxspec.sampling_params import SamplingParams
from jaxspec.models.llama import forward, prepare_params
from jaxspec.speculative.algorithm import shipped_head
from jaxspec.speculative.drafters.standalone import truncate_layers
from tests.reference import assert_greedy_equal, assert_teacher_forced_greedy, hf_greedy

pytestmark = pytest.mark.slow
NEW = 64
ENGINE = EngineSection(max_batch_size=8, max_context=256, length_buckets=(64, 128, 256), page_size=16)


@pytest.fixture(scope="module")
def prompts(smollm):
    return chat_ids(smollm.tokenizer, CHAT_PROMPTS[:6])


def test_config_is_smollm2(smollm):
    c = smollm.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0


def test_logits_match_hf(smollm, smollm_hf, prompts):
    ids = prompts[0]
    with torch.no_grad():
        ref = smollm_hf(torch.tensor([ids])).logits[0].numpy()
    c = smollm.config
    cache = KVCache.zeros(c.num_layers, 1 + 8, 16, c.num_kv_heads, c.head_dim)
    t = len(ids)
    out = forward(
        prepare_params(smollm.params, c), c, jnp.asarray([ids]), jnp.arange(t)[None], cache, jnp.arange(1, 9)[None],
        q_start=jnp.zeros(1, jnp.int32), kv_len=jnp.array([t]),
    )
    got = np.asarray(out.logits[0])
    assert np.abs(got - ref).max() < 2e-3 * max(1.0, np.abs(ref).max())
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_matches_hf_six_prompts(smollm, smollm_hf, prompts):
    engine = Engine(smollm.params, smollm.config, ENGINE, progress=False)
    results = engine.generate([Request(p, SamplingParams(max_tokens=NEW)) for p in prompts])
    for p, res in zip(prompts, results):
        assert len(res.output_ids) == NEW
        assert_teacher_forced_greedy(smollm_hf, p, res.output_ids)
    # Positive control: one wrong token in the middle fails the teacher-forced check.
    bad = list(results[2].output_ids)
    bad[NEW // 2] = (bad[NEW // 2] + 1) % smollm.config.vocab_size
    with pytest.raises(AssertionError, match=f"token {NEW // 2}:"):
        assert_teacher_forced_greedy(smollm_hf, prompts[2], bad)
    # One prompt against HF's own token-by-token `generate` too.
    assert_greedy_equal(smollm_hf, prompts[0], results[0].output_ids, hf_greedy(smollm_hf, prompts[0], NEW))
    # batch-1 gives the same tokens as the ragged batch
    assert engine.generate([Request(prompts[3], SamplingParams(max_tokens=NEW))])[0].output_ids == results[3].output_ids


@pytest.mark.parametrize(
    "spec_kw",
    [
        dict(algorithm="ngram", topk=1, num_steps=7, num_draft_tokens=8),
        dict(algorithm="standalone", topk=2, num_steps=3, num_draft_tokens=6, draft_layers=20),
        # Random-weight heads on the real target: layer ids 2/15/27, a reduced vocabulary,
        # the native packed matmuls; exactness must not depend on the head being any good.
        dict(algorithm="eagle3", topk=1, num_steps=4, num_draft_tokens=5),
        dict(algorithm="eagle3", topk=3, num_steps=3, num_draft_tokens=8),
        dict(algorithm="eagle", topk=1, num_steps=3, num_draft_tokens=4),
        # The shipped FROZEN_KV_MTP head (trained: real acceptance) reading the target's own K/V of
        # layers 28 and 29, promoted from --spec nextn by its config; EAGLE-2 tree.
        dict(algorithm="nextn", draft_model="default", topk=2, num_steps=3, num_draft_tokens=6),
    ],
    ids=["ngram-chain", "truncated-tree", "eagle3-chain", "eagle3-tree", "eagle-chain", "frozen-kv-tree"],
)
def test_speculative_greedy_matches_hf(smollm, smollm_hf, prompts, spec_kw):
    from jaxspec.models.heads.family import head_config, init_head_params

    draft = None
    if spec_kw["algorithm"] == "standalone":
        draft = truncate_layers(smollm.params, smollm.config, spec_kw["draft_layers"])
    elif spec_kw["algorithm"] in ("eagle", "eagle3"):
        hcfg = head_config(spec_kw["algorithm"], smollm.config, draft_vocab_size=8192)
        assert hcfg.kind != "eagle3" or hcfg.feature_layers == (2, 15, 27)
        draft = init_head_params(hcfg, seed=1), hcfg
    elif spec_kw["algorithm"] == "nextn":
        from jaxspec.speculative.drafters import validate_spec_config
        from jaxspec.speculative.drafters.load import load_draft

        spec_kw = dataclasses.asdict(validate_spec_config(SpecSection(**{**spec_kw, "draft_model": str(
            shipped_head("frozen_kv_mtp"))})))
        assert spec_kw["algorithm"] == "frozen_kv_mtp"
        draft = load_draft(SpecSection(**spec_kw), smollm, jnp.float32, progress=False)
    engine = Engine(smollm.params, smollm.config, ENGINE, progress=False, spec=SpecSection(**spec_kw), draft=draft)
    results = engine.generate([Request(p, SamplingParams(max_tokens=NEW, logprobs=5)) for p in prompts[:3]])
    for p, res in zip(prompts, results):
        assert len(res.output_ids) == NEW
        assert_teacher_forced_greedy(smollm_hf, p, res.output_ids)
    assert engine.runner.allocator.num_used == 0
    if spec_kw["algorithm"] == "frozen_kv_mtp":  # a trained head: the accept paths are exercised
        assert max(max(r.accept_lengths) for r in results) > 1
    # The loop's log-probabilities on the real vocabulary (read from the verify logits): HF's
    # log_softmax over prompt + output, and its 5 likeliest as the top entries.
    p, res = prompts[1], results[1]
    with torch.no_grad():
        ref = torch.log_softmax(smollm_hf(torch.tensor([p + res.output_ids])).logits[0].float(), -1).numpy()
    ref = ref[len(p) - 1: -1]
    lp = res.logprobs
    np.testing.assert_allclose(lp.token_logprobs, ref[np.arange(len(ref)), res.output_ids], atol=5e-3)
    np.testing.assert_allclose(lp.top_logprobs, -np.sort(-ref, axis=-1)[:, :5], atol=5e-3)


def test_fast_tokenizer_path_equals_autotokenizer(smollm):
    """load_tokenizer skips AutoTokenizer (5 s of imports) for a plain tokenizer.json: the same
    ids, texts, chat template and special tokens as AutoTokenizer, on multi-byte and special text."""
    from transformers import AutoTokenizer

    ours, auto = smollm.tokenizer, AutoTokenizer.from_pretrained(str(smollm.path))
    assert type(ours).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    for text in ["Hello world", " leading space", "naïve café 日本語 😀", "def f(x):\n    return x",
                 "<|im_start|>user\nhi<|im_end|>", *CHAT_PROMPTS[:3]]:
        ids = auto.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids and ours.encode(text) == auto.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    m = [{"role": "user", "content": "Hi there"}]
    assert (ours.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
            == auto.apply_chat_template(m, add_generation_prompt=True, tokenize=False))
    assert (ours.eos_token_id, ours.bos_token_id, ours.all_special_ids) == (
        auto.eos_token_id, auto.bos_token_id, auto.all_special_ids)


def test_q4_1_blocks_match_hf(smollm, smollm_hf, prompts):
    """engine.quantize = "gguf" (issue 29): the embedded model on its own Q4_1 / Q8_0 blocks equals
    Hugging Face on the dequantized weights (which is what smollm_hf loads), tie-aware, on the chat
    prompts and two held-out ShareGPT prompts (speculation on blocks: tests/test_gguf_blocks.py)."""
    from jaxspec.models.gguf_convert import read_blocks
    from jaxspec.models.loading import default_gguf_path
    from jaxspec.train.sharegpt import sharegpt_heldout_prompts

    params = {**smollm.params, "gguf": read_blocks(default_gguf_path())}
    ecfg = dataclasses.replace(ENGINE, quantize="gguf")
    engine = Engine(params, smollm.config, ecfg, progress=False)
    assert engine.runner.params["layers"][0]["wqkv"].bits == 4 and engine.runner.params["head"].bits == 8
    heldout = [p for p in chat_ids(smollm.tokenizer, sharegpt_heldout_prompts(8)) if len(p) <= 160][:2]
    assert len(heldout) == 2
    reqs = [Request(p, SamplingParams(max_tokens=NEW if i < len(prompts) else 32))
            for i, p in enumerate(list(prompts) + heldout)]
    results = engine.generate(reqs)
    for req, res in zip(reqs, results):
        assert len(res.output_ids) == req.params.max_tokens
        assert_teacher_forced_greedy(smollm_hf, req.prompt_ids, res.output_ids)
