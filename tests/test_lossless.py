"""Issue 10's loop defects, one test each (each failed before its fix):

* a verify step that accepts no draft (k = 0) emits exactly plain decoding's token;
* the race noise cannot be 0, so no token outside the support is ever drawn;
* the default verify rule samples sampled requests, and `greedy` refuses them;
* the drafter declares its scratch slots, so a deep tree at the end of the
  context writes inside its own pages and acceptance does not depend on the batch;
* a plugin drafter registered with a factory decodes exactly through the CLI;
* simulate_accept_length is refused outside the benchmarks (engine and server).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import EngineSection, SpecSection
from jaxspec.engine import Engine, Request, RequestError
from jaxspec.sampling_params import SamplingParams
from jaxspec.models.loading import load_model
from jaxspec.speculative import algorithm as A
from jaxspec.speculative.protocol import DrafterBase
from jaxspec.speculative.sampling import make_verify_noise, race_sample, sample_token
from tests.reference import greedy_rows, hf_greedy

ECFG = EngineSection(max_batch_size=8, max_context=128, length_buckets=(16, 32, 64, 128), page_size=4)


@pytest.fixture(scope="module")
def llama(tiny_dirs):
    path, hf = tiny_dirs["llama"]
    return load_model(str(path), progress=False), hf


def sampled_requests(n: int, **kw) -> list[Request]:
    rng = np.random.default_rng(3)
    reqs = []
    for i in range(n):
        prompt = [int(t) for t in rng.integers(3, 250, size=int(rng.integers(3, 9)))]
        reqs.append(Request(prompt, SamplingParams(max_tokens=12, **kw), seed=1000 + i))
    return reqs


# ---- 1. k = 0 equals plain decoding -------------------------------------------------------------


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9, top_k=20)],
                         ids=["T1", "T0.8-topk-topp"])
def test_spec_loop_with_no_drafts_equals_plain_decoding(llama, sampling):
    """The server's adaptive k = 0 is the speculative loop with a real drafter drafting nothing,
    in bounded calls; at T > 0 it must emit plain decoding's tokens (`PlainDrafter`, one call to
    the end) exactly."""
    from jaxspec.engine.runner import ModelRunner, RowInput

    model, _ = llama
    reqs = sampled_requests(8, **sampling)
    plain = [r.output_ids for r in Engine(model.params, model.config, ECFG, progress=False).generate(reqs)]

    runner = ModelRunner(model.params, model.config, ECFG, progress=False, spec=SpecSection(algorithm="ngram"),
                         steps_candidates=(0, 3), steps_per_call=3)
    assert type(runner.drafters[0]).__name__ == "NgramDrafter"
    rows = []
    for i, r in enumerate(reqs):
        runner.allocator.allocate(i, len(r.prompt_ids) + r.params.max_tokens + runner.reserve)
        rows.append(RowInput(list(r.prompt_ids), len(r.prompt_ids),
                             np.asarray(runner.allocator.page_table_row(i, runner.max_pages)), i, r.params, r.seed))
    for row, first in zip(rows, runner.prefill([(row, 0, row.prompt_len) for row in rows])):
        row.tokens.append(first)
    live = list(rows)
    while any(live):
        outs, _ = runner.decode(0, live, 64)
        for i, out in enumerate(outs):
            if out is not None:
                live[i].tokens += out.tokens
                live[i] = None if out.done else live[i]
    got = [row.tokens[row.prompt_len:] for row in rows]
    assert got == plain
    greedy = [r.output_ids for r in Engine(model.params, model.config, ECFG, progress=False).generate(
        [dataclasses.replace(r, params=r.params.replace(temperature=0.0)) for r in reqs])]
    assert got != greedy  # the rows really were sampled


# ---- 2. race noise ------------------------------------------------------------------------------


def test_exp_noise_is_positive_and_finite_for_every_uniform():
    """Every value the noise can take: it maps the 2^23 mantissas of the
    uniform, so checking them all replaces any number of random draws."""
    from jaxspec.speculative import sampling

    e = np.asarray(sampling._exp_from_bits(jnp.arange(1 << 23, dtype=jnp.uint32) << 9))
    assert np.isfinite(e).all() and e.min() > 5e-8 and e.max() < 17.0
    # It is Exp(1): the mean of -log(u) over the uniform grid is 1.
    assert abs(e.mean() - 1.0) < 1e-4


def _hash_chi2_pvalues(bits_fn) -> list[float]:
    """Chi-square p-values of a noise hash's uniforms: one-dimensional (256 bins, 2^18 draws over
    256 keys of consecutive seeds), pairs of neighbouring entries (16 x 16), and the same entry
    under neighbouring keys (16 x 16): the structure a weak hash of (key, index) leaves."""
    from scipy import stats

    from jaxspec.speculative.sampling import race_key

    keys = jax.vmap(race_key)(jnp.arange(256, dtype=jnp.uint32), jnp.full(256, 7))
    u = np.asarray(bits_fn(keys, jnp.broadcast_to(jnp.arange(1024, dtype=jnp.uint32), (256, 1024))))
    u = (u >> 24).astype(np.int64)  # the top 8 bits: 256 bins
    pvals = [stats.chisquare(np.bincount(u.ravel(), minlength=256)).pvalue]
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:])):
        pairs = np.bincount(((a >> 4) * 16 + (b >> 4)).ravel(), minlength=256)
        pvals.append(stats.chisquare(pairs).pvalue)
    return pvals


def test_noise_hash_is_uniform_and_independent():
    from jaxspec.speculative.sampling import noise_bits

    assert min(_hash_chi2_pvalues(noise_bits)) > 1e-4


def test_noise_hash_detector_catches_a_weak_hash():
    """Positive control: one multiply-xorshift round keyed by the first key word alone passes the
    one-dimensional count but leaves neighbouring entries dependent."""
    from jaxspec.speculative import sampling

    def weak(keys, ids):
        k0 = jax.random.key_data(keys)[..., 0:1]
        return (ids ^ k0) * jnp.uint32(0x9E3779B9)

    assert min(_hash_chi2_pvalues(weak)) < 1e-6


def peaked_rows(b: int, vocab: int = 49152, support: int = 10) -> np.ndarray:
    """Logits where `support` tokens hold all but ~1e-15 of the mass."""
    logits = np.full((b, vocab), -45.0, np.float32)
    logits[:, :support] = np.linspace(0.0, -2.0, support, dtype=np.float32)
    return logits


def test_sampling_never_draws_outside_the_support():
    """Real vocabulary size, 10^4 draws through the real noise keying. With the
    old clamped-to-tiny noise ~0.6% of draws (~60 here) were junk tokens."""
    b, calls = 1000, 10
    logits = jnp.asarray(peaked_rows(b))
    ones, zeros = jnp.ones(b, jnp.float32), jnp.zeros(b, jnp.int32)
    drawn = np.concatenate([
        np.asarray(sample_token(logits, ones, zeros, ones, jnp.arange(b) + c * b, jnp.full(b, 5 + c)))
        for c in range(calls)])
    assert (drawn < 10).all(), f"{(drawn >= 10).sum()} tokens outside the support"
    assert len(np.unique(drawn)) == 10  # and the support itself is sampled


def test_support_detector_catches_a_zero_noise_element():
    """Positive control: a single exact-zero noise element clamped to the
    smallest float (the old sampler) makes an outside token win."""
    w = np.zeros((1, 49152), np.float32)
    w[0, :10] = 0.1
    w[0, 20_000] = 1e-30
    e = np.ones((1, 49152), np.float32)
    e[0, 20_000] = np.finfo(np.float32).tiny
    assert int(race_sample(jnp.asarray(w), jnp.asarray(e))[0]) == 20_000
    e[0, 20_000] = 6e-8  # the smallest value exp_noise can take
    assert int(race_sample(jnp.asarray(w), jnp.asarray(e))[0]) < 10


def test_rejection_kernel_equals_reference_on_peaked_rows():
    """Interpret-mode kernel and jnp reference agree on near-one-hot rows, with
    the real noise and the smallest noise value planted on near-zero tokens."""
    from jaxspec.pallas.verify import verify_rejection_pallas
    from jaxspec.speculative.verify import verify_rejection_ref
    from tests.test_verify import retrieve_tables

    b, n, vocab = 32, 4, 512
    rng = np.random.default_rng(0)
    p = np.asarray(jax.nn.softmax(jnp.asarray(peaked_rows(b * n, vocab, support=3))), np.float32).reshape(b, n, vocab)
    parents = np.tile(np.int32([-1, 0, 1, 0]), (b, 1))
    tokens = rng.integers(0, 3, size=(b, n)).astype(np.int32)
    tokens[:, 1] = 0  # the likeliest token: often accepted
    tokens[:, 3] = 400  # a near-zero-probability sibling
    nt, ns = retrieve_tables(parents, tokens)
    u, e = (np.asarray(x) for x in make_verify_noise(jnp.arange(b), jnp.full(b, 9), n, vocab))
    e = e.copy()
    e[:, 300:310] = 6e-8
    got = verify_rejection_pallas(tokens, nt, ns, p, None, u, e, max_depth=2, interpret=True)
    want = verify_rejection_ref(tokens, nt, ns, p, None, u, e, max_depth=2)
    for f in ("accept_index", "num_accepted", "bonus_token"):
        np.testing.assert_array_equal(np.asarray(getattr(got, f)), np.asarray(getattr(want, f)))
    assert (np.asarray(want.bonus_token) < 3).all()
    assert (np.asarray(want.num_accepted) > 0).any()


# ---- 3. verify rules for sampled requests ------------------------------------------------------------


def test_default_verify_samples_sampled_requests(llama):
    model, _ = llama
    assert SpecSection().verify == "auto"
    engine = Engine(model.params, model.config, ECFG, progress=False, spec=SpecSection(algorithm="ngram"))
    reqs = sampled_requests(8, temperature=1.0)
    sampled = [r.output_ids for r in engine.generate(reqs)]
    greedy = [r.output_ids for r in engine.generate([dataclasses.replace(r, params=r.params.replace(temperature=0.0))
                                                     for r in reqs])]
    # Past the first token (sampled by prefill even before the fix), rows leave the greedy path.
    assert sum(s[1:] != g[1:] for s, g in zip(sampled, greedy)) >= 6
    # A mixed batch: greedy rows still decode exactly greedily.
    mixed = [dataclasses.replace(r, params=r.params.replace(temperature=0.0)) if i % 2 else r for i, r in enumerate(reqs)]
    out = [r.output_ids for r in engine.generate(mixed)]
    assert all(out[i] == greedy[i] for i in range(1, 8, 2))
    assert all(out[i] == sampled[i] for i in range(0, 8, 2))  # and sampled rows are batch-invariant


def test_explicit_greedy_verify_refuses_sampled_requests(llama, tiny_dirs, tmp_path, capsys):
    from jaxspec.generate import main

    model, _ = llama
    engine = Engine(model.params, model.config, ECFG, progress=False,
                    spec=SpecSection(algorithm="ngram", verify="greedy"))
    with pytest.raises(RequestError, match=r"spec.verify='greedy' ignores temperature.*temperature=0.8"):
        engine.generate([Request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.8))])
    assert engine.generate([Request([5, 6, 7], SamplingParams(max_tokens=4))])[0].output_ids  # greedy requests run
    path, _ = tiny_dirs["llama"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7]}\n')
    code = main(["--model", str(path), "--prompts", str(prompts), "--spec", "ngram", "--verify", "greedy",
                 "--temperature", "0.8", "--max-new-tokens", "8", "--max-context", "128", "--set", "engine.length_buckets=16,32,64,128",
                 "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and "spec.verify='greedy'" in err[-1]


def test_server_with_greedy_verify_refuses_sampled_requests(chat_model_dir):
    from jaxspec.serve.protocol import APIError, GenParams
    from jaxspec.serve.server import build_server
    from tests.serve_util import serve_config

    server = build_server(serve_config(chat_model_dir, **{"spec.verify": "greedy"}), progress=False)
    try:
        with pytest.raises(APIError, match="spec.verify='greedy' ignores temperature") as e:
            server.submit([5, 6, 7], GenParams(max_tokens=4, temperature=1.0, top_p=1.0, top_k=0, seed=None, n=1, stop=(),
                                                    stream=False, include_usage=False, ignore_eos=False),
                          0, lambda *a: None, "prompt")
        assert e.value.param == "temperature"
    finally:
        server.shutdown()


# ---- 4. the drafter's scratch slots are reserved --------------------------------------------------------


DEEP_TREE = SpecSection(algorithm="standalone", draft_layers=1, topk=4, num_steps=5, num_draft_tokens=8)


def deep_tree_run(model):
    """A row that fills its page budget to the last slot, alone and in a batch.
    The bucket's page table is longer than the budget, so a slot past the
    budget maps to the null page, which every row shares."""
    from jaxspec.speculative.drafters.standalone import truncate_layers

    # The target drafts for itself, so deep tree nodes are accepted and a spoilt one shows.
    draft = truncate_layers(model.params, model.config, model.config.num_layers)
    ecfg = dataclasses.replace(ECFG, max_context=128, length_buckets=(16, 128))
    engine = Engine(model.params, model.config, ecfg, progress=False, spec=DEEP_TREE, draft=draft)
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]
    row = Request(prompt, SamplingParams(max_tokens=62 - len(prompt) - engine.reserve_tokens))
    others = [Request([int(t) for t in np.random.default_rng(i).integers(3, 250, len(prompt))], row.params)
              for i in range(3)]
    alone = engine.generate([row])[0]
    batched = engine.generate(others + [row])[-1]
    return engine, alone, batched


def test_deep_tree_at_the_context_end_is_batch_invariant(llama):
    model, hf = llama
    engine, alone, batched = deep_tree_run(model)
    assert engine.reserve_tokens == (DEEP_TREE.num_steps - 1) * DEEP_TREE.topk  # 16 > num_draft_tokens
    assert alone.output_ids == hf_greedy(hf, alone.prompt_ids, len(alone.output_ids))
    assert batched.output_ids == alone.output_ids
    assert batched.accept_lengths == alone.accept_lengths


# A sampled rank tree that runs more nodes (5 expanded) than (num_steps - 1) * topk = 4.
WIDE_RANK_TREE = SpecSection(algorithm="standalone", draft_layers=1, topk=2, num_steps=3, num_draft_tokens=9,
                             verify="rejection",
                             tree_choices="[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [1, 0, 0]]")


def scratch_writes_past(model, declared: int, spec: SpecSection = DEEP_TREE, sampling=None, hist: int = 10) -> int:
    """Draft K/V slots the tree of `spec` writes past hist_len + `declared`.

    The page table maps the declared budget to real pages and every slot past
    it to distinct trap pages (not the shared null page), so any write past
    the budget is visible and attributable.
    """
    from types import SimpleNamespace

    from jaxspec.speculative.drafters.standalone import DraftState, truncate_layers

    ps = 4
    engine = Engine(model.params, model.config, dataclasses.replace(ECFG, page_size=ps), progress=False,
                    spec=spec, draft=truncate_layers(model.params, model.config, 1))
    budget_pages = -(-(hist + declared) // ps)
    trap0, maxp = 1 + budget_pages, 16
    table = jnp.asarray([list(range(1, 1 + budget_pages)) + list(range(trap0, trap0 + maxp - budget_pages))],
                        jnp.int32)
    c = engine.runner.draft_cache
    layers, _, _, kvh, hd = c.k.shape
    shape = (layers, trap0 + maxp, ps, kvh, hd)
    cache = type(c)(k=jnp.zeros(shape, c.k.dtype), v=jnp.zeros(shape, c.k.dtype))
    history = jnp.zeros((1, 64), jnp.int32).at[0, :hist].set(jnp.arange(5, 5 + hist))
    s = SimpleNamespace(history=history, hist_len=jnp.array([hist]), page_table=table, done=jnp.array([False]),
                        sampling=sampling or greedy_rows(1), prompt_lens=jnp.array([1]))
    out = engine.drafter.propose(engine.runner.draft_params, DraftState(cache=cache, draft_len=jnp.array([hist - 1])), s)
    written = np.abs(np.asarray(out.state.cache.k[:, trap0:])).sum(axis=(0, 3, 4)) > 0  # [trap pages, ps]
    slots = np.nonzero(written.reshape(-1))[0]
    first_trap_slot = budget_pages * ps
    return 0 if slots.size == 0 else int(first_trap_slot + slots.max() + 1 - (hist + declared))


def test_standalone_tree_writes_within_its_declared_scratch(llama):
    from jaxspec.speculative.drafters.standalone import StandaloneDrafter

    model, _ = llama
    drafter = StandaloneDrafter(model.config, DEEP_TREE.num_steps, DEEP_TREE.topk, DEEP_TREE.num_draft_tokens, False)
    assert scratch_writes_past(model, drafter.scratch_tokens) == 0
    # Positive control: the old reserve (num_draft_tokens) is overrun by the deep tree.
    assert scratch_writes_past(model, DEEP_TREE.num_draft_tokens) > 0


def test_standalone_sampled_tree_writes_within_its_declared_scratch(llama):
    """A sampled row drafts the rank tree, whose expanded nodes (5 here) the drafter re-runs past
    hist_len: more than the top-k tree's (num_steps - 1) * topk = 4, which would overrun."""
    from jaxspec.speculative.drafters import build_drafter
    from jaxspec.speculative.loop import SpecPlan

    model, _ = llama
    drafter = build_drafter(SpecPlan.from_config(WIDE_RANK_TREE), WIDE_RANK_TREE, draft_cfg=model.config,
                            target_cfg=model.config)
    assert drafter.sampled_tree and len(drafter.rank_tree.fed()) == 5 and drafter.scratch_tokens == 5
    sampled = dataclasses.replace(greedy_rows(1), temperature=jnp.ones((1,), jnp.float32))
    # hist 12: a budget of hist + 4 ends on a page boundary, so one slot past it is a trap page's.
    assert scratch_writes_past(model, drafter.scratch_tokens, WIDE_RANK_TREE, sampled, hist=12) == 0
    assert scratch_writes_past(model, 4, WIDE_RANK_TREE, sampled, hist=12) > 0  # control: the top-k reserve


