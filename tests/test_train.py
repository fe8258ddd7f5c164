"""Drafter training (jaxspec.train): losses, the loop, resume, export, the CLI.

On a tiny random 4-layer Llama target. The corpus is the target's own greedy continuations of
repetitive prompts (as the real data regenerates responses with the target), with features
captured by `jaxspec.models.llama.forward` exactly as the engine's prefill captures them, so
these tests do not depend on jaxspec.train.data.

1. The EAGLE-3 TTT unroll at step s, index i equals the inference drafter's chain rooted at pair
   i with teacher-forced tokens (pairing, RoPE positions, attention over earlier steps).
2. End to end: a few hundred EAGLE-3 steps -> the loss falls, held-out top-1 rises -> export ->
   the CLI loader -> greedy speculative output through Engine equals plain greedy output, and
   the trained head's τ beats the untrained head's.
3. Resumed training equals uninterrupted training bit for bit.
4. EAGLE-1 and Medusa losses fall; every format round-trips export -> load_draft_head.
5. Config files and --set; the CLI trains, exports and plots.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxspec.cache.paged import KVCache
from jaxspec.config import ConfigValueError, EngineSection
from jaxspec.engine import Engine, Request
from jaxspec.sampling_params import SamplingParams
from jaxspec.models.heads.attn_head import attn_head_step, prepare_head_params, project_features
from jaxspec.models.heads.family import head_config, init_head_params
from jaxspec.models.heads.loading import load_draft_head
from jaxspec.models.heads.medusa import medusa_logits
from jaxspec.models.llama import forward, prepare_params
from jaxspec.models.loading import load_model
from jaxspec.train import losses as L
from jaxspec.train import trainer as tr
from jaxspec.train.export import export_head
from tests.conftest import make_tiny_hf
from tests.xla_env import subprocess_env

LAYERS = (1, 2, 3)  # EAGLE-3 capture ("entering layer k") on the 4-layer target
PROMPT, RESPONSE = 10, 30
T = PROMPT + RESPONSE
NTRAIN = 384


def capture(model, tokens: np.ndarray, lengths: np.ndarray) -> dict:
    """A batch in the data interface: target features of right-padded rows, response loss mask."""
    cfg = model.config
    b, t = tokens.shape
    pages = -(-t // 16)
    target = prepare_params(model.params, cfg, unstack=False)
    cache = KVCache.zeros(cfg.num_layers, 1 + b * pages, 16, cfg.num_kv_heads, cfg.head_dim)
    table = 1 + jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    out = forward(target, cfg, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(t), (b, t)), cache, table,
                  q_start=jnp.zeros((b,), jnp.int32), kv_len=jnp.asarray(lengths, jnp.int32),
                  capture_layers=LAYERS, capture_final=True)
    f = np.asarray(out.features)
    h = cfg.hidden_size
    mask = (np.arange(t)[None] >= PROMPT) & (np.arange(t)[None] < lengths[:, None])
    return {"tokens": tokens.astype(np.int32), "lengths": lengths.astype(np.int32), "loss_mask": mask,
            "aux": f[..., : 3 * h].astype(np.float16), "final": f[..., 3 * h:].astype(np.float16)}


def prompts(seed: int, n: int) -> list[list[int]]:
    """Repetitive prompts: a short random phrase repeated."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        phrase = rng.integers(3, 200, rng.integers(2, 5)).tolist()
        out.append((phrase * PROMPT)[:PROMPT])
    return out


