"""FROZEN_KV_MTP (issue 30, part 1): draft layers over the target's own cached K/V.

1. The drafter's chain, fed by prefill and observe like the loop feeds it and reading the target's
   paged cache, drafts what a torch reference computes from Hugging Face's own K/V of the same
   target and the same safetensors (both layouts: the published Gemma 4 assistant and jaxspec's,
   page sizes 1 and 16, a sliding-window draft layer); logits match too.
2. Trees: depth-1 nodes are the root's top-k, deeper nodes their parent's top-k continuation.
3. Greedy speculative output equals plain output (batch 1 and 4, page sizes 1 and 16, chains and
   trees), selected by --spec eagle / nextn from the head's config as SGLang promotes it.
4. The protocol: only a drafter that declares target_kv_layers sees the target cache in propose.
5. Errors: no target_layer_ids, a centroid head whose clusters do not divide the vocabulary, eagle3
   with this head, geometry mismatches. (Gemma 4's centroid LM head itself runs: 1 and 3.)
6. Training: the loss falls on a tiny corpus and the export loads back to the same drafts.
(The sampled loop's chi-square: tests/test_feature_distribution.py; the compiled loop never copies
the cache: tests/test_spec_loop.py; server preemption: tests/test_serve_features.py.)
"""

from __future__ import annotations