# ---- 5. plugins ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RepeatDrafter(DrafterBase):
    """Toy plugin: drafts the root token repeated (a deterministic chain); the
    protocol's defaults (no state, no features) come from DrafterBase."""

    plan: object

    def propose(self, params, state, s):
        from jaxspec.speculative.protocol import Proposal

        root = jnp.take_along_axis(s.history, (s.hist_len - 1)[:, None], axis=1)
        return Proposal(jnp.repeat(root, self.plan.num_draft_tokens, axis=1), None, None, None)


PLUGIN_SRC = """
import dataclasses

import jax.numpy as jnp

from jaxspec.speculative.algorithm import AlgorithmInfo, register
from jaxspec.speculative.protocol import DrafterBase
from jaxspec.speculative.types import Proposal


@dataclasses.dataclass(frozen=True)
class EchoDrafter(DrafterBase):
    plan: object

    def propose(self, params, state, s):
        root = jnp.take_along_axis(s.history, (s.hist_len - 1)[:, None], axis=1)
        return Proposal(jnp.repeat(root, self.plan.num_draft_tokens, axis=1), None, None, None)


register("echo", AlgorithmInfo(drafts_in_steps=False), lambda plan, **_: EchoDrafter(plan))
"""


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """A drafter plugin as a third party ships it: its own module in its own distribution, found
    through the `jaxspec.drafters` entry point; jaxspec is not edited and registers nothing."""
    site = tmp_path / "site"
    (site / "jaxspec_echo-0.1.dist-info").mkdir(parents=True)
    (site / "jaxspec_echo.py").write_text(PLUGIN_SRC)
    (site / "jaxspec_echo-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: jaxspec-echo\n"
                                                                   "Version: 0.1\n")
    (site / "jaxspec_echo-0.1.dist-info" / "entry_points.txt").write_text("[jaxspec.drafters]\necho = jaxspec_echo\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(A, "_plugins_loaded", False)
    yield site
    A.unregister("echo")


def test_plugin_drafter_from_outside_the_package_serves_the_cli_api_and_server(installed_plugin, tiny_dirs,
                                                                               tmp_path):
    """--spec echo in a fresh CLI process, jaxspec.LLM(spec="echo") and the server's scheduler, each
    equal to Hugging Face's greedy tokens, with every draft of the echo chain verified."""
    import os
    import subprocess
    import sys

    import jaxspec
    from jaxspec.serve.server import build_server
    from tests.serve_util import serve_config
    from tests.test_serve_scheduler import run_all

    path, hf = tiny_dirs["llama"]
    prompts_ids = [[5, 5, 5, 5], [9, 17, 33]]
    want = [hf_greedy(hf, p, 16) for p in prompts_ids]
    # 1. The CLI, in its own process: only the entry point can have registered "echo" there.
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts_ids))
    out = tmp_path / "o.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(installed_plugin), os.getcwd()])}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxspec.generate", "--model", str(path), "--prompts", str(prompts), "--output",
         str(out), "--spec", "echo", "--num-draft-tokens", "4", "--adaptive-spec", "off", "--max-new-tokens", "16",
         "--ignore-eos",
         "--max-context", "128", "--set", "engine.length_buckets=16,32,64,128", "--quiet"],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [line["output_ids"] for line in lines] == want
    assert all(sum(line["accept_lengths"]) >= 15 for line in lines)  # the plugin's loop committed them
    # 2. The API in this process (the entry point loads on the first unknown name).
    assert "echo" not in A.valid_names()
    llm = jaxspec.LLM(str(path), spec="echo", num_draft_tokens=4, adaptive="off", max_context=128,
                      length_buckets=(16, 32, 64, 128), progress=False)
    got = llm.generate(prompts_ids, jaxspec.SamplingParams(max_tokens=16, ignore_eos=True))
    assert [g.token_ids for g in got] == want and all(g.accept_lengths for g in got)
    # 3. The server.
    server = build_server(serve_config(path, **{"spec.algorithm": "echo", "spec.num_draft_tokens": 4,
                                                 "serve.adaptive": False}), progress=False)
    assert server.runner.candidates == (3,) and type(server.runner.drafter).__name__ == "EchoDrafter"
    tokens, _ = run_all(server, prompts_ids, 16)
    assert tokens == want