def greedy(model, ps, max_new=RESPONSE, batch=16):
    ecfg = EngineSection(max_batch_size=batch, max_context=64, length_buckets=(64,), batch_buckets=(batch,))
    engine = Engine(model.params, model.config, ecfg, progress=False)
    return [r.output_ids for r in engine.generate([Request(p, SamplingParams(max_tokens=max_new)) for p in ps])]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    d = tmp_path_factory.mktemp("target")
    hf = make_tiny_hf("llama", num_hidden_layers=4)
    with torch.no_grad():  # a confident target (low-entropy next-token distributions), as trained LMs are
        hf.lm_head.weight.mul_(4.0)
    hf.save_pretrained(d)
    model = load_model(str(d), progress=False)
    train_p, held_p = prompts(0, NTRAIN), prompts(1, 16)
    outs = greedy(model, train_p + held_p, batch=32)
    rows = np.array([p + o for p, o in zip(train_p + held_p, outs)], np.int32)
    lengths = np.full(len(rows), T, np.int32)
    lengths[::5] = T - 7  # some padded rows
    batch = capture(model, rows, lengths)
    train = {k: v[:NTRAIN] for k, v in batch.items()}
    held = {k: v[NTRAIN:] for k, v in batch.items()}
    return dict(model=model, dir=d, train=tr.ArraySource(train), held=[held], held_prompts=held_p,
                held_plain=outs[NTRAIN:], tmp=tmp_path_factory)


def small(**kw) -> tr.TrainConfig:
    base = dict(drafter="eagle3", lr=3e-3, warmup_ratio=0.05, total_steps=300, batch_size=16, max_len=T,
                ttt_length=3, draft_vocab_size=200, feature_layers=LAYERS, log_every=50, save_every=1000,
                num_medusa_heads=3)
    return tr.TrainConfig(**{**base, **kw})


# ---- 1. TTT == the inference chain ------------------------------------------------------------------


def test_ttt_steps_equal_the_inference_chain(world):
    model = world["model"]
    b = {k: jnp.asarray(v[:2]) for k, v in world["held"][0].items()}
    hcfg = head_config("eagle3", model.config, draft_vocab_size=model.config.vocab_size, feature_layers=LAYERS)
    params = L.trainable(init_head_params(hcfg, 3))
    shared = tr.shared_target(model, np.arange(model.config.vocab_size))
    steps = 4
    ttt = jax.jit(lambda p, b, n: L.eagle3_ttt(p, hcfg, shared, b, n, lambda s, logits: logits), static_argnums=2)
    got = ttt(params, b, steps)
    own = prepare_head_params(params, hcfg)

    @jax.jit
    def chain_logits(tokens, h):  # the head over one chain of pairs, causal (fixed width: one compile)
        o = attn_head_step(own, hcfg, shared, tokens, h, jnp.arange(T)[None], L.causal_attend)
        return o.logits, o.h

    aux, toks = b["aux"].astype(jnp.float32), np.asarray(b["tokens"][0])
    for i in (0, 5, 17):
        n = i + 1  # pairs 0..i: (h_j, x_{j+1}), then the chain's draft nodes
        chain = np.zeros((1, T), np.int32)
        chain[0, :n] = toks[1:i + 2]
        h = jnp.zeros((1, T, hcfg.hidden_size)).at[:, :n].set(project_features(own, hcfg, aux[:1, :n]))
        for s in range(steps):
            logits, out_h = chain_logits(jnp.asarray(chain), h)
            np.testing.assert_allclose(np.asarray(got[s][0, i]), np.asarray(logits[0, n - 1]), atol=2e-4, rtol=2e-4)
            chain[0, n] = toks[i + 2 + s]  # teacher forcing: the next true token, fed with the head's own h
            h = h.at[:, n].set(out_h[:, n - 1])
            n += 1
    # Positive control: features one position late (the classic pairing bug) give other logits.
    late = dict(b, aux=jnp.roll(b["aux"], 1, axis=1))
    off = ttt(params, late, 1)
    assert not np.allclose(np.asarray(off[0][0, 5]), np.asarray(got[0][0, 5]), atol=1e-3)


# ---- 2. end to end ----------------------------------------------------------------------------------