import dataclasses
import json
import math
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache.paged import KVCache
from jaxspec.config import EngineSection, SpecSection
from jaxspec.engine import Engine, Request
from jaxspec.models.config import ConfigError
from jaxspec.models.llama import forward, prepare_params
from jaxspec.models.loading import load_model
from jaxspec.sampling_params import SamplingParams
from jaxspec.speculative.drafters import build_drafter, validate_spec_config
from jaxspec.speculative.drafters.load import load_draft
from jaxspec.speculative.loop import SpecPlan, target_kv
from jaxspec.speculative.types import Committed
from tests.heads_fixtures import write_frozen_kv_head
from tests.reference import greedy_rows


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A 4-layer tiny llama (the head reads layers 2 and 3) and heads in both layouts."""
    from tests.conftest import make_tiny_hf

    hf = make_tiny_hf("llama", num_hidden_layers=4)
    tmp = tmp_path_factory.mktemp("fkv")
    hf.save_pretrained(tmp / "target")
    model = load_model(str(tmp / "target"), progress=False)
    heads = {
        "jaxspec": write_frozen_kv_head(tmp / "jaxspec", hf, draft_vocab_size=96),
        "published": write_frozen_kv_head(tmp / "published", hf, published=True, layer_ids=[3, 2], hidden=48,
                                          heads=2),
        "sliding": write_frozen_kv_head(tmp / "sliding", hf, sliding=True, window=4, seed=3),
        # Gemma 4 E2B/E4B's centroid LM head: 16 clusters of 16 tokens, the best 4 scored.
        "centroid": write_frozen_kv_head(tmp / "centroid", hf, published=True, layer_ids=[3, 2], seed=4,
                                         centroids=16, centroid_top_k=4),
    }
    return SimpleNamespace(model=model, hf=hf, heads=heads, tmp=tmp)


def _drafter(model, head, topk=1, steps=3, n=4, **kw):
    spec = validate_spec_config(SpecSection(algorithm="eagle", draft_model=str(head), topk=topk, num_steps=steps,
                                            num_draft_tokens=n, verify="greedy", **kw))
    assert spec.algorithm == "frozen_kv_mtp"  # promoted from eagle by the head's architectures
    loaded, hcfg = load_draft(spec, model, jnp.float32, progress=False)
    drafter = build_drafter(SpecPlan.from_config(spec), spec, draft_cfg=hcfg, target_cfg=model.config)
    target = prepare_params(model.params, model.config, unstack=False)
    params = {"own": drafter.prepare_params(loaded, native=False, unstack=None),
              "target": {k: target[k] for k in drafter.shares_target}}
    return drafter, params, hcfg, target


def _drive(model, drafter, params, target, tokens, prompt_len, chunks, page_size):
    """Prefill the prompt into the target's paged cache and the drafter, then commit chunks as the
    loop does (the verify writes the target K/V, observe moves the seed); propose at the end."""
    cfg = model.config
    maxp = 64 // page_size
    table = jnp.arange(1, maxp + 1)[None]
    cache = KVCache.zeros(cfg.num_layers, maxp + 1, page_size, cfg.num_kv_heads, cfg.head_dim)
    x = jnp.asarray([tokens])
    state = drafter.init_state(None, 1)

    def run(start, count, width):
        nonlocal cache
        blk = jnp.pad(x[:, start:start + count], ((0, 0), (0, width - count)))
        out = forward(target, cfg, blk, start + jnp.arange(width)[None], cache, table, q_start=jnp.array([start]),
                      kv_len=jnp.array([start + count]), capture_final=True)
        cache = out.cache
        return Committed(blk, out.features, jnp.array([start]), jnp.array([count]))

    state = drafter.prefill(params, state, run(0, prompt_len, prompt_len), table)
    a = prompt_len
    for c in chunks:
        state = drafter.observe(params, state, run(a, c, 4), table)
        a += c
    assert a == len(tokens) - 1  # the root's K/V is not in the cache yet
    s = SimpleNamespace(history=jnp.zeros((1, 64), jnp.int32).at[0, :len(tokens)].set(x[0]),
                        hist_len=jnp.array([len(tokens)]), page_table=table, done=jnp.array([False]),
                        sampling=greedy_rows(1), prompt_lens=jnp.array([prompt_len]), corpus=None,
                        cache=target_kv(drafter, cache))
    return drafter.propose(params, state, s)


def torch_chain(hf, head_dir, tokens, depth, *, seed_offset=0, swap_layers=False, forced=()):
    """The draft chain and its logits from Hugging Face's own K/V and final-norm state of tokens[:-1],
    with the assistant written out in torch from the safetensors (the published semantics).
    `forced`: feed these drafts instead of the argmax (a tree path)."""
    import torch
    from safetensors.torch import load_file
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = json.loads((head_dir / "config.json").read_text())
    text, w = cfg["text_config"], load_file(str(head_dir / "model.safetensors"))
    published = cfg["model_type"] == "gemma4_assistant"
    ids = list(cfg["target_layer_ids"])[::-1] if swap_layers else list(cfg["target_layer_ids"])
    eps, hd, nh = text["rms_norm_eps"], text["head_dim"], text["num_attention_heads"]
    scale = 1.0 if published else hd ** -0.5
    embed_scale = math.sqrt(cfg["backbone_hidden_size"]) if published else 1.0
    act = (lambda t: torch.nn.functional.gelu(t, approximate="tanh")) if published else torch.nn.functional.silu
    norm = lambda t, g: g * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps))  # noqa: E731
    d2t = w.get("d2t")
    lm = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
    with torch.no_grad():
        n = len(tokens) - 1
        out = hf.model(torch.tensor([tokens[:n]]), use_cache=True)
        h = out.last_hidden_state[:, n - 1 - seed_offset]  # [1, H] post final norm
        kv = out.past_key_values
        cos, sin = hf.model.rotary_emb(h[:, None], torch.tensor([[n - 1]]))
        tok, drafts, logits_all = tokens[-1], [], []
        for _ in range(depth):
            e = hf.model.embed_tokens(torch.tensor([tok])) * embed_scale
            x = torch.cat([e, h], -1) @ w["pre_projection.weight"].T
            for i, layer in enumerate(ids):
                p = f"model.layers.{i}."
                q = (norm(x, w[p + "input_layernorm.weight"]) @ w[p + "self_attn.q_proj.weight"].T).view(1, nh, 1, hd)
                if p + "self_attn.q_norm.weight" in w:
                    q = norm(q, w[p + "self_attn.q_norm.weight"])
                q, _ = apply_rotary_pos_emb(q, q, cos, sin)
                k, v = kv.layers[layer].keys, kv.layers[layer].values  # [1, kvh, n, hd]
                if text["layer_types"][i] == "sliding_attention":
                    k, v = k[:, :, -text["sliding_window"]:], v[:, :, -text["sliding_window"]:]
                k, v = (t.repeat_interleave(nh // t.shape[1], dim=1) for t in (k, v))
                a = torch.softmax((q @ k.transpose(-1, -2)) * scale, -1) @ v  # [1, nh, 1, hd]
                o = a.transpose(1, 2).reshape(1, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
                x = x + norm(o, w[p + "post_attention_layernorm.weight"])
                m = norm(x, w[p + "pre_feedforward_layernorm.weight"])
                m = (act(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) @ \
                    w[p + "mlp.down_proj.weight"].T
                x = (x + norm(m, w[p + "post_feedforward_layernorm.weight"])) * w[p + "layer_scalar"]
            y = norm(x, w["model.norm.weight"])
            logits = y @ lm.T
            if cfg.get("use_ordered_embeddings"):  # HF's Gemma4AssistantMaskedEmbedder, one row
                c, k = cfg["num_centroids"], cfg["centroid_intermediate_top_k"]
                top = torch.topk(y @ w["masked_embedding.centroids.weight"].T, k).indices[0]
                sel = w["masked_embedding.token_ordering"].view(c, -1)[top].reshape(-1)
                scored = (y @ lm[sel].T)[0]
                logits = torch.full_like(logits, float(scored.min()) - 1.0)
                logits[0, sel] = scored
            h = y @ w["post_projection.weight"].T
            i = int(torch.argmax(logits[0]))
            tok = i + int(d2t[i]) if d2t is not None else i
            if len(drafts) < len(forced):
                tok = forced[len(drafts)]
            drafts.append(tok)
            logits_all.append(logits[0].numpy())
    return drafts, logits_all


# ---- 1. propose == torch over Hugging Face's K/V ------------------------------------------------


@pytest.mark.parametrize("which,page_size", [("jaxspec", 1), ("jaxspec", 16), ("published", 16), ("sliding", 4),
                                             ("centroid", 16)])
def test_chain_equals_torch_reference_over_hf_kv(world, which, page_size):
    head = world.heads[which]
    drafter, params, hcfg, target = _drafter(world.model, head)
    tokens = np.random.default_rng(2).integers(3, 250, size=15).tolist()
    prop = _drive(world.model, drafter, params, target, tokens, 6, [1, 3, 2, 2], page_size)
    ref, ref_logits = torch_chain(world.hf, head, tokens, 3)
    assert prop.tokens[0].tolist() == [tokens[-1]] + ref
    # The head's logits on Hugging Face's own K/V and seed, step 1, equal the torch reference's.
    import torch

    from jaxspec.models.heads.frozen_kv import frozen_kv_step, window_mask

    n = len(tokens) - 1
    with torch.no_grad():
        out = world.hf.model(torch.tensor([tokens[:n]]), use_cache=True)
    ctx = []
    for i, layer in enumerate(hcfg.target_kv_layers):
        k, v = (jnp.asarray(getattr(out.past_key_values.layers[layer], a)[0].transpose(0, 1).numpy())[None]
                for a in ("keys", "values"))
        ctx.append((k, v, window_mask(jnp.ones((1, 1, n), bool), jnp.array([[n]]), hcfg, i)))
    seed = jnp.asarray(out.last_hidden_state[:, n - 1:n].numpy())
    _, logits = frozen_kv_step(params["own"], hcfg, params["target"], jnp.array([[tokens[-1]]]), seed,
                               jnp.array([[n - 1]]), ctx)
    np.testing.assert_allclose(np.asarray(logits[0, 0]), ref_logits[0], atol=2e-4, rtol=2e-4)
    # Positive controls: the seed one position early, or the layers swapped, draft differently.
    assert torch_chain(world.hf, head, tokens, 3, seed_offset=1)[0] != ref
    if which != "sliding":
        assert torch_chain(world.hf, head, tokens, 3, swap_layers=True)[0] != ref


# ---- 2. trees -----------------------------------------------------------------------------------


def test_tree_nodes_are_top_k_continuations(world):
    """EAGLE-2 tree: the root's best child is always kept, depth-1 nodes are among the root's top-k, and
    every deeper node is among the top-k of its parent's step (the torch chain continued from it)."""
    head = world.heads["jaxspec"]
    drafter, params, hcfg, target = _drafter(world.model, head, topk=3, steps=3, n=8)
    tokens = np.random.default_rng(5).integers(3, 250, size=12).tolist()
    prop = _drive(world.model, drafter, params, target, tokens, 5, [2, 3, 1], 16)
    tok, par = np.asarray(prop.tokens[0]).tolist(), np.asarray(prop.parents[0]).tolist()
    d2t = np.arange(96) + np.asarray(params["own"]["d2t"])

    def top3(path):  # the top-3 children after the root and `path` (the seed and h chain as drafted)
        _, logits = torch_chain_from(world.hf, head, tokens, path)
        return [int(d2t[i]) for i in np.argsort(-logits)[:3]]

    root_top = top3([])
    assert tok[1] == root_top[0]
    checked = 0
    for i in range(1, len(tok)):
        path, j = [], i
        while j > 0:
            path.insert(0, tok[j])
            j = par[j]
        assert tok[i] in top3(path[:-1]), (i, tok, par)
        checked += par[i] > 0
    assert checked >= 2