@dataclasses.dataclass(frozen=True)
class UndeclaredQDrafter(RepeatDrafter):
    """Returns a q with its drafts but declares provides_draft_probs False (the default)."""

    def propose(self, params, state, s):
        prop = super().propose(params, state, s)
        q = jax.nn.one_hot(prop.tokens, 256, dtype=jnp.float32)
        return prop._replace(draft_probs=q)


@dataclasses.dataclass(frozen=True)
class MissingQDrafter(RepeatDrafter):
    """Declares provides_draft_probs but returns no q."""

    provides_draft_probs = True


@pytest.mark.parametrize("cls, match", [(UndeclaredQDrafter, "does not declare provides_draft_probs"),
                                        (MissingQDrafter, "declares provides_draft_probs but")])
def test_provides_draft_probs_is_enforced(llama, cls, match):
    model, _ = llama
    name = A.register("contract", A.AlgorithmInfo(drafts_in_steps=False), lambda plan, **_: cls(plan))
    try:
        with pytest.raises(ValueError, match=match):
            engine = Engine(model.params, model.config, ECFG, progress=False,
                            spec=SpecSection(algorithm=name, num_draft_tokens=3))
            engine.generate([Request([5, 6, 7], SamplingParams(max_tokens=4, temperature=1.0), seed=1)])
    finally:
        A.unregister(name)


