"""Draft heads (jaxspec.models.heads) against independent torch references.

Each head is written in its published layout by tests/heads_fixtures.py, loaded by jaxspec's
numpy loader, run in JAX, and compared with a reference assembled from transformers' Llama /
Qwen2 modules (or plain torch.nn) whose weights are read from the SAME safetensors file by
torch. Loader errors are checked with a positive control beside each.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from safetensors.numpy import load_file as np_load
from safetensors.numpy import save_file as np_save
from safetensors.torch import load_file as pt_load
from transformers.models.llama import modeling_llama as ml
from transformers.models.qwen2 import modeling_qwen2 as mq

from jaxspec.models.config import ConfigError, LoadError, ModelConfig
from jaxspec.models.heads.attn_head import attn_head_step, draft_to_target, prepare_head_params, project_features
from jaxspec.models.heads.config import parse_head_config
from jaxspec.models.heads.family import detect_format
from jaxspec.models.heads.loading import _mtp_names, load_draft_head, load_mtp_head
from jaxspec.models.heads.medusa import medusa_logits, medusa_tree_from_choices
from jaxspec.models.heads.mlp_speculator import mlp_speculator_init_state, mlp_speculator_step
from tests.conftest import make_tiny_hf
from tests.heads_fixtures import (add_mtp_layers, write_eagle3_head, write_eagle_head, write_medusa_head,
                                  write_mlp_speculator)

B, T = 2, 5


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 6-layer tiny Llama (so EAGLE-3's default layers [2, 3, 3] exist): (dir, torch model, ModelConfig)."""
    model = make_tiny_hf("llama", num_hidden_layers=6)
    d = tmp_path_factory.mktemp("target6")
    model.save_pretrained(d)
    return d, model, ModelConfig.from_json_file(d / "config.json")


def shared_of(model) -> dict:
    return {"embed": jnp.asarray(model.model.embed_tokens.weight.detach().numpy()),
            "head": jnp.asarray(model.lm_head.weight.detach().numpy().T),
            "final_norm": jnp.asarray(model.model.norm.weight.detach().numpy())}


def causal_attend(q, k, v):  # q [B,T,nh,hd], k/v [B,T,kvh,hd] -> [B,T,nh,hd]
    rep = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    t = q.shape[1]
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def torch_mask(t: int) -> torch.Tensor:  # additive causal mask for eager attention [1, 1, T, T]
    return torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]


def inputs(seed: int, width: int, vocab: int = 256):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (B, T)).astype(np.int32)
    h = rng.standard_normal((B, T, width)).astype(np.float32)
    positions = (np.arange(T)[None] + np.array([[3], [7]])).astype(np.int32)  # non-zero starts
    return tokens, h, positions


def close(got, want, what: str):
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=2e-5 * max(1.0, np.abs(want).max()),
                               err_msg=what)