def test_eagle3_trains_and_speeds_up_the_engine(world):
    model, run = world["model"], world["tmp"].mktemp("e3")
    cfg = small()
    ids = tr.draft_vocab(world["train"].token_counts(model.config.vocab_size), cfg.draft_vocab_size)
    hcfg = tr.make_head_config(cfg, model.config)
    shared = tr.shared_target(model, ids)
    fresh = tr.init_train_params(hcfg, shared, cfg.seed, ids)
    evaluate = tr.heldout_eval(world["held"], hcfg, shared, cfg)
    before = evaluate(fresh)
    res = tr.train(cfg, model, world["train"], run, heldout=world["held"], progress=False)
    log = tr.read_log(run)
    assert log[-1]["loss"] < 0.7 * log[0]["loss"], (log[0]["loss"], log[-1]["loss"])
    after = log[-1]["eval"]
    assert after["heldout_loss"] < 0.7 * before["heldout_loss"]
    assert after["heldout_acc"][0] > before["heldout_acc"][0] + 0.2, (before, after)
    assert log[-1]["tokens_per_s"] > 0 and len(log[-1]["acc"]) == cfg.ttt_length
    # The exported head (run/head) loads through the CLI's loader and keeps greedy output exact.
    head = load_draft_head(run / "head", model.config)
    assert head.config.feature_layers == LAYERS and head.config.draft_vocab_size == len(ids)
    np.testing.assert_array_equal(np.arange(len(ids)) + np.asarray(head.params["d2t"]), ids)
    # Greedy speculative output through the Engine equals plain greedy output, with the trained head
    # and with the untrained one (one engine, the head swapped), and the trained head's τ is higher.
    ps, plain = world["held_prompts"][:8], world["held_plain"][:8]
    he = tr.HeadEngine(res.hcfg, model, ps, draft_ids=ids, max_new_tokens=RESPONSE)
    assert_exact_and_faster(he, res.params, fresh, plain)


def assert_exact_and_faster(he, trained, untrained, plain) -> None:
    """Greedy output of the HeadEngine equals plain greedy with both heads (one engine, the head
    swapped), and the trained head's τ beats the untrained one's by 0.5."""
    taus = {}
    for name, p in (("trained", trained), ("untrained", untrained)):
        out = he.generate(p)
        assert [r.output_ids for r in out] == plain, name
        taus[name] = sum(map(sum, (r.accept_lengths for r in out))) / sum(len(r.accept_lengths) for r in out)
    assert taus["trained"] > taus["untrained"] + 0.5, taus


# ---- 3. resume --------------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["eagle3", "medusa"])
def test_resume_equals_uninterrupted(world, drafter):
    model, n = world["model"], 4
    cfg = small(drafter=drafter, total_steps=2 * n, save_every=n, log_every=2, batch_size=16, ttt_length=2,
                remat=True)  # the rematerialised step (memory-saving path) trains too
    straight = tr.train(cfg, model, world["train"], world["tmp"].mktemp("a"), progress=False, export=False)
    run = world["tmp"].mktemp("b")
    first = tr.train(cfg, model, world["train"], run, stop_at=n + 1, progress=False, export=False)
    assert first.step == n + 1
    # An interrupted run resumes from its last checkpoint (step n + 1, saved at the stop), crossing
    # an epoch boundary (64 rows / 16 = 4 batches an epoch).
    resumed = tr.train(cfg, model, world["train"], run, resume=True, progress=False, export=False)
    assert resumed.step == 2 * n
    flat_a, flat_b = jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)
    assert len(flat_a) == len(flat_b)
    for a, b in zip(flat_a, flat_b):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The log of the resumed run has every line of the straight one (plus the stop step's), equal.
    strip = lambda r: {k: v for k, v in r.items() if k != "tokens_per_s"}  # noqa: E731
    resumed_log = {r["step"]: strip(r) for r in tr.read_log(run)}
    for r in tr.read_log(straight.run_dir):
        assert resumed_log[r["step"]] == strip(r)
    # Positive control: a different seed trains to different weights.
    other = tr.train(dataclasses.replace(cfg, seed=1), model, world["train"], world["tmp"].mktemp("c"),
                     progress=False, export=False)
    assert not all(np.array_equal(a, b) for a, b in zip(flat_a, jax.tree.leaves(other.params)))


def test_length_buckets_train_like_full_padding(world):
    """Padding a batch to a bucket instead of max_len changes no loss term (padding is masked)."""
    model = world["model"]
    cfg = small(total_steps=3, ttt_length=2, log_every=1)
    lengths = world["train"].rows["lengths"]
    assert tr.bucket_len(lengths[:16], T, (16, T - 7)) == T and tr.bucket_len(np.array([T - 7]), T, (16, T - 7)) == T - 7
    full = tr.train(cfg, model, world["train"], world["tmp"].mktemp("full"), progress=False, export=False)
    short = tr.ArraySource({k: v[0::5] for k, v in world["train"].rows.items()})  # the T - 7 rows
    a = tr.train(cfg, model, short, world["tmp"].mktemp("pad"), progress=False, export=False)
    b = tr.train(dataclasses.replace(cfg, length_buckets=(T - 7,)), model, short, world["tmp"].mktemp("bucket"),
                 progress=False, export=False)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-4, atol=2e-6)
    assert a.last["loss"] != full.last["loss"]  # control: other rows, another run