def test_plugin_without_factory_is_a_clear_error(llama):
    model, _ = llama
    name = A.register("nofactory", A.AlgorithmInfo(drafts_in_steps=False))
    try:
        with pytest.raises(RequestError, match="'nofactory' has no drafter"):
            Engine(model.params, model.config, ECFG, progress=False, spec=SpecSection(algorithm=name))
    finally:
        A.unregister(name)


def test_plugin_factory_returning_a_non_drafter_is_a_clear_error(llama):
    model, _ = llama
    name = A.register("broken", A.AlgorithmInfo(drafts_in_steps=False), lambda **_: object())
    try:
        with pytest.raises(RequestError, match="lacks scratch_tokens, draft_cache_cfg, target_features"):
            Engine(model.params, model.config, ECFG, progress=False, spec=SpecSection(algorithm=name))
    finally:
        A.unregister(name)


# ---- 6. the benchmark-only gate ---------------------------------------------------------------------


def test_simulated_acceptance_needs_the_benchmark_flag(llama):
    model, _ = llama
    spec = SpecSection(algorithm="ngram", simulate_accept_length=2)
    with pytest.raises(A.SpecConfigError, match="benchmark-only"):
        Engine(model.params, model.config, ECFG, progress=False, spec=spec)
    engine = Engine(model.params, model.config, ECFG, progress=False, spec=spec, benchmark=True)
    assert engine.spec_plan.simulate_accept_length == 2


def test_server_refuses_simulated_acceptance_at_start_up(chat_model_dir, capsys):
    from jaxspec.serve.launch import main

    code = main(["--model", str(chat_model_dir), "--simulate-accept-length", "2", "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and "benchmark-only" in err[-1]