def sub(sd: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def rotary(cfg, positions):
    rot = (mq.Qwen2RotaryEmbedding if cfg.model_type == "qwen2" else ml.LlamaRotaryEmbedding)(cfg)
    x = torch.zeros(1)
    return rot(x, torch.as_tensor(positions, dtype=torch.long))


def head_torch_config(d) -> tf.LlamaConfig:
    cfg = tf.LlamaConfig.from_pretrained(d)
    cfg._attn_implementation = "eager"
    return cfg


def run_jax(loaded, model, tokens, h, positions, *, native=False):
    p = prepare_head_params(loaded.params, loaded.config, native=native)
    return attn_head_step(p, loaded.config, shared_of(model), jnp.asarray(tokens), jnp.asarray(h),
                          jnp.asarray(positions), causal_attend)


# --------------------------------------------------------------------------- #
# EAGLE-1
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("bias,with_embed", [(True, False), (False, True)])
def test_eagle_matches_torch(tmp_path, target, bias, with_embed):
    tdir, model, tcfg = target
    d = write_eagle_head(tmp_path / "eagle", model, bias=bias, with_embed=with_embed)
    loaded = load_draft_head(d, tcfg)
    c = loaded.config
    assert (c.kind, c.fc_bias, c.own_embed, c.own_head, c.feature_layers) == ("eagle", bias, with_embed, False, ())
    assert c.layer.rope_theta == 5000.0 and c.layer.rope_theta != tcfg.rope_theta
    tokens, h, positions = inputs(0, 64)
    out = run_jax(loaded, model, tokens, h, positions)

    # Reference: cnets1.py -- fc(cat(emb, h)), a Llama layer whose input_layernorm is skipped,
    # then the target's LM head with no norm in between.
    sd = pt_load(str(d / "model.safetensors"))
    cfg = head_torch_config(d)
    layer = ml.LlamaDecoderLayer(cfg, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict(sub(sd, "layers.0."), strict=True)
    fc = torch.nn.Linear(128, 64, bias=bias)
    fc.load_state_dict(sub(sd, "fc."))
    embed = sd["embed_tokens.weight"] if with_embed else model.model.embed_tokens.weight
    with torch.no_grad():
        x = fc(torch.cat([embed[torch.as_tensor(tokens, dtype=torch.long)], torch.as_tensor(h)], -1))
        ref = layer(x, attention_mask=torch_mask(T), position_embeddings=rotary(cfg, positions))
        logits = model.lm_head(ref)
    close(out.h, ref, "eagle fed-back h")
    close(out.logits, logits, "eagle logits")
    assert out.logits.dtype == jnp.float32 and out.logits.shape == (B, T, 256)
    kv = attn_head_step(prepare_head_params(loaded.params, c), c, shared_of(model), tokens, h, positions, None,
                        kv_only=True)
    assert kv.h is None and kv.logits is None
    np.testing.assert_array_equal(np.asarray(kv.k), np.asarray(out.k))
    np.testing.assert_array_equal(np.asarray(kv.v), np.asarray(out.v))


# --------------------------------------------------------------------------- #
# EAGLE-3
# --------------------------------------------------------------------------- #


class Eagle3Ref(torch.nn.Module):
    """SpecForge llama3_eagle.py LlamaDecoderLayer + norm/lm_head, from transformers' modules."""

    def __init__(self, cfg, sd):
        super().__init__()
        h, nh, kvh, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.attn = ml.LlamaAttention(cfg, layer_idx=0)
        # q/k/v read cat(emb, h): 2H wide, as SpecForge builds them.
        self.attn.q_proj = torch.nn.Linear(2 * h, nh * hd, bias=False)
        self.attn.k_proj = torch.nn.Linear(2 * h, kvh * hd, bias=False)
        self.attn.v_proj = torch.nn.Linear(2 * h, kvh * hd, bias=False)
        self.attn.load_state_dict(sub(sd, "midlayer.self_attn."))
        self.mlp = ml.LlamaMLP(cfg)
        self.mlp.load_state_dict(sub(sd, "midlayer.mlp."))
        names = {"input_layernorm": "midlayer.input_layernorm.", "hidden_norm": "midlayer.hidden_norm.",
                 "post": "midlayer.post_attention_layernorm.", "norm": "norm."}
        for attr, prefix in names.items():
            n = ml.LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
            n.load_state_dict(sub(sd, prefix))
            setattr(self, attr, n)
        self.fc = torch.nn.Linear(3 * h, h, bias=False)
        self.fc.load_state_dict(sub(sd, "fc."))
        self.lm_head = torch.nn.Linear(h, sd["lm_head.weight"].shape[0], bias=False)
        self.lm_head.load_state_dict(sub(sd, "lm_head."))
        self.cfg = cfg

    def forward(self, emb, h, positions):
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], -1)
        a, _ = self.attn(x, position_embeddings=rotary(self.cfg, positions), attention_mask=torch_mask(emb.shape[1]))
        out = h + a
        out = out + self.mlp(self.post(out))
        return out, self.lm_head(self.norm(out))