def torch_chain_from(hf, head_dir, tokens, path):
    """(drafts, last logits) of the torch reference forced along `path` (draft tokens after the root)."""
    drafts, logits = torch_chain(hf, head_dir, tokens, len(path) + 1, forced=path)
    return drafts, logits[-1]


# ---- 3. greedy == plain, through the engine -----------------------------------------------------

REQS = [Request([5, 9, 17, 33, 2, 7, 11][: 2 + 2 * i], SamplingParams(max_tokens=18)) for i in range(3)]


def _ecfg(page_size, batch):
    return EngineSection(max_batch_size=batch, max_context=128, length_buckets=(16, 32, 64, 128),
                         batch_buckets=(1, batch), page_size=page_size)


@pytest.fixture(scope="module")
def plain(world):
    return [r.output_ids for r in Engine(world.model.params, world.model.config, _ecfg(16, 4), progress=False)
            .generate(REQS)]


@pytest.mark.parametrize("alg,topk,steps,n,page_size,batch,head", [
    ("nextn", 1, 3, 4, 1, 4, "jaxspec"), ("eagle", 1, 3, 4, 16, 1, "jaxspec"),
    ("frozen_kv_mtp", 2, 3, 6, 16, 4, "jaxspec"), ("frozen_kv_mtp", 2, 2, 5, 1, 1, "jaxspec"),
    ("frozen_kv_mtp", 2, 3, 6, 16, 4, "centroid")])