def test_eagle3_head_can_start_as_the_targets(world):
    model = world["model"]
    cfg = small(draft_vocab_size=50)
    hcfg = tr.make_head_config(cfg, model.config)
    ids = np.sort(np.random.default_rng(0).choice(model.config.vocab_size, 50, replace=False))
    shared = tr.shared_target(model, ids)
    p = tr.init_train_params(hcfg, shared, 0, ids, "target")
    # The rows of the target's LM head at the draft ids, and its final norm: the head's logits of
    # the target's own final state are the target's logits at those ids.
    h = jnp.asarray(world["held"][0]["final"][:2, 5].astype(np.float32))
    full = h @ shared["head"]
    np.testing.assert_allclose(np.asarray(h @ p["lm_head"].T), np.asarray(full[:, ids]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(p["norm"]), np.asarray(shared["final_norm"]))
    rand = tr.init_train_params(hcfg, shared, 0, ids)
    assert not np.allclose(np.asarray(rand["lm_head"]), np.asarray(p["lm_head"]))  # control: the default differs
    with pytest.raises(ConfigValueError, match="eagle3_head_init"):
        small(eagle3_head_init="copy").validate()


def test_resume_refuses_a_changed_config(world):
    run = world["tmp"].mktemp("r")
    cfg = small(total_steps=2, ttt_length=1, batch_size=16)
    tr.train(cfg, world["model"], world["train"], run, progress=False, export=False)
    with pytest.raises(ConfigValueError, match="batch_size"):
        tr.train(dataclasses.replace(cfg, batch_size=8), world["model"], world["train"], run, resume=True,
                 progress=False)


def test_resume_of_a_missing_run_is_an_error(world, tmp_path):
    with pytest.raises(FileNotFoundError, match="no training run there"):
        tr.train(small(total_steps=2), world["model"], world["train"], tmp_path / "absent", resume=True,
                 progress=False)


def _largest_file(d):
    return max((f for f in d.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def _flip(d):
    f = _largest_file(d / "state")
    b = bytearray(f.read_bytes())
    for i in range(len(b) // 3, len(b) // 3 + 64):  # 64 bytes mid-file: data, not a header
        b[i] ^= 0x10
    f.write_bytes(bytes(b))


DAMAGE = {
    "bit-flip": _flip,
    "truncated": lambda d: _largest_file(d / "state").write_bytes(_largest_file(d / "state").read_bytes()[:100]),
    "state-removed": lambda d: shutil.rmtree(d / "state"),
    "garbage-meta": lambda d: (d / "meta" / "metadata").write_text("{not json"),
}


@pytest.fixture(scope="module")
def finished_run(world):
    """A run of 4 steps with checkpoints at steps 2 and 4, and its final params."""
    cfg = small(total_steps=4, save_every=2, ttt_length=1, batch_size=16, log_every=2)
    run = world["tmp"].mktemp("ckpt")
    res = tr.train(cfg, world["model"], world["train"], run, progress=False, export=False)
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
    return cfg, run, res.params


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_resume_falls_back_past_a_damaged_checkpoint(world, finished_run, kind, tmp_path, capsys):
    """A damaged newest checkpoint (issue 23: a bit flip resumed silently into NaN; a truncated
    file, a removed item or garbage meta gave tracebacks) is named in one warning, and the run
    resumes from the previous intact one: steps 3-4 again, to the very params of the straight run."""
    cfg, src, straight = finished_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    DAMAGE[kind](run / "checkpoints" / "4")
    res = tr.train(cfg, world["model"], world["train"], run, resume=True, progress=False, export=False)
    err = capsys.readouterr().err
    assert f"checkpoint {run / 'checkpoints' / '4'} is damaged" in err, err
    assert "Traceback" not in err
    assert res.step == 4
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(res.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_every_checkpoint_damaged_is_one_error_naming_each(world, finished_run, tmp_path, capsys):
    from jaxspec.train.__main__ import main as train_main
    from jaxspec.train.checkpoint import CheckpointError

    cfg, src, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    _flip(run / "checkpoints" / "4")
    DAMAGE["garbage-meta"](run / "checkpoints" / "2")
    with pytest.raises(CheckpointError, match="no intact checkpoint.*checkpoints/4.*checkpoints/2"):
        tr.train(cfg, world["model"], world["train"], run, resume=True, progress=False, export=False)
    capsys.readouterr()
    # `train export` says the same in one line, exit 2.
    assert train_main(["export", str(run), "--out", str(tmp_path / "head"), "--target", str(world["dir"])]) == 2
    err = capsys.readouterr().err
    assert err.count("error: no intact checkpoint") == 1 and "Traceback" not in err, err


def test_checkpoint_checksums_catch_a_changed_value_positive_control(finished_run):
    """`damage` on a restored state: intact -> None; one changed value, same shape -> the leaf
    named (finite, so only the checksum can see it); a NaN -> named even without checksums."""
    from jaxspec.train import checkpoint

    cfg, run, _ = finished_run
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    meta = {"step": 1, "epoch": 0, "index": 0, "tokens": 0, "checksums": checkpoint.checksums(params)}
    assert checkpoint.damage(params, meta) is None
    changed = {"w": params["w"].copy()}
    changed["w"][1, 2] += 1e-3
    assert "checksum mismatch in ['w']" in checkpoint.damage(changed, meta)
    nan = {"w": np.full((2, 3), np.nan, np.float32)}
    assert "non-finite" in checkpoint.damage(nan, {k: v for k, v in meta.items() if k != "checksums"})


def test_a_write_killed_midway_leaves_the_previous_checkpoints(world, finished_run, tmp_path):
    """SIGKILL during a save leaves orbax's temporary directory for the step (it renames only a
    complete one): resume ignores it and uses the newest complete step."""
    cfg, src, straight = finished_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    ck = run / "checkpoints"
    shutil.rmtree(ck / "4")
    partial = ck / "4.orbax-checkpoint-tmp-1733100000000000"
    shutil.copytree(ck / "2", partial)
    shutil.rmtree(partial / "meta")
    res = tr.train(cfg, world["model"], world["train"], run, resume=True, progress=False, export=False)
    assert res.step == 4
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(res.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_init_warm_starts_from_an_exported_head(world):
    """--init: a run starts from a published-format head's weights and draft vocabulary (the
    campaign trains each round from the shipped head); another kind is refused."""
    run = world["tmp"].mktemp("base")
    cfg = small(total_steps=2, ttt_length=1, batch_size=16)
    base = tr.train(cfg, world["model"], world["train"], run, progress=False)
    warm = tr.train(dataclasses.replace(cfg, seed=9), world["model"], world["train"], world["tmp"].mktemp("warm"),
                    init=run / "head", stop_at=0, progress=False, export=False)
    np.testing.assert_array_equal(warm.draft_ids, base.draft_ids)
    flat_b, flat_w = jax.tree.leaves(base.params), jax.tree.leaves(warm.params)
    assert len(flat_b) == len(flat_w)
    for a, b in zip(flat_b, flat_w):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0, atol=0)
    fresh = tr.train(dataclasses.replace(cfg, seed=9), world["model"], world["train"], world["tmp"].mktemp("fresh"),
                     stop_at=0, progress=False, export=False)
    assert not np.allclose(np.asarray(jax.tree.leaves(fresh.params)[0]), np.asarray(flat_b[0]))  # control
    with pytest.raises(ConfigValueError, match="--init .*a eagle3 head, but the run trains medusa"):
        tr.train(small(drafter="medusa", total_steps=2, batch_size=16), world["model"], world["train"],
                 world["tmp"].mktemp("bad"), init=run / "head", stop_at=0, progress=False, export=False)


# ---- 4. EAGLE-1, Medusa; export round trips ---------------------------------------------------------


@pytest.mark.parametrize("drafter", ["eagle", "medusa", "medusa_target"])
def test_eagle1_and_medusa_losses_fall(world, drafter):
    # medusa_target: the frozen target LM head under every head (what ships: a few MB, not 4 x V x H)
    head = "target" if drafter == "medusa_target" else "own"
    drafter = drafter.removesuffix("_target")
    model, cfg = world["model"], small(drafter=drafter, total_steps=200, log_every=50, medusa_head=head)
    rows = world["train"].rows
    fixed = [{k: v[i * 64:(i + 1) * 64] for k, v in rows.items()} for i in range(2)]  # the same rows before/after
    hcfg = tr.make_head_config(cfg, model.config)
    shared = tr.shared_target(model)
    evaluate = tr.heldout_eval(fixed, hcfg, shared, cfg)
    before = evaluate(tr.init_train_params(hcfg, shared, cfg.seed))
    run = world["tmp"].mktemp(drafter)
    res = tr.train(cfg, model, world["train"], run, progress=False)
    after = evaluate(res.params)
    # The frozen-LM-head variant trains one ResBlock per head: less capacity, smaller (real) gains.
    fall, rise = (0.8, 0.05) if head == "target" else (0.7, 0.1)
    assert after["heldout_loss"] < fall * before["heldout_loss"], (before, after)
    assert after["heldout_acc"][0] > before["heldout_acc"][0] + rise, (before, after)
    assert len(after["heldout_acc"]) == (3 if drafter == "medusa" else 1)
    loaded = load_draft_head(run / "head", model.config)
    assert loaded.config.kind == drafter and evaluate(L.trainable(loaded.params)) == after
    if head == "target":
        assert "lm_head" not in loaded.params and loaded.config.medusa_version == "2"
        assert json.loads((run / "head" / "config.json").read_text())["version"] == "2"


def _perturbed(params, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: x if x.dtype.kind == "i" else x + 0.3 * rng.standard_normal(x.shape).astype(
        np.float32), params)


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "medusa"])
def test_export_round_trip(world, kind, tmp_path):
    cfg = world["model"].config
    hcfg = head_config(kind, cfg, draft_vocab_size=50, feature_layers=LAYERS, num_heads=3)
    ids = np.sort(np.random.default_rng(0).choice(cfg.vocab_size, 50, replace=False)) if kind == "eagle3" else None
    params = _perturbed(L.trainable(init_head_params(hcfg, 1, token_ids=ids)), 2)
    export_head(params, hcfg, tmp_path / kind, draft_ids=ids)
    loaded = load_draft_head(tmp_path / kind, cfg)
    assert loaded.config == hcfg or kind == "medusa" and loaded.config.num_heads == 3
    shared = tr.shared_target(world["model"])
    b = world["held"][0]
    if kind == "medusa":
        h = jnp.asarray(b["final"][:2, 5].astype(np.float32))
        want = medusa_logits(prepare_head_params(params, hcfg), hcfg, shared, h)
        got = medusa_logits(prepare_head_params(loaded.params, loaded.config), loaded.config, shared, h)
    else:
        feats = b["aux"] if kind == "eagle3" else b["final"]
        toks, pos = jnp.asarray(b["tokens"][:2]), jnp.broadcast_to(jnp.arange(T), (2, T))

        def logits(p, c):
            own = prepare_head_params(p, c)
            h = project_features(own, c, jnp.asarray(feats[:2].astype(np.float32)))
            return attn_head_step(own, c, shared, toks, h, pos, L.causal_attend).logits

        want, got = logits(params, hcfg), logits(L.trainable(loaded.params), loaded.config)
        if kind == "eagle3":
            np.testing.assert_array_equal(np.arange(50) + np.asarray(loaded.params["d2t"]), ids)
            assert np.flatnonzero(np.asarray(loaded.params["t2d"])).tolist() == ids.tolist()
            written = json.loads((tmp_path / kind / "config.json").read_text())
            assert written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # output convention
            assert written["architectures"] == ["LlamaForCausalLMEagle3"]
    np.testing.assert_array_equal(np.asarray(want), np.asarray(got))


def test_data_parallel_equals_one_device(tmp_path):
    """data_parallel = 4 on 4 host devices trains to the single-device weights (a subprocess: the
    host device count is fixed when JAX starts)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = subprocess_env(4)
    out = tmp_path / "dp.json"
    proc = subprocess.run([sys.executable, str(root / "tests" / "train_dp_worker.py"), str(out)], env=env,
                          cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(out.read_text())
    for kind in ("eagle3", "medusa"):
        r = rep[kind]
        assert r["batch_devices"] == 4 and r["param_devices"] == 4, r  # rows really split over "data"
        assert r["max_rel_diff"] < 1e-4, r
        assert r["moved"] > 1e-3, r  # the weights trained: equality is not of two untouched inits
    assert "exceeds the 4 visible devices" in rep["too_many"]
    with pytest.raises(ConfigValueError, match="multiple of data_parallel"):
        small(batch_size=6, data_parallel=4).validate()


# ---- 5. config and CLI ------------------------------------------------------------------------------


def test_train_config_file_and_overrides(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text('drafter = "medusa"\nlr = 2e-4\n[train]\nbatch_size = 3\nfeature_layers = [1, 2, 3]\n')
    cfg = tr.train_config(f, {"train.total_steps": "7", "remat": "false"})
    assert (cfg.drafter, cfg.lr, cfg.batch_size, cfg.total_steps, cfg.remat) == ("medusa", 2e-4, 3, 7, False)
    assert cfg.feature_layers == (1, 2, 3)
    with pytest.raises(ConfigValueError, match="unknown train key 'lrr'"):
        tr.train_config(None, {"lrr": "1"})
    with pytest.raises(ConfigValueError, match="drafter"):
        tr.train_config(None, {"drafter": "nope"})
    for name in ("eagle3_smollm2", "medusa_smollm2"):
        tr.train_config(f"configs/train/{name}.toml")


def test_cli_trains_exports_and_plots(world, tmp_path):
    from jaxspec.train.__main__ import main

    data = tmp_path / "data"
    data.mkdir()
    rows = world["train"].rows
    for i in range(2):
        np.savez(data / f"b{i}.npz", **{k: v[i * 16:(i + 1) * 16] for k, v in rows.items()})
    out = tmp_path / "run"
    argv = ["--drafter", "eagle3", "--target", str(world["dir"]), "--data", str(data), "--out", str(out),
            "--steps", "3", "--set", "batch_size=8", "--set", f"max_len={T}", "--set", "ttt_length=1",
            "--set", "draft_vocab_size=100", "--set", "feature_layers=1,2,3", "--quiet"]
    assert main(argv) == 0
    assert (out / "head" / "config.json").exists() and len(tr.read_log(out)) >= 1
    assert load_draft_head(out / "head", world["model"].config).config.draft_vocab_size == 100
    # A bad key is one line on stderr and exit status 2.
    assert main(argv + ["--set", "nope=1"]) == 2
    # A run stopped early exports its latest checkpoint; bfloat16 halves the file and the loaded
    # head's logits stay within bfloat16 rounding of the float32 export's.
    stopped = tmp_path / "stopped"
    assert main([a if a != str(out) else str(stopped) for a in argv] + ["--stop-after", "2"]) == 0
    assert not (stopped / "head").exists()
    for dt in ("float32", "bfloat16"):
        assert main(["export", str(stopped), "--out", str(tmp_path / dt), "--target", str(world["dir"]),
                     "--dtype", dt]) == 0
    f32, bf16 = (load_draft_head(tmp_path / dt, world["model"].config) for dt in ("float32", "bfloat16"))
    size = lambda d: (tmp_path / d / "model.safetensors").stat().st_size  # noqa: E731
    assert size("bfloat16") < 0.6 * size("float32")
    assert json.loads((tmp_path / "bfloat16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert json.loads((tmp_path / "float32" / "config.json").read_text())["jaxspec_train"]["step"] == 2
    np.testing.assert_array_equal(np.asarray(f32.params["d2t"]), np.asarray(bf16.params["d2t"]))
    w32, w16 = np.asarray(f32.params["fc"]), np.asarray(bf16.params["fc"])
    assert w16.dtype == np.float32 and np.allclose(w32, w16, rtol=1e-2, atol=1e-3) and not np.array_equal(w32, w16)
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2


def _feature_cache(world, d, layers=LAYERS, fingerprint=None):
    """A jaxspec.train.data cache (shards + manifest) of the world's training rows."""
    from jaxspec.train.data import Example, target_fingerprint, write_shard

    rows, model = world["train"].rows, world["model"]
    d.mkdir(parents=True, exist_ok=True)
    shards = []
    for k in range(2):
        idx = range(k * 32, (k + 1) * 32)
        exs = [Example(f"c{i}", rows["tokens"][i, :rows["lengths"][i]], rows["loss_mask"][i, :rows["lengths"][i]])
               for i in idx]
        feats = [{"aux": rows["aux"][i, :rows["lengths"][i]], "final": rows["final"][i, :rows["lengths"][i]]}
                 for i in idx]
        name = f"shard_{k:05d}.npz"
        shards.append({"file": name, "num_examples": 32, "bytes": write_shard(d / name, exs, feats)})
    h = model.config.hidden_size
    manifest = {"format": 1, "target": str(world["dir"]), "feature_layers": list(layers), "hidden_size": h,
                "target_fingerprint": fingerprint or target_fingerprint(model.params, model.config),
                "aux_width": 3 * h, "vocab_size": model.config.vocab_size, "max_len": T, "shards": shards}
    (d / "manifest.json").write_text(json.dumps(manifest))
    return d


def test_cli_reads_a_feature_cache(world, tmp_path, capsys):
    from jaxspec.train.__main__ import main

    argv = ["--target", str(world["dir"]), "--out", str(tmp_path / "run"), "--steps", "3", "--quiet",
            "--set", "batch_size=8", "--set", "ttt_length=1", "--set", "feature_layers=1,2,3",
            "--set", "draft_vocab_size=100", "--set", f"max_len={T}"]
    cache = _feature_cache(world, tmp_path / "cache")
    assert main(argv + ["--data", str(cache), "--drafter", "eagle3"]) == 0
    assert load_draft_head(tmp_path / "run" / "head", world["model"].config).config.kind == "eagle3"
    # The trainer's draft vocabulary is the data module's (same counts, same tie rule).
    from jaxspec.train.data import FeatureCache, draft_vocab

    d2t, _ = draft_vocab(FeatureCache(cache), 100, world["model"].config.vocab_size)
    np.testing.assert_array_equal(np.load(tmp_path / "run" / "draft_vocab.npy"), np.arange(100) + d2t)
    # A cache of other layers, or of another target, is refused in one line.
    capsys.readouterr()
    other = _feature_cache(world, (tmp_path / "c2"), layers=(1, 2, 4))
    assert main(argv + ["--data", str(other), "--out", str(tmp_path / "r2")]) == 2
    assert "captured layers (1, 2, 4)" in capsys.readouterr().err
    stale = _feature_cache(world, (tmp_path / "c3"), fingerprint="0123456789abcdef")
    assert main(argv + ["--data", str(stale), "--out", str(tmp_path / "r3")]) == 2
    assert "other target weights" in capsys.readouterr().err


def test_plot(tmp_path):
    from jaxspec.train.__main__ import main

    lines = [{"step": s, "loss": 10.0 / s, "acc": [0.1 * s, 0.05 * s], "eval": {"tau": 1 + 0.1 * s}} for s in (1, 2, 3)]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "curves.png").stat().st_size > 1000