def test_eagle3_matches_torch_two_steps(tmp_path, target):
    tdir, model, tcfg = target
    d = write_eagle3_head(tmp_path / "e3", model, draft_vocab_size=64, layer_ids=[1, 3, 5])
    loaded = load_draft_head(d, tcfg)
    c = loaded.config
    assert (c.kind, c.draft_vocab_size, c.feature_layers, c.feature_width, c.own_head) == ("eagle3", 64, (1, 3, 5),
                                                                                          192, True)
    sd = pt_load(str(d / "model.safetensors"))
    ref = Eagle3Ref(head_torch_config(d), sd)
    p = prepare_head_params(loaded.params, c)
    shared = shared_of(model)
    tokens, feats, positions = inputs(1, 192)
    tokens2, _, _ = inputs(2, 64)
    emb = model.model.embed_tokens.weight
    tt = lambda x: torch.as_tensor(np.asarray(x))  # noqa: E731

    h = project_features(p, c, jnp.asarray(feats))
    out1 = attn_head_step(p, c, shared, tokens, h, positions, causal_attend)
    # The second step feeds the pre-norm output back as h (positions one further on).
    out2 = attn_head_step(p, c, shared, tokens2, out1.h, positions + 1, causal_attend)
    with torch.no_grad():
        h_ref = ref.fc(tt(feats))
        o1, l1 = ref(emb[tt(tokens).long()], h_ref, positions)
        o2, l2 = ref(emb[tt(tokens2).long()], o1, positions + 1)
    close(h, h_ref, "eagle3 fc")
    close(out1.h, o1, "eagle3 step 1 h")
    close(out1.logits, l1, "eagle3 step 1 logits")
    close(out2.h, o2, "eagle3 step 2 h")
    close(out2.logits, l2, "eagle3 step 2 logits")
    assert out1.logits.shape == (B, T, 64)

    # d2t offsets become absolute target ids, and agree with t2d.
    ids = np.asarray(draft_to_target(p, c))
    assert ids.dtype == np.int32 and ids.shape == (64,)
    np.testing.assert_array_equal(ids, np.arange(64) + sd["d2t"].numpy())
    np.testing.assert_array_equal(np.flatnonzero(sd["t2d"].numpy()), ids)
    assert draft_to_target(prepare_head_params(load_draft_head(write_eagle_head(tmp_path / "e1", model), tcfg).params,
                                               c), dataclasses.replace(c, kind="eagle")) is None


def test_eagle3_d2t_out_of_range_is_named(tmp_path, target):
    _, model, tcfg = target
    d = write_eagle3_head(tmp_path / "e3", model, draft_vocab_size=64)
    assert load_draft_head(d, tcfg).config.kind == "eagle3"  # positive control
    t = np_load(str(d / "model.safetensors"))
    t["d2t"] = t["d2t"].copy()
    t["d2t"][5] = 300  # draft id 5 -> 305 > vocab 256
    np_save(t, str(d / "model.safetensors"))
    with pytest.raises(LoadError, match=r"d2t maps draft ids \[5\] to target ids \[305\] outside the target "
                                        r"vocabulary \[0, 256\)"):
        load_draft_head(d, tcfg)


def test_eagle3_d2t_not_injective_is_refused(tmp_path, target):
    """Two draft ids on one target id would drop q mass in `.at[:, d2t].set(q)`: lossy rejection."""
    _, model, tcfg = target
    d = write_eagle3_head(tmp_path / "e3", model, draft_vocab_size=64)
    assert load_draft_head(d, tcfg).config.kind == "eagle3"  # positive control
    t = np_load(str(d / "model.safetensors"))
    ids = np.arange(64) + t["d2t"]
    t["d2t"] = t["d2t"].copy()
    t["d2t"][6] = ids[5] - 6  # draft id 6 -> the target id of draft id 5
    np_save(t, str(d / "model.safetensors"))
    with pytest.raises(LoadError, match=rf"several draft ids to one target id \(target ids \[{ids[5]}\]\)"):
        load_draft_head(d, tcfg)