def test_greedy_equals_plain(world, plain, alg, topk, steps, n, page_size, batch, head):
    spec = validate_spec_config(SpecSection(algorithm=alg, draft_model=str(world.heads[head]), topk=topk,
                                            num_steps=steps, num_draft_tokens=n))
    assert spec.algorithm == "frozen_kv_mtp"
    draft = load_draft(spec, world.model, jnp.float32, progress=False)
    engine = Engine(world.model.params, world.model.config, _ecfg(page_size, batch), progress=False, spec=spec,
                    draft=draft)
    assert engine.runner.draft_cache is None  # no draft KV is allocated
    out = engine.generate(REQS)
    assert [r.output_ids for r in out] == plain
    for r in out:
        assert sum(r.accept_lengths) == len(r.output_ids) - 1


# ---- 4. the protocol ----------------------------------------------------------------------------


def test_only_a_declared_drafter_sees_the_target_cache(world):
    """propose gets the declared layers' pools (the carry's own arrays: no copy) or nothing."""
    cache = KVCache.zeros(4, 3, 16, 2, 16)
    cache = dataclasses.replace(cache, k=cache.k.at[2].set(2.0).at[3].set(3.0))
    declared = SimpleNamespace(target_kv_layers=(3, 2))
    view = target_kv(declared, cache)
    assert view.layers == (3, 2) and float(view.k[0][0, 0, 0, 0]) == 3.0 and float(view.k[1][0, 0, 0, 0]) == 2.0
    assert target_kv(SimpleNamespace(), cache) is None  # undeclared: nothing (positive control above)
    from jaxspec.speculative.types import DrafterContractError

    with pytest.raises(DrafterContractError, match=r"target_kv_layers \[1, 7\]; \[7\] are outside"):
        target_kv(SimpleNamespace(target_kv_layers=(1, 7)), cache)


# ---- 5. errors ----------------------------------------------------------------------------------


def _edit(world, name, **changes):
    import shutil

    d = world.tmp / name
    shutil.copytree(world.heads["jaxspec"], d, dirs_exist_ok=True)
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        elif k == "text_config":
            cfg[k].update(v)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("changes,match", [
    (dict(target_layer_ids=None), "names no target_layer_ids"),
    (dict(target_layer_ids=[2, 9]), r"\[9\] outside \[0, 4\)"),
    (dict(target_layer_ids=[2]), "one target layer per draft layer"),
    (dict(use_ordered_embeddings=True, num_centroids=7), "num_centroids 7 must divide the vocabulary"),
    (dict(text_config={"num_key_value_heads": 4}), "num_key_value_heads 4 != target num_key_value_heads 2"),
    (dict(text_config={"hidden_activation": "relu2"}), "activation 'relu2' is not supported"),
])
def test_bad_heads_are_named(world, changes, match):
    d = _edit(world, "bad_" + "_".join(changes), **changes)
    spec = SpecSection(algorithm="frozen_kv_mtp", draft_model=str(d), topk=1, num_steps=3, num_draft_tokens=4)
    with pytest.raises(ConfigError, match=match):
        load_draft(spec, world.model, jnp.float32, progress=False)


