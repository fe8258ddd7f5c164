"""Block drafters (DFLASH, DSPARK) against independent references.

1. The block forward equals a torch reference written from z-lab/dflash's model
   (Qwen3 layers, context K/V from fc(features), bidirectional block, sliding
   layers causal in their window), loaded from the same safetensors file, with
   the target features taken from Hugging Face's `output_hidden_states`.
2. Incremental context (prefill chunks + observe after verify) drafts what the
   from-scratch reference drafts, with a positive control (features shifted by one).
3. Greedy speculative output equals plain greedy, batch 1 and 4, both drafters;
   DSPARK with a planner that cuts rows short (ragged verify) too, and its rows
   equal their batch-1 outputs; a second request compiles nothing.
4. Bad checkpoints and settings get one-line errors.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.cache.paged import KVCache
from jaxspec.config import EngineSection, SpecSection
from jaxspec.engine import Engine, Request
from jaxspec.sampling_params import SamplingParams
from jaxspec.models.heads.block import block_logits, output_offset
from jaxspec.models.llama import forward, prepare_params
from jaxspec.models.loading import load_model
from jaxspec.speculative.drafters import build_drafter
from jaxspec.speculative.drafters.load import load_draft
from jaxspec.speculative.loop import SpecPlan
from jaxspec.speculative.types import Committed
from tests.heads_fixtures import write_block_head
from tests.reference import compile_events, greedy_rows


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tests.conftest import make_tiny_hf

    # Four layers, so the captured ones (outputs of layers 0 and 2) are not the last, whose Hugging Face
    # hidden_states entry is taken after the final norm.
    hf = make_tiny_hf("llama", num_hidden_layers=4)
    tmp = tmp_path_factory.mktemp("block")
    hf.save_pretrained(tmp / "target")
    model = load_model(str(tmp / "target"), progress=False)
    heads = {
        "dflash": write_block_head(tmp / "dflash", hf, kind="dflash", block_size=8, layer_ids=(0, 2)),
        "dflash_swa": write_block_head(tmp / "swa", hf, kind="dflash", block_size=8, layer_ids=(1,),
                                       sliding_window=5, seed=1),
        "dspark": write_block_head(tmp / "dspark", hf, kind="dspark", block_size=6, layer_ids=(0, 2), seed=2),
    }
    return SimpleNamespace(model=model, hf=hf, heads=heads, tmp=tmp)


def spec_for(alg, head_dir, n, **kw):
    if alg != "dspark":  # only DSPARK's planner reads a table; DFLASH refuses one (it would ignore it)
        kw.pop("sps_table", None)
    return SpecSection(algorithm=alg, draft_model=str(head_dir), num_draft_tokens=n, **kw)


# ---- 1. the block forward against torch ----------------------------------------------------------


def torch_block_logits(head_dir: Path, hf, tokens: list[int], root_pos: int, width: int):
    """z-lab/dflash's DFlashDraftModel forward in plain torch: [width, V] logits of the block
    [tokens[root_pos], MASK...] over the context tokens[:root_pos]."""
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((head_dir / "config.json").read_text())
    sub = cfg.get("dflash_config") or cfg.get("dspark_config")
    sd = {k: v.double() for k, v in load_file(str(head_dir / "model.safetensors")).items()}
    nh, kvh, hd, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    types = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]

    def rms(x, w):
        return w * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # x [T, heads, hd]
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = pos[:, None].double() * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        rot = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos + rot * sin

    with torch.no_grad():
        ids = torch.tensor([tokens])
        hs = hf(ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1][0] for i in sub["target_layer_ids"]], -1)[:root_pos].double()
        ctx = rms(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"])
        block = torch.tensor([tokens[root_pos]] + [sub["mask_token_id"]] * (width - 1))
        x = hf.model.embed_tokens.weight.double()[block]
        qpos = torch.arange(root_pos, root_pos + width)
        kpos = torch.arange(0, root_pos + width)
        for i in range(cfg["num_hidden_layers"]):
            p = lambda n: sd[f"layers.{i}.{n}"]  # noqa: E731
            h = rms(x, p("input_layernorm.weight"))
            q = rms((h @ p("self_attn.q_proj.weight").T).view(width, nh, hd), p("self_attn.q_norm.weight"))
            kin = torch.cat([ctx, h])
            k = rms((kin @ p("self_attn.k_proj.weight").T).view(-1, kvh, hd), p("self_attn.k_norm.weight"))
            v = (kin @ p("self_attn.v_proj.weight").T).view(-1, kvh, hd)
            q, k = rope(q, qpos), rope(k, kpos)
            k, v = k.repeat_interleave(nh // kvh, 1), v.repeat_interleave(nh // kvh, 1)
            s = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
            if types[i] == "sliding_attention":
                d = qpos[:, None] - kpos[None, :]
                s = s.masked_fill(~((d >= 0) & (d < cfg["sliding_window"]))[None], float("-inf"))
            o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(width, nh * hd)
            x = x + o @ p("self_attn.o_proj.weight").T
            h = rms(x, p("post_attention_layernorm.weight"))
            g = h @ p("mlp.gate_proj.weight").T
            x = x + (torch.nn.functional.silu(g) * (h @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
        out = rms(x, sd["norm.weight"]) @ hf.lm_head.weight.double().T
    return out.numpy()


def _drafter(model, spec):
    spec = dataclasses.replace(spec, verify="greedy")
    head_params, hcfg = load_draft(spec, model, jnp.float32, progress=False)
    drafter = build_drafter(SpecPlan.from_config(spec), spec, draft_cfg=hcfg, target_cfg=model.config)
    target = prepare_params(model.params, model.config, unstack=False)
    params = {"own": drafter.prepare_params(head_params, native=False, unstack=None),
              "target": {k: target[k] for k in drafter.shares_target}}
    return drafter, params, hcfg, target


def _features(model, target, drafter, tokens):
    cfg = model.config
    cache = KVCache.zeros(cfg.num_layers, 9, 16, cfg.num_kv_heads, cfg.head_dim)
    out = forward(target, cfg, jnp.asarray([tokens]), jnp.arange(len(tokens))[None], cache, jnp.arange(1, 9)[None],
                  q_start=jnp.zeros((1,), jnp.int32), kv_len=jnp.array([len(tokens)]),
                  capture_layers=drafter.target_features.layers)
    return out.features


def _drive(drafter, params, feats, tokens, prompt_len, chunks, page_size):
    """Prefill the prompt, observe committed chunks (padded like verify steps); root = tokens[-1]."""
    cfg = drafter.draft_cache_cfg
    maxp = 64 // page_size
    state = drafter.init_state(KVCache.zeros(cfg.num_layers, maxp + 1, page_size, cfg.num_kv_heads, cfg.head_dim), 1)
    table = jnp.arange(1, maxp + 1)[None]
    x = jnp.asarray([tokens])
    state = drafter.prefill(params, state, Committed(x[:, :prompt_len], feats[:, :prompt_len], jnp.array([0]),
                                                     jnp.array([prompt_len])), table)
    a = prompt_len
    for c in chunks:
        tok = jnp.pad(x[:, a:a + c], ((0, 0), (0, 5 - c)))
        f = jnp.pad(feats[:, a:a + c], ((0, 0), (0, 5 - c), (0, 0)))
        state = drafter.observe(params, state, Committed(tok, f, jnp.array([a]), jnp.array([c])), table)
        a += c
    assert a == len(tokens) - 1
    return state, table


@pytest.mark.parametrize("head", ["dflash", "dflash_swa", "dspark"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_block_forward_equals_torch_reference(world, head, page_size):
    alg = "dspark" if head == "dspark" else "dflash"
    n = 6
    drafter, params, hcfg, target = _drafter(world.model, spec_for(alg, world.heads[head], n, sps_table="flat"))
    tokens = np.random.default_rng(0).integers(3, 250, size=14).tolist()
    feats = _features(world.model, target, drafter, tokens)
    state, table = _drive(drafter, params, feats, tokens, 6, [2, 4, 1], page_size)
    r = len(tokens) - 1
    h = drafter.hidden(params, state, jnp.array([tokens[-1]]), jnp.array([r]), table)
    ours = np.asarray(block_logits(params["target"], h))[0]
    ref = torch_block_logits(Path(world.heads[head]), world.hf, tokens, r, drafter.width)
    np.testing.assert_allclose(ours, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())
    # Positive control: context one position off (the bookkeeping bug this guards) drafts other logits.
    state2, _ = _drive(drafter, params, jnp.roll(feats, 1, axis=1), tokens, 6, [2, 4, 1], page_size)
    off = np.asarray(block_logits(params["target"], drafter.hidden(params, state2, jnp.array([tokens[-1]]),
                                                                   jnp.array([r]), table)))[0]
    assert np.abs(off - ref).max() > 1e-2 * np.abs(ref).max()


@pytest.mark.parametrize("alg", ["dflash", "dspark"])
def test_propose_drafts_the_reference_chain(world, alg):
    """The drafted chain is the argmax of the reference logits at the drafting outputs (DSPARK: plus
    the Markov bias of the previously drafted token)."""
    drafter, params, hcfg, target = _drafter(world.model, spec_for(alg, world.heads[alg], 6, sps_table="flat"))
    tokens = np.random.default_rng(3).integers(3, 250, size=12).tolist()
    feats = _features(world.model, target, drafter, tokens)
    state, table = _drive(drafter, params, feats, tokens, 5, [3, 3], 4)
    s = SimpleNamespace(history=jnp.zeros((1, 64), jnp.int32).at[0, :len(tokens)].set(jnp.asarray(tokens)),
                        hist_len=jnp.array([len(tokens)]), page_table=table, done=jnp.array([False]),
                        sampling=greedy_rows(1), prompt_lens=jnp.array([5]), corpus=None)
    prop = drafter.propose(params, state, s)
    ref = torch_block_logits(Path(world.heads[alg]), world.hf, tokens, len(tokens) - 1, drafter.width)
    off = output_offset(hcfg)
    want, prev = [], tokens[-1]
    for d in range(1, 6):
        row = ref[d - off].copy()
        if alg == "dspark":
            row = row + np.asarray(params["own"]["markov_w1"][prev] @ params["own"]["markov_w2"])
        prev = int(np.argmax(row))
        want.append(prev)
    assert prop.tokens[0, 0] == tokens[-1] and prop.tokens[0, 1:].tolist() == want


# ---- 3. greedy speculative == plain greedy ----------------------------------------------------------

REQS = [Request([5, 9, 17, 33, 2, 7, 11, 40][: 2 + 2 * i], SamplingParams(max_tokens=20)) for i in range(4)]


def ecfg(page_size, batch):
    return EngineSection(max_batch_size=batch, max_context=128, length_buckets=(16, 32, 64, 128),
                         batch_buckets=(1, batch), page_size=page_size)


@pytest.fixture(scope="module")
def plain(world):
    return [r.output_ids for r in Engine(world.model.params, world.model.config, ecfg(16, 4), progress=False)
            .generate(REQS)]


def falling_table(path: Path) -> Path:
    """An SPS table whose rate halves per token past the batch: the planner cuts rows short."""
    tokens = list(range(1, 41))
    sps = [100.0 * 0.7 ** max(0, t - 4) for t in tokens]
    path.write_text(json.dumps({"tokens": tokens, "steps_per_s": sps, "device": "test", "date": "",
                                "model": "tiny", "source": "synthetic"}))
    return path


# (DSPARK with a planner that cuts rows: test_ragged_rows_equal_batch_one_and_compile_once.)
@pytest.mark.parametrize("alg, n, page_size, batch", [("dflash", 8, 1, 4), ("dflash", 4, 16, 1),
                                                      ("dspark", 7, 1, 4)])
def test_greedy_equals_plain(world, plain, alg, n, page_size, batch):
    spec = spec_for(alg, world.heads[alg], n, sps_table="flat")
    draft = load_draft(spec, world.model, jnp.float32, progress=False)
    engine = Engine(world.model.params, world.model.config, ecfg(page_size, batch), progress=False, spec=spec,
                    draft=draft)
    out = engine.generate(REQS)
    assert [r.output_ids for r in out] == plain
    for r in out:
        assert sum(r.accept_lengths) == len(r.output_ids) - 1


def test_ragged_rows_equal_batch_one_and_compile_once(world, plain):
    """DSPARK with a falling table: rows verify different lengths in one compiled program; each row's
    output equals its batch-1 run, and a second request compiles nothing."""
    spec = spec_for("dspark", world.heads["dspark"], 7, sps_table=str(falling_table(world.tmp / "f2.json")))
    draft = load_draft(spec, world.model, jnp.float32, progress=False)
    engine = Engine(world.model.params, world.model.config, ecfg(16, 4), progress=False, spec=spec, draft=draft)
    batched = [r.output_ids for r in engine.generate(REQS)]
    singles = [engine.generate([r])[0].output_ids for r in REQS]
    assert batched == singles == plain
    assert compile_events(lambda: engine.generate(REQS)) == []


def test_planner_cuts_rows(world):
    """The falling table makes the drafter pad rows with -1 past their budget (positive control: flat
    keeps every draft)."""
    tokens = np.random.default_rng(5).integers(3, 250, size=12).tolist()
    kept = {}
    for name in ("flat", "falling"):
        table = "flat" if name == "flat" else str(falling_table(world.tmp / "f3.json"))
        drafter, params, _, target = _drafter(world.model, spec_for("dspark", world.heads["dspark"], 7,
                                                                    sps_table=table))
        feats = _features(world.model, target, drafter, tokens)
        state, page_table = _drive(drafter, params, feats, tokens, 5, [3, 3], 4)
        b = 3
        s = SimpleNamespace(history=jnp.zeros((b, 64), jnp.int32).at[:, :len(tokens)].set(jnp.asarray(tokens)),
                            hist_len=jnp.full((b,), len(tokens)), page_table=jnp.repeat(page_table, b, 0),
                            done=jnp.array([False, False, True]), sampling=greedy_rows(b),
                            prompt_lens=jnp.full((b,), 5), corpus=None)
        prop = drafter.propose(params, state, s)
        kept[name] = np.asarray((prop.tokens >= 0).sum(1) - 1)
    assert kept["flat"].tolist()[:2] == [6, 6]
    assert kept["falling"][0] < 6


# ---- 4. bad input ---------------------------------------------------------------------------------


def test_block_longer_than_trained_is_refused(world):
    spec = spec_for("dflash", world.heads["dflash"], 9)
    draft = load_draft(spec, world.model, jnp.float32, progress=False)
    with pytest.raises(ValueError, match=r"num_draft_tokens=9 .* its block of 8 drafts at most 7 tokens"):
        Engine(world.model.params, world.model.config, ecfg(16, 1), progress=False, spec=spec, draft=draft)


def test_bad_block_checkpoints_are_named(world, tmp_path):
    d = write_block_head(tmp_path / "nomask", world.hf, kind="dflash")
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["mask_token_id"] = 10_000
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"mask_token_id 10000 is not a token id in \[0, 256\)"):
        load_draft(spec_for("dflash", d, 4), world.model, jnp.float32, progress=False)
    d = write_block_head(tmp_path / "ids", world.hf, kind="dflash", layer_ids=(0, 5))
    with pytest.raises(ValueError, match=r"dflash_config.target_layer_ids \[0, 5\] .* has \[5\] outside"):
        load_draft(spec_for("dflash", d, 4), world.model, jnp.float32, progress=False)
    from jaxspec.speculative.algorithm import validate_spec_config

    with pytest.raises(ValueError, match=r"spec.sps_table .* read by dspark only; --spec dflash would ignore it"):
        validate_spec_config(SpecSection(algorithm="dflash", draft_model=str(world.heads["dflash"]),
                                         num_draft_tokens=4, sps_table="flat"))
    with pytest.raises(ValueError, match=r"spec.draft_layers .* --spec dflash would ignore it"):
        validate_spec_config(SpecSection(algorithm="dflash", draft_model=str(world.heads["dflash"]),
                                         num_draft_tokens=4, draft_layers=5))
    with pytest.raises(ValueError, match="'dspark' drives dspark heads, but .* holds a dflash head: use --spec dflash"):
        load_draft(spec_for("dspark", world.heads["dflash"], 4), world.model, jnp.float32, progress=False)
    # Positive control: the same head under its own algorithm loads, with the layer-id convention applied.
    _, hcfg = load_draft(spec_for("dflash", world.heads["dflash"], 4), world.model, jnp.float32, progress=False)
    assert hcfg.kind == "dflash" and hcfg.feature_layers == (1, 3) and hcfg.block_size == 8