def test_aux_layer_conventions_and_range(tmp_path, target):
    _, model, tcfg = target
    for conv in ("output", "input"):
        d = write_eagle3_head(tmp_path / conv, model, layer_ids=[1, 3, 6], convention=conv)
        ids = json.loads((d / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        assert ids == ([0, 2, 5] if conv == "output" else [1, 3, 6])
        assert load_draft_head(d, tcfg, aux_layer_convention=conv).config.feature_layers == (1, 3, 6)
    # Default (no ids): the state entering layers [2, L//2, L-3], whatever the convention.
    d = write_eagle3_head(tmp_path / "default", model)
    for conv in ("output", "input"):
        assert load_draft_head(d, tcfg, aux_layer_convention=conv).config.feature_layers == (2, 3, 3)
    base = json.loads((d / "config.json").read_text())
    ok_in = {**base, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 6]}}
    assert parse_head_config(ok_in, tcfg, aux_layer_convention="input").feature_layers == (0, 3, 6)
    bad_out = {**base, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}}
    with pytest.raises(ConfigError, match=r"\[1, 3, 6\] \(output convention\) has \[6\] outside \[0, 5\] for a "
                                          r"target with 6 layers"):
        parse_head_config(bad_out, tcfg, aux_layer_convention="output")
    bad_in = {**base, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 3, 7]}}
    with pytest.raises(ConfigError, match=r"has \[-1, 7\] outside \[0, 6\]"):
        parse_head_config(bad_in, tcfg, aux_layer_convention="input")
    with pytest.raises(ConfigError, match="aux_layer_convention"):
        parse_head_config(base, tcfg, aux_layer_convention="sglang")


# --------------------------------------------------------------------------- #
# MTP (inside a target checkpoint)
# --------------------------------------------------------------------------- #