def test_eagle3_with_a_frozen_kv_head_points_to_its_algorithm(world):
    spec = SpecSection(algorithm="eagle3", draft_model=str(world.heads["jaxspec"]), topk=1, num_steps=3,
                       num_draft_tokens=4)
    assert validate_spec_config(spec).algorithm == "eagle3"  # only eagle / nextn are promoted, as in SGLang
    with pytest.raises(ConfigError, match="holds a frozen_kv head: use --spec frozen_kv_mtp"):
        load_draft(spec, world.model, jnp.float32, progress=False)


# ---- 6. training --------------------------------------------------------------------------------


def test_training_lowers_the_loss_and_exports_what_it_trained(world, tmp_path):
    """A few steps on random rows with the target's own features: the loss falls; the export loads back
    through the drafter's loader and its chain equals the torch reference over HF's K/V."""
    from jaxspec.train.data import capture_features
    from jaxspec.speculative.types import FeatureRequest
    from jaxspec.train.trainer import ArraySource, TrainConfig, train

    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 200, size=48).astype(np.int32) for _ in range(8)]
    feats = capture_features(world.model.params, world.model.config, seqs, FeatureRequest((2, 3), True), batch=8)
    rows = {"tokens": np.stack(seqs), "lengths": np.full(8, 48, np.int32), "loss_mask": np.ones((8, 48), bool),
            "aux": np.stack([f["aux"] for f in feats]), "final": np.stack([f["final"] for f in feats])}
    cfg = TrainConfig(drafter="frozen_kv", target_kv_layers=(2, 3), lr=3e-3, total_steps=12, batch_size=4,
                      max_len=48, ttt_length=3, draft_vocab_size=64, log_every=1, save_every=100, warmup_ratio=0.0)
    res = train(cfg, world.model, ArraySource(rows), tmp_path / "run", progress=False)
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < 0.8 * log[0]["loss"]
    head = tmp_path / "run" / "head"
    assert json.loads((head / "config.json").read_text())["target_layer_ids"] == [2, 3]
    drafter, params, hcfg, target = _drafter(world.model, head)
    tokens = seqs[0][:14].tolist()
    prop = _drive(world.model, drafter, params, target, tokens, 6, [2, 3, 2], 16)
    assert prop.tokens[0, 1:].tolist() == torch_chain(world.hf, head, tokens, 3)[0]
    assert res.hcfg.target_kv_layers == (2, 3)


def test_centroid_head_exports_and_loads_back(world, tmp_path):
    """A centroid head written in jaxspec's format (export_head) loads back to the same tensors and
    settings: the clusters, the kept count and the token ordering survive."""
    from jaxspec.train.export import export_head

    spec = SpecSection(algorithm="frozen_kv_mtp", draft_model=str(world.heads["centroid"]), topk=1, num_steps=3,
                       num_draft_tokens=4)
    params, hcfg = load_draft(spec, world.model, jnp.float32, progress=False)
    out = export_head(params, hcfg, tmp_path / "out")
    again, hcfg2 = load_draft(dataclasses.replace(spec, draft_model=str(out)), world.model, jnp.float32,
                              progress=False)
    assert (hcfg2.num_centroids, hcfg2.centroid_top_k) == (16, 4)
    np.testing.assert_array_equal(again["token_ordering"], params["token_ordering"])
    np.testing.assert_array_equal(np.asarray(again["centroids"]), np.asarray(params["centroids"]))
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bad"  # a repeated token id in the ordering is refused
    bad.mkdir()
    t = load_file(str(world.heads["centroid"] / "model.safetensors"))
    t["masked_embedding.token_ordering"][1] = t["masked_embedding.token_ordering"][0]
    cfg = json.loads((world.heads["centroid"] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(ConfigError, match="not a permutation"):
        load_draft(dataclasses.replace(spec, draft_model=str(bad)), world.model, jnp.float32, progress=False)
