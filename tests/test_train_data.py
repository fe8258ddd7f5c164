"""Drafter training data (jaxspec/train/data.py): ShareGPT parsing and splits, loss masks, captured
features against torch, the resumable feature cache and its errors, regeneration, the draft vocabulary."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxspec.speculative.types import FeatureRequest
from jaxspec.train import data as D
from jaxspec.train import sharegpt as S

CONVS = [
    {"id": "a_0", "conversations": [{"from": "human", "value": "What is a hash table?"},
                                    {"from": "gpt", "value": "A map from keys to values."},
                                    {"from": "human", "value": "And a heap?"},
                                    {"from": "gpt", "value": "A tree with an order on parents."}]},
    {"id": "b_0", "conversations": [{"from": "gpt", "value": "leading assistant, dropped"},
                                    {"from": "system", "value": "dropped"},
                                    {"from": "human", "value": "Name three rivers."},
                                    {"from": "bing", "value": "other role, dropped"},
                                    {"from": "gpt", "value": ""}, {"from": "gpt", "value": 7},
                                    {"from": "gpt", "value": "Nile, Amazon, Danube."}]},
    {"id": "c_0", "conversations": [{"from": "human", "value": "   "}]},  # nothing left: skipped
    {"id": "d_3", "conversations": [{"from": "human", "value": "Write a poem"}, {"from": "gpt", "value": "Roses."}]},
]
MTB = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
       "and must-see attractions.")


def synthetic(n: int) -> list[S.Conversation]:
    words = "alpha beta gamma delta river stone cloud paper light code".split()
    out = []
    for i in range(n):
        user = " ".join(words[(i + j) % 10] for j in range(3 + i % 4)) + "?"
        asst = " ".join(words[(i * 3 + j) % 10] for j in range(4 + i % 5)) + "."
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": asst}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": "more"}, {"role": "assistant", "content": asst.upper()}]
        out.append(S.Conversation(f"s{i}_0", tuple(msgs)))
    return out


@pytest.fixture(scope="module")
def chat(chat_model_dir):
    from jaxspec.models.loading import load_model

    return load_model(str(chat_model_dir), progress=False)


def test_sharegpt_parser_reads_whole_elements_and_stops_at_truncation(tmp_path):
    full = tmp_path / "full.json"
    full.write_text(json.dumps(CONVS, indent=2))
    text = full.read_text()
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.index('"d_3"') + 40])  # inside the last element
    got = list(S.sharegpt_conversations("all", path=full, exclude=[]))
    assert [c.id for c in got] == ["a_0", "b_0", "d_3"]
    assert [m["role"] for m in got[0].messages] == ["user", "assistant", "user", "assistant"]
    assert got[1].messages == ({"role": "user", "content": "Name three rivers."},
                               {"role": "assistant", "content": "Nile, Amazon, Danube."})
    assert [c.id for c in S.sharegpt_conversations("all", path=cut, exclude=[])] == ["a_0", "b_0"]
    assert len(list(S.iter_json_array(cut, chunk_chars=7))) == 3  # tiny chunks: elements span reads


def test_benchmarks_are_excluded_and_split_is_disjoint_and_stable(tmp_path):
    prompts = S.benchmark_prompts()
    assert any("hawaii" in p for p in prompts) and any("def has_close_elements" in p for p in prompts)
    convs = CONVS + [{"id": "m_0", "conversations": [{"from": "human", "value": "Please:\n " + MTB.upper()},
                                                     {"from": "gpt", "value": "Aloha"}]}]
    path = tmp_path / "x.json"
    path.write_text(json.dumps(convs))
    ids = [c.id for c in S.sharegpt_conversations("all", path=path)]
    assert ids == ["a_0", "b_0", "d_3"]  # m_0 holds an MT-Bench question; positive control: the rest stay
    assert "m_0" in [c.id for c in S.sharegpt_conversations("all", path=path, exclude=[])]
    many = [f"x{i}_{j}" for i in range(300) for j in range(2)]
    split = {i: S.split_of(i, 0.2) for i in many}
    assert split == {i: S.split_of(i, 0.2) for i in many}  # stable
    assert 30 < sum(v == "heldout" for v in split.values()) < 210
    assert all(split[f"x{i}_0"] == split[f"x{i}_1"] for i in range(300))  # parts of one conversation together
    tr = {c.id for c in S.sharegpt_conversations("train", path=path, heldout_fraction=0.5, exclude=[])}
    ho = {c.id for c in S.sharegpt_conversations("heldout", path=path, heldout_fraction=0.5, exclude=[])}
    assert not tr & ho and tr | ho == {"a_0", "b_0", "d_3", "m_0"}


def test_real_sharegpt_head():
    convs = list(S.sharegpt_conversations("all", limit=100))
    assert len(convs) == 100 and convs[0].id == "QWJhYvA_0"
    for c in convs:
        assert c.messages[0]["role"] == "user"
        assert all(m["role"] != n["role"] for m, n in zip(c.messages, c.messages[1:]))
    train = {c.id for c in S.sharegpt_conversations("train", limit=98)}
    held = {c.id for c in S.sharegpt_conversations("heldout", limit=2)}
    assert len(held) == 2 and not train & held


def test_loss_mask_covers_exactly_the_assistant_tokens(chat):
    tok = chat.tokenizer
    convs = synthetic(4)
    exs = D.build_examples(convs, tok, source="raw", max_len=512)
    assert len(exs) == 4
    for c, e in zip(convs, exs):
        assert e.tokens.tolist() == D._template(tok, c.messages, False)
        idx = np.flatnonzero(e.loss_mask)
        spans = np.split(idx, np.flatnonzero(np.diff(idx) > 1) + 1)
        want = [m["content"] + tok.eos_token for m in c.messages if m["role"] == "assistant"]
        assert [tok.decode(e.tokens[s]) for s in spans] == want
    short = D.build_examples(convs[:1], tok, source="raw", max_len=60)[0]  # truncated inside turn 2
    assert len(short.tokens) == 60 and short.loss_mask.sum() < exs[0].loss_mask.sum()


def _torch_states(model, seq, layers):
    import torch

    got = {}
    def keep(name):  # a forward hook that returns None (a returned value would replace the output)
        return lambda m, i, o: got.__setitem__(name, i[0])

    h1 = model.model.norm.register_forward_hook(keep("pre"))
    h2 = model.lm_head.register_forward_hook(keep("final"))
    with torch.no_grad():
        hs = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    h1.remove(), h2.remove()
    L = model.config.num_hidden_layers
    aux = np.concatenate([(got["pre"] if k == L else hs[k])[0].numpy() for k in layers], -1)
    return aux, got["final"][0].numpy()


def test_captured_features_equal_torch(tiny_dirs):
    from jaxspec.models.loading import load_model

    path, hf = tiny_dirs["llama"]
    model = load_model(str(path), progress=False)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 256, n) for n in (5, 70, 17, 40, 1)]
    layers = (0, 1, 2)
    feats = D.capture_features(model.params, model.config, seqs, FeatureRequest(layers, True), batch=2)
    for s, f in zip(seqs, feats):
        aux, final = _torch_states(hf, s.tolist(), layers)
        assert f["aux"].dtype == np.float16 and f["aux"].shape == (len(s), 3 * 64) and f["final"].shape == (len(s), 64)
        np.testing.assert_allclose(f["aux"].astype(np.float32), aux, rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(f["final"].astype(np.float32), final, rtol=2e-3, atol=2e-3)
    shifted = D.capture_features(model.params, model.config, seqs[:1], FeatureRequest((1,), True), batch=2)[0]
    assert not np.allclose(shifted["aux"].astype(np.float32), _torch_states(hf, seqs[0].tolist(), (0,))[0], atol=1e-2)


@pytest.mark.parametrize("quantize", ["int8", "gguf"])
def test_captured_features_on_quantized_weights_equal_torch(tiny_dirs, quantize):
    """Feature capture on the quantized target (issue 29) equals Hugging Face running the dequantized
    weights, and differs from the float model's features (the quantized kernels ran)."""
    from jaxspec.models.loading import load_model
    from tests.test_gguf_blocks import HF_LINEARS, quantized_reference
    from tests.test_quantize import dequantized_hf

    path, hf = tiny_dirs["llama"]
    model = load_model(str(path), progress=False)
    params = model.params
    if quantize == "gguf":
        params["gguf"], ref = quantized_reference(hf, {k: "Q4_1" for k in HF_LINEARS})
    else:
        ref = dequantized_hf(hf)
    seq = np.random.default_rng(1).integers(3, 256, 40)
    f = D.capture_features(params, model.config, [seq], FeatureRequest((0, 2), True), batch=2, quantize=quantize)[0]
    aux, final = _torch_states(ref, seq.tolist(), (0, 2))
    np.testing.assert_allclose(f["aux"].astype(np.float32), aux, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(f["final"].astype(np.float32), final, rtol=2e-3, atol=2e-3)
    assert not np.allclose(f["final"].astype(np.float32), _torch_states(hf, seq.tolist(), (0,))[1], atol=2e-3)


def _build(d, chat, convs, **kw):
    args = dict(target="tiny", request=FeatureRequest((0, 1), True), num_conversations=len(convs), max_len=64,
                shard_conversations=3, batch=4)
    args.update(kw)
    return D.build_cache(d, convs, chat.params, chat.config, chat.tokenizer, **args)


@pytest.fixture(scope="module")
def built(chat, tmp_path_factory):
    convs = synthetic(10)
    d = tmp_path_factory.mktemp("cache_full")
    return _build(d, chat, convs), convs


def test_cache_resumes_to_the_uninterrupted_result(chat, built, tmp_path):
    full, convs = built
    part = _build(tmp_path, chat, convs, max_shards=1)
    assert part.manifest["position"] == 3 and len(part.shards) == 1
    resumed = _build(tmp_path, chat, convs, resume=True)
    assert resumed.manifest == full.manifest and full.manifest["position"] == 10 and len(full.shards) == 4
    assert full.num_examples == 10
    for k in range(4):
        for key in D.FeatureCache.KEYS:
            np.testing.assert_array_equal(resumed.shard(k)[key], full.shard(k)[key])
    s = full.shard(0)
    assert s["tokens"].dtype == np.int32 and s["aux"].dtype == np.float16 and s["aux"].shape[2] == 128
    assert s["loss_mask"][0].sum() > 0 and not s["loss_mask"][0, s["lengths"][0]:].any()


def test_corrupt_shard_and_mismatched_manifest_give_clear_errors(chat, built, tmp_path):
    import shutil

    full, convs = built
    d = tmp_path / "c"
    shutil.copytree(full.dir, d)
    D.FeatureCache(d).verify()  # positive control
    D.FeatureCache(d).check(target="tiny", feature_layers=(0, 1), max_len=64)
    data = (d / "shard_00001.npz").read_bytes()
    (d / "shard_00001.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(D.DataError, match="shard_00001.npz.*corrupt"):
        D.FeatureCache(d).verify()
    D.FeatureCache(d).shard(0)
    with pytest.raises(D.DataError, match="'feature_layers' is \\[0, 1\\] but \\[1, 2\\]"):
        D.FeatureCache(d).check(feature_layers=(1, 2))
    with pytest.raises(D.DataError, match="manifest.json: field 'max_len' is 64 but 32"):
        _build(d, chat, convs, max_len=32)
    with pytest.raises(D.DataError, match="'target' is 'tiny' but 'other'"):
        _build(d, chat, convs, target="other")
    with pytest.raises(D.DataError, match="no manifest"):
        D.FeatureCache(tmp_path)


def test_a_campaign_round_takes_the_next_conversations(chat, built, tmp_path):
    """first_conversation = 6: the cache of conversations 6..9 equals the full cache's rows of them,
    and the manifest records where it starts (a resume with another start is refused)."""
    full, convs = built
    later = _build(tmp_path, chat, convs, num_conversations=4, first_conversation=6)
    assert later.manifest["first_conversation"] == 6 and later.num_examples == 4
    assert later.manifest["shards"][0]["conversations"] == [6, 9]
    want = np.concatenate([full.shard(k)["tokens"] for k in range(len(full.shards))])[6:10]
    got = np.concatenate([later.shard(k)["tokens"] for k in range(len(later.shards))])
    np.testing.assert_array_equal(got, want)
    with pytest.raises(D.DataError, match="first_conversation"):
        _build(tmp_path, chat, convs, num_conversations=4, first_conversation=5, resume=True)


def test_iterate_is_deterministic_and_resumes_bit_exact(built):
    cache, _ = built
    n = cache.num_examples
    a = list(cache.iterate(2, seed=1, epoch=0, drop_last=False))
    b = list(cache.iterate(2, seed=1, epoch=0, drop_last=False))
    assert all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)
    seen = [tuple(r) for x in a for r in x["index"] if r[0] >= 0]
    assert len(seen) == n == len(set(seen))
    assert [x["index"].tolist() for x in cache.iterate(2, 1, 1)] != [x["index"].tolist() for x in a[: n // 2]]
    assert a[0]["tokens"].shape == (2, 64) and a[0]["aux"].shape == (2, 64, 128)
    ref = cache.loader(3, seed=5)
    want = [next(ref)["index"].tolist() for _ in range(7)]
    ld = cache.loader(3, seed=5)
    [next(ld) for _ in range(4)]
    again = cache.loader(3, seed=5)
    again.load_state_dict(json.loads(json.dumps(ld.state_dict())))
    assert [next(again)["index"].tolist() for _ in range(3)] == want[4:]


def test_length_grouping_is_a_permutation_with_tighter_batches(built):
    cache, _ = built
    plain, grouped = cache.order(3, 0), cache.order(3, 0, group=6, batch=2)
    assert sorted(plain) == sorted(grouped) and grouped == cache.order(3, 0, group=6, batch=2)
    lens = {k: cache.lengths(k) for k in range(len(cache.shards))}

    def spread(order):  # summed padding inside batches of 2
        ls = [int(lens[k][r]) for k, r in order]
        return sum(abs(a - b) for a, b in zip(ls[0::2], ls[1::2]))

    assert spread(grouped) < spread(plain)  # positive control: the shuffled order is not already tight
    assert grouped != plain
    rows = list(cache.iterate(2, 3, 0, group=6))
    assert [r["index"].tolist() for r in rows] == [[list(x) for x in grouped[i:i + 2]] for i in range(0, 10, 2)]


def test_cache_union_reads_both_and_refuses_another_layout(chat, built, tmp_path):
    import shutil

    from jaxspec.train.trainer import open_source

    full, convs = built
    other = _build(tmp_path / "b", chat, convs[:4])
    both = open_source(f"{full.dir},{other.dir}")
    assert isinstance(both, D.CacheUnion) and both.num_examples == full.num_examples + other.num_examples
    seen = [tuple(r) for x in both.iterate(2, 0, 0, drop_last=False) for r in x["index"] if r[0] >= 0]
    assert len(set(seen)) == both.num_examples
    k = len(full.shards)  # the second cache's first shard, read from its own directory
    np.testing.assert_array_equal(both.shard(k)["tokens"], other.shard(0)["tokens"])
    assert both.token_counts(chat.config.vocab_size).sum() == (full.token_counts(chat.config.vocab_size).sum()
                                                              + other.token_counts(chat.config.vocab_size).sum())
    shutil.copytree(other.dir, tmp_path / "c")
    m = json.loads((tmp_path / "c" / "manifest.json").read_text())
    m["feature_layers"] = [0, 2]
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(D.DataError, match="'feature_layers' is \\[0, 2\\] but \\[0, 1\\]"):
        open_source(f"{full.dir},{tmp_path / 'c'}")
    with pytest.raises(FileNotFoundError, match="is not a feature cache"):
        open_source(f"{full.dir},{tmp_path / 'nope'}")


def test_regenerate_is_the_engines_greedy_continuation(chat):
    from jaxspec.config import EngineSection
    from jaxspec.engine import Engine, Request
    from jaxspec.sampling_params import SamplingParams

    engine = Engine(chat.params, chat.config, EngineSection(max_batch_size=4, max_context=128,
                    length_buckets=(64, 128)), progress=False)
    convs = synthetic(5)
    exs = D.build_examples(convs, chat.tokenizer, source="regenerate", engine=engine, max_len=128,
                           temperature=0.0, max_new_tokens=10)
    assert len(exs) == 5
    for c, e in zip(convs, exs):
        prompt = D._template(chat.tokenizer, c.messages[:1], True)
        out = engine.generate([Request(prompt, SamplingParams(max_tokens=10), stop_token_ids=(2,))])[0].output_ids
        assert len(out) == 10 and e.tokens.tolist() == prompt + out and e.loss_mask.tolist() == [False] * len(prompt) + [True] * len(out)
    hot = D.build_examples(convs, chat.tokenizer, source="regenerate", engine=engine, max_len=128,
                           temperature=30.0, max_new_tokens=10)  # the tiny head is sharpened x8
    assert any(x.tokens.tolist() != y.tokens.tolist() for x, y in zip(hot, exs))  # control: sampling differs


def test_draft_vocab_round_trip(built):
    counts = np.zeros(20, np.int64)
    counts[[3, 7, 9, 15]] = [5, 9, 5, 1]
    d2t, t2d = D.draft_vocab(counts, 3, 20)
    assert d2t.dtype == np.int64 and t2d.dtype == bool
    assert (np.arange(3) + d2t).tolist() == [3, 7, 9]  # 7 (9), then 3 and 9 tie at 5: lower id first
    d2t, t2d = D.draft_vocab(counts, 6, 20)
    assert (np.arange(6) + d2t).tolist() == [0, 1, 3, 7, 9, 15]  # filled with the lowest unused ids
    cache, _ = built
    counts = cache.token_counts(cache.manifest["vocab_size"])
    d2t, t2d = D.draft_vocab(cache, 16, cache.manifest["vocab_size"])
    used = np.arange(16) + d2t
    assert np.all(np.diff(used) > 0) and t2d.sum() == 16 and np.flatnonzero(t2d).tolist() == used.tolist()
    assert counts[used].min() >= np.sort(counts)[::-1][15]
    with pytest.raises(D.DataError, match="draft_vocab_size"):
        D.draft_vocab(counts, 0, len(counts))