def mtp_reference(model, sd, prefix, kind, tokens, h, positions):
    cfg = model.config
    cfg._attn_implementation = "eager"
    Layer, Norm = ((mq.Qwen2DecoderLayer, mq.Qwen2RMSNorm) if cfg.model_type == "qwen2"
                   else (ml.LlamaDecoderLayer, ml.LlamaRMSNorm))
    layer = Layer(cfg, layer_idx=0)
    block = {k: v for k, v in sub(sd, prefix).items() if k.split(".")[0] in
             ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")}
    layer.load_state_dict(block, strict=True)

    def norm(name):
        n = Norm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        n.weight.data = sd[prefix + name + ".weight"]
        return n

    with torch.no_grad():
        emb = model.model.embed_tokens.weight[torch.as_tensor(tokens, dtype=torch.long)]
        hh = torch.as_tensor(h)
        if kind == "deepseek":
            x = torch.cat([norm("enorm")(emb), norm("hnorm")(hh)], -1) @ sd[prefix + "eh_proj.weight"].T
        else:  # MiMo: hidden state first
            x = torch.cat([norm("hidden_layernorm")(hh), norm("token_layernorm")(emb)], -1) @ sd[
                prefix + "input_proj.weight"].T
        out = layer(x, attention_mask=torch_mask(T), position_embeddings=rotary(cfg, positions))
        if kind == "deepseek":
            logits = norm("shared_head.norm")(out) @ sd[prefix + "shared_head.head.weight"].T
        else:
            logits = model.lm_head(norm("final_layernorm")(out))
    return out, logits


def is_mtp_target(target_dir) -> bool:
    try:
        return _mtp_names(Path(target_dir))[0] is not None
    except (LoadError, OSError, KeyError, ValueError):
        return False


@pytest.mark.parametrize("kind,arch", [("deepseek", "llama"), ("mimo", "qwen2")])
def test_mtp_matches_torch(tmp_path, kind, arch):
    model = make_tiny_hf(arch)
    d = tmp_path / "t"
    model.save_pretrained(d)
    tcfg = ModelConfig.from_json_file(d / "config.json")
    assert not is_mtp_target(d)
    with pytest.raises(LoadError, match=f"{d} has no MTP layers"):
        load_mtp_head(d, tcfg)
    add_mtp_layers(d, kind=kind)
    assert is_mtp_target(d)
    loaded = load_mtp_head(d, tcfg)
    c = loaded.config
    assert c.kind == f"mtp_{kind}" and c.own_head == (kind == "deepseek") and c.layer.qkv_bias == (arch == "qwen2")
    if kind == "deepseek":  # MiMo's own config says model_type "mimo"; this tiny target says qwen2
        assert detect_format(json.loads((d / "config.json").read_text())) == "mtp_deepseek"
    tokens, h, positions = inputs(3, 64)
    out = run_jax(loaded, model, tokens, h, positions)
    prefix = "model.layers.2." if kind == "deepseek" else "model.mtp_layers.0."
    ref_h, ref_logits = mtp_reference(model, pt_load(str(d / "model.safetensors")), prefix, kind, tokens, h,
                                      positions)
    close(out.h, ref_h, f"{kind} mtp h (pre-norm block output)")
    close(out.logits, ref_logits, f"{kind} mtp logits")
    with pytest.raises(LoadError, match="no .*MTP layer 1"):
        load_mtp_head(d, tcfg, layer=1)


# --------------------------------------------------------------------------- #
# Medusa
# --------------------------------------------------------------------------- #


def medusa_reference(sd, h, num_heads, num_layers, head_of):
    out = []
    with torch.no_grad():
        for i in range(num_heads):
            x = torch.as_tensor(h)
            for j in range(num_layers):
                lin = torch.nn.Linear(64, 64)
                lin.load_state_dict(sub(sd, f"{i}.{j}.linear."))
                x = x + torch.nn.SiLU()(lin(x))
            out.append(head_of(i)(x))
    return torch.stack(out, 1)


def test_medusa_layouts_and_versions_match_torch(tmp_path, target):
    _, model, tcfg = target
    h = np.random.default_rng(4).standard_normal((B, 64)).astype(np.float32)
    shared = shared_of(model)
    got = {}
    for layout in ("medusa", "vllm"):
        d = write_medusa_head(tmp_path / layout, model, num_heads=3, num_layers=2, layout=layout)
        loaded = load_draft_head(d, tcfg)
        c = loaded.config
        assert (c.kind, c.num_heads, c.num_medusa_layers, c.own_head) == ("medusa", 3, 2, True)
        got[layout] = medusa_logits(prepare_head_params(loaded.params, c), c, shared, jnp.asarray(h))
    sd = pt_load(str(tmp_path / "medusa" / "medusa_lm_head.safetensors"))

    def own(i):
        lin = torch.nn.Linear(64, 256, bias=False)
        lin.weight.data = sd[f"{i}.2.weight"]
        return lin

    ref = medusa_reference(sd, h, 3, 2, own)
    assert got["medusa"].shape == (B, 3, 256) and got["medusa"].dtype == jnp.float32
    close(got["medusa"], ref, "medusa v1 logits")
    np.testing.assert_array_equal(np.asarray(got["vllm"]), np.asarray(got["medusa"]))

    d = write_medusa_head(tmp_path / "v2", model, num_heads=2, version="2")
    loaded = load_draft_head(d, tcfg)
    assert loaded.config.medusa_version == "2" and not loaded.config.own_head
    v2 = medusa_logits(prepare_head_params(loaded.params, loaded.config), loaded.config, shared, jnp.asarray(h))
    ref2 = medusa_reference(pt_load(str(d / "medusa_lm_head.safetensors")), h, 2, 1, lambda i: model.lm_head)
    close(v2, ref2, "medusa v2 logits (target head)")


def test_medusa_tree_from_choices():
    choices = [(1,), (0,), (0, 0), (1, 0), (0, 1), (0, 0, 0)]
    parents, ranks, depths = medusa_tree_from_choices(choices)
    # Medusa's order: sorted by (depth, path): root, (0), (1), (0,0), (0,1), (1,0), (0,0,0)
    assert parents == [-1, 0, 0, 1, 1, 2, 3]
    assert ranks == [0, 0, 1, 0, 1, 0, 0]
    assert depths == [0, 1, 1, 2, 2, 2, 3]
    assert all(p < i for i, p in enumerate(parents))
    with pytest.raises(ValueError, match=r"choice \[2, 0\] has no parent \[2\]"):
        medusa_tree_from_choices([(0,), (2, 0)])


# --------------------------------------------------------------------------- #
# MLP speculator
# --------------------------------------------------------------------------- #


def test_mlp_speculator_matches_torch(tmp_path, target):
    _, model, tcfg = target
    d = write_mlp_speculator(tmp_path / "mlp", model, n_predict=3, inner_dim=96)
    loaded = load_draft_head(d, tcfg)
    c = loaded.config
    assert (c.kind, c.num_heads, c.emb_dim, c.inner_dim, c.scale_input) == ("mlp_speculator", 3, 64, 96, True)
    p = prepare_head_params(loaded.params, c)
    rng = np.random.default_rng(5)
    h = rng.standard_normal((B, 64)).astype(np.float32) * 3
    toks = rng.integers(0, 256, (3, B)).astype(np.int32)

    state = mlp_speculator_init_state(p, c, jnp.asarray(h))
    got = []
    for i in range(3):
        state, logits = mlp_speculator_step(p, c, state, jnp.asarray(toks[i]), i)
        got.append((state, logits))

    # Reference: vLLM mlp_speculator.py generate_proposals, written out in torch.
    sd = pt_load(str(d / "model.safetensors"))
    state_w = 0.5 ** (0.5 / 3)
    emb_w = (1 - state_w**2) * (96 / 2)
    emb_w = emb_w**0.5

    def ln(x, i=None):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x if i is None else sd[f"ln.{i}.weight"] * x + sd[f"ln.{i}.bias"]

    with torch.no_grad():
        s = ln(torch.as_tensor(h)) / 2**0.5
        for i in range(3):
            z = torch.nn.functional.embedding(torch.as_tensor(toks[i]).long(), sd[f"emb.{i}.weight"])
            s = s @ sd[f"proj.{i}.weight"].T + (emb_w / state_w) * z
            s = torch.nn.GELU()(ln(s, i))
            close(got[i][0], s, f"mlp stage {i} state")
            close(got[i][1], s @ sd[f"head.{i}.weight"].T, f"mlp stage {i} logits")


# --------------------------------------------------------------------------- #
# Loader errors (each with its positive control)
# --------------------------------------------------------------------------- #


def test_loader_errors_name_both_sides(tmp_path, target):
    _, model, tcfg = target
    d = write_eagle_head(tmp_path / "eagle", model)
    assert load_draft_head(d, tcfg).config.kind == "eagle"  # positive control

    with pytest.raises(ConfigError, match="draft head hidden_size 64 != target hidden_size 32"):
        load_draft_head(d, dataclasses.replace(tcfg, hidden_size=32))
    with pytest.raises(ConfigError, match="draft head vocab_size 256 != target vocab_size 300"):
        load_draft_head(d, dataclasses.replace(tcfg, vocab_size=300))
    m = write_medusa_head(tmp_path / "medusa", model)
    assert load_draft_head(m, tcfg).config.kind == "medusa"
    with pytest.raises(LoadError, match=r"'0.0.linear.weight' .* has shape \[64, 64\], the head expects \[48, 48\]"):
        load_draft_head(m, dataclasses.replace(tcfg, hidden_size=48))
    s = write_mlp_speculator(tmp_path / "mlp", model)
    assert load_draft_head(s, tcfg).config.kind == "mlp_speculator"
    with pytest.raises(ConfigError, match="draft head emb_dim \\(hidden size\\) 64 != target emb_dim \\(hidden "
                                          "size\\) 32"):
        load_draft_head(s, dataclasses.replace(tcfg, hidden_size=32))

    t = np_load(str(d / "model.safetensors"))
    del t["layers.0.mlp.up_proj.weight"]
    np_save(t, str(d / "model.safetensors"))
    with pytest.raises(LoadError, match=f"draft head checkpoint {d} is missing tensor 'layers.0.mlp.up_proj.weight'"):
        load_draft_head(d, tcfg)

    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({"architectures": ["FooModel"], "model_type": "foo"}))
    with pytest.raises(ConfigError, match=r"unknown draft-head format: config.json has \{'architectures': "
                                          r"\['FooModel'\], 'model_type': 'foo'"):
        load_draft_head(d, tcfg)
    assert detect_format(cfg) == "eagle"


# --------------------------------------------------------------------------- #
# Native packed weights
# --------------------------------------------------------------------------- #


def test_native_params_give_the_same_logits(tmp_path, target):
    from jaxspec.native.build import available
    from jaxspec.native.packed_matmul import PackedWeight

    if not available():
        pytest.skip("native XLA:CPU kernels cannot be built here (no C++ compiler)")
    _, model, tcfg = target
    e3 = load_draft_head(write_eagle3_head(tmp_path / "e3", model), tcfg)
    tokens, h, positions = inputs(6, 64)
    plain = run_jax(e3, model, tokens, h, positions)
    nat = run_jax(e3, model, tokens, h, positions, native=True)
    packed = prepare_head_params(e3.params, e3.config, native=True)
    assert all(isinstance(packed[k], PackedWeight) for k in ("fc", "wq", "wo", "w_down", "head"))
    close(nat.logits, plain.logits, "eagle3 native logits")
    close(nat.h, plain.h, "eagle3 native h")
    med = load_draft_head(write_medusa_head(tmp_path / "m", model), tcfg)
    x = jnp.asarray(h[:, 0])
    close(medusa_logits(prepare_head_params(med.params, med.config, native=True), med.config, shared_of(model), x),
          medusa_logits(prepare_head_params(med.params, med.config), med.config, shared_of(model), x), "medusa native")


@pytest.mark.parametrize("damage", ["truncate", "header", "nan", "inf"])
def test_damaged_head_files_are_one_clear_error(tmp_path, target, damage):
    """Issue 23: a truncated or header-corrupted safetensors gave a SafetensorError traceback, and
    NaN / Inf weights loaded silently. Each is a LoadError naming the file."""
    _, model, tcfg = target
    d = write_eagle3_head(tmp_path / "e3", model, draft_vocab_size=64)
    assert load_draft_head(d, tcfg).config.kind == "eagle3"  # positive control
    f = d / "model.safetensors"
    if damage in ("nan", "inf"):
        t = np_load(str(f))
        t["fc.weight"] = t["fc.weight"].copy()
        t["fc.weight"][0, 3] = np.nan if damage == "nan" else np.inf
        np_save(t, str(f))
        match = r"tensor 'fc.weight' holds NaN or Inf"
    else:
        raw = f.read_bytes()
        f.write_bytes(raw[: len(raw) // 2] if damage == "truncate" else b"\xff" * 16 + raw[16:])
        match = "truncated or corrupted|not a readable safetensors file"
    with pytest.raises(LoadError, match=match) as e:
        load_draft_head(d, tcfg)
    assert str(f) in str(e.value)


def test_missing_head_directory_says_it_does_not_exist(tmp_path, target):
    _, _, tcfg = target
    with pytest.raises(ConfigError, match="does not exist"):
        load_draft_head(tmp_path / "nonexistent", tcfg)


# ---- head families ---------------------------------------------------------------------------------


def test_every_kind_has_one_family_and_detection_follows_the_family_order():
    from jaxspec.models.heads import family as F

    assert [f.name for f in F.families()] == ["mlp_speculator", "medusa", "block", "frozen_kv", "eagle3", "eagle"]
    assert sorted(F.kinds()) == sorted(["mlp_speculator", "medusa", "dflash", "dspark", "frozen_kv", "eagle3",
                                        "eagle", "mtp_deepseek", "mtp_mimo"])
    assert F.trainable_kinds() == ("medusa", "dflash", "dspark", "frozen_kv", "eagle3", "eagle")
    # An EAGLE-3 config is also a one-layer Llama config: the EAGLE-3 family is asked first; a
    # FROZEN_KV_MTP config may carry draft_vocab_size too, so its family is asked before EAGLE-3's.
    assert detect_format({"num_hidden_layers": 1, "hidden_size": 8, "draft_vocab_size": 4}) == "eagle3"
    assert detect_format({"architectures": ["Gemma4AssistantForCausalLM"], "draft_vocab_size": 4}) == "frozen_kv"
    assert detect_format({"num_hidden_layers": 1, "hidden_size": 8}) == "eagle"
    with pytest.raises(ValueError, match="unknown head kind 'nope'; kinds: mlp_speculator, medusa"):
        F.family_of("nope")
    with pytest.raises(ValueError, match="no training loss for mlp_speculator heads"):
        F.family_of("mlp_speculator").loss_fn()


def test_a_family_registered_from_outside_loads_and_exports_with_no_other_edit(target, tmp_path):
    """Adding a head format is one module and one register_family call: the loader, the fresh-head
    builders and the exporter find it through its kind."""
    from jaxspec.models.heads import family as F
    from jaxspec.models.heads.config import HeadConfig
    from jaxspec.models.heads.family import head_config, init_head_params
    from jaxspec.train.export import export_head

    tcfg = target[2]
    h = tcfg.hidden_size

    def parse(kind, cfg, t, convention):
        return HeadConfig(kind=kind, layer=dataclasses.replace(t, num_layers=1), target_hidden_size=t.hidden_size,
                          draft_vocab_size=t.vocab_size, num_heads=int(cfg["toy_heads"]))

    F.register_family(F.HeadFamily(
        "toy", ("toy",), lambda cfg: "toy" if cfg.get("model_type") == "toyhead" else None, parse,
        read=lambda t, cfg, hcfg, target: (hcfg, {"w": t.get("w.weight", (hcfg.num_heads, h))}),
        fresh=lambda kind, target, num_heads=2, **_: parse(kind, {"toy_heads": num_heads}, target, "output"),
        init=lambda hcfg, seed, token_ids: {"w": np.random.default_rng(seed).standard_normal((hcfg.num_heads, h))},
        write=lambda params, hcfg, **_: ({"model_type": "toyhead", "toy_heads": hcfg.num_heads},
                                         {"w.weight": np.asarray(params["w"], np.float32)}, "model.safetensors")))
    try:
        hcfg = head_config("toy", tcfg, num_heads=3)
        params = init_head_params(hcfg, seed=4)
        export_head(params, hcfg, tmp_path / "toy", extra={"note": "x"})
        loaded = load_draft_head(tmp_path / "toy", tcfg)
        assert loaded.config == hcfg and json.loads((tmp_path / "toy" / "config.json").read_text())["note"] == "x"
        np.testing.assert_array_equal(np.asarray(loaded.params["w"]), np.asarray(params["w"]))
        with pytest.raises(ValueError, match="already"):
            F.register_family(F.HeadFamily("toy2", ("toy",), lambda cfg: None, parse))
    finally:
        F._FAMILIES[:] = [f for f in F._FAMILIES if f.name != "toy" or f.name in F.MODULES]
    with pytest.raises(ConfigError, match="unknown draft-head format"):
        load_draft_head(tmp_path / "toy", tcfg)
