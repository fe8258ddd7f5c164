"""Prefix caching (jaxspec/cache/prefix.py), issue 28.

1. The allocator: the hash chain and its lookahead token, reference counts, LRU
   eviction (tail pages first, never a held page), invalidation; a property test
   over random workloads against the invariants.
2. Drafter state: a prefill resuming after a cached prefix leaves the shared pages
   untouched and writes the same target and drafter K/V as a prefill from scratch
   (positive control: without the resume flag a feature drafter rewrites the
   shared page).
3. Exactness end to end (offline engine): multi-turn prompts sharing prefixes that
   end mid-page and on a page boundary give the same tokens and the same accept
   lengths with the cache on and off, plain and for every drafter family; sampled
   rows give the same tokens for the same seeds.
(The server's cached_tokens, metrics, eviction before preemption and the load
test with disconnects: tests/test_serve_prefix.py.)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxspec.cache.paged import OutOfPagesError
from jaxspec.cache.prefix import PrefixCachingAllocator, page_keys, root_key, shared_in_batch
from jaxspec.config import EngineSection, SpecSection
from jaxspec.engine import Engine, Request, offline
from jaxspec.engine.runner import ModelRunner, RowInput
from jaxspec.models.loading import load_model
from jaxspec.sampling_params import SamplingParams
from jaxspec.speculative.drafters.load import load_draft
from tests.heads_fixtures import write_block_head, write_eagle3_head, write_medusa_head

PAGE = 4

# ---- 1. the allocator ------------------------------------------------------------------------------


def test_keys_chain_and_need_the_lookahead_token():
    root = root_key("m")
    toks = list(range(10, 23))  # 13 tokens: pages [0..3], [4..7], [8..11] and 12 is page 2's lookahead
    keys = page_keys(toks, PAGE, root)
    assert len(keys) == 3
    assert len(page_keys(toks[:12], PAGE, root)) == 2  # page 2's lookahead unknown
    # A key names the page, everything before it and the token after it.
    assert page_keys(toks[:9], PAGE, root) == keys[:2]
    other = toks[:8] + [99] + toks[9:]
    assert page_keys(other, PAGE, root)[:2] == [keys[0], page_keys(other, PAGE, root)[1]]
    assert page_keys(other, PAGE, root)[1] != keys[1]  # the lookahead token changed
    assert page_keys(toks, PAGE, root_key("other model")) != keys  # namespaces never mix
    assert page_keys(toks, PAGE, root, limit=8) == keys[:2]


def test_share_release_evict_in_lru_order_tail_first():
    a = PrefixCachingAllocator(8, PAGE)  # 7 usable pages
    prompt = list(range(1, 14))  # 13 tokens: 3 cacheable pages
    assert a.adopt("x", prompt, len(prompt) - 1) == 0
    px = a.allocate("x", 16)
    assert a.cache_pages("x", prompt, len(prompt)) == 3
    # A second sequence with the same prompt shares all three, and owns a fresh fourth page.
    assert a.adopt("y", prompt, len(prompt) - 1) == 12
    py = a.allocate("y", 16)
    assert py[:3] == px[:3] and py[3] != px[3]
    a.check()
    a.free("x")
    a.free("y")
    a.check()
    assert a.num_free == 7 and a.num_cached == 3 and len(a._lru) == 3
    # Eviction takes free pages first, then cached ones, the chain's tail first.
    a.allocate("z", 4 * PAGE)  # 4 pages: the free list holds exactly 4
    assert a.num_cached == 3 and a.evicted_pages == 0
    a.allocate("z", 5 * PAGE)
    assert a.evicted_pages == 1 and a.match(prompt, 12) == 8  # page 2 went, pages 0-1 still hit
    a.check()


def test_held_pages_are_never_evicted_and_exhaustion_names_the_cache():
    a = PrefixCachingAllocator(5, PAGE)  # 4 usable pages
    prompt = list(range(1, 10))  # 2 cacheable pages
    a.adopt("x", prompt, 8)
    a.allocate("x", 9)
    a.cache_pages("x", prompt, 9)
    a.free("x")
    a.adopt("y", prompt, 8)  # holds both cached pages
    a.allocate("y", 9)
    with pytest.raises(OutOfPagesError, match="needs 2 more page"):
        a.allocate("z", 8)  # one free page; the cached two are held by y
    a.check()
    assert a.match(prompt, 8) == 8


def test_drop_cached_forgets_every_page_and_frees_a_shared_one_once():
    a = PrefixCachingAllocator(8, PAGE)
    prompt = list(range(1, 10))
    a.adopt("x", prompt, 8)
    a.allocate("x", 9)
    a.cache_pages("x", prompt, 9)
    assert a.adopt("y", prompt, 8) == 8  # x and y hold both cached pages
    a.allocate("y", 9)
    a.drop_cached()  # a failed call: the cache goes while x and y still hold its pages
    a.check()
    assert a.match(prompt, 8) == 0
    a.free("x")
    a.free("y")
    a.check()  # each shared page back on the free list once (twice would hand it to two sequences)
    assert a.num_free == 7 and a.num_cached == 0 and len(set(a._free)) == len(a._free)


def test_rows_of_a_batch_follow_the_row_whose_prefill_publishes_their_prefix():
    """shared_in_batch: a row sharing full pages (and their lookahead token) with an earlier row of
    its pool follows it; a row sharing only part of a page, a row on another pool, a prefix the cache
    already holds and a disabled cache give no follower."""
    a = [5, 9, 17, 33, 2, 7, 11, 13, 21, 3, 8]
    b = a[:9] + [40, 41, 42]  # pages 0-1 and page 1's lookahead token (21): 2 pages
    c = a[:4] + [50, 51, 52]  # page 0 but not its lookahead token (2): nothing
    pool = PrefixCachingAllocator(32, PAGE, namespace="m")
    assert shared_in_batch([a, b, c], [pool] * 3) == ([1], 8)
    assert shared_in_batch([a, c], [pool] * 2) == ([], 0)
    assert shared_in_batch([b, a], [pool] * 2) == ([1], 8)  # order decides who leads
    other = PrefixCachingAllocator(32, PAGE, namespace="m")
    assert shared_in_batch([a, b], [pool, other]) == ([], 0)  # pools (data shards) share nothing
    pool.adopt("x", a, len(a) - 1)
    pool.allocate("x", len(a))
    pool.cache_pages("x", a, len(a))
    assert shared_in_batch([a, b], [pool] * 2) == ([], 0)  # the cache already serves b's pages
    off = PrefixCachingAllocator(32, PAGE, namespace="m", enabled=False)
    assert shared_in_batch([a, b], [off] * 2) == ([], 0)


def test_disabled_cache_is_a_plain_allocator():
    a = PrefixCachingAllocator(6, PAGE, enabled=False)
    prompt = list(range(1, 10))
    a.adopt("x", prompt, 8)
    a.allocate("x", 9)
    assert a.cache_pages("x", prompt, 9) == 0
    a.free("x")
    assert a.adopt("y", prompt, 8) == 0 and a.num_cached == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "grow", "publish", "free"]), st.integers(0, 5),
                          st.integers(0, 3), st.integers(1, 24)), max_size=60))
def test_invariants_under_random_workloads(ops):
    """free + evictable + held == total, counts never negative, a held page never handed out twice,
    whatever the order of starts, growth, publishing and frees."""
    a = PrefixCachingAllocator(12, PAGE)
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9, 9], [7] * 12, [1, 2, 3, 4, 5, 6, 7, 8, 1]]
    live: dict[int, list[int]] = {}
    for op, sid, which, n in ops:
        if op == "start" and sid not in live:
            toks = prefixes[which] + [sid] * n
            a.adopt(sid, toks, len(toks) - 1)
            try:
                a.allocate(sid, len(toks))
                live[sid] = toks
            except OutOfPagesError:
                a.free(sid)
        elif op == "grow" and sid in live:
            try:
                a.allocate(sid, len(live[sid]) + n)
            except OutOfPagesError:
                pass
        elif op == "publish" and sid in live:
            a.cache_pages(sid, live[sid], len(live[sid]))
        elif op == "free" and sid in live:
            a.free(sid)
            del live[sid]
        a.check()
        held = [p for s in live for p in a.owned(s)]
        assert not set(held) & set(a._lru) and not set(held) & set(a._free)
    for sid in list(live):
        a.free(sid)
    a.check()
    assert a.num_free == a.total


# ---- 2. the drafter state after a cached prefix ------------------------------------------------------


@pytest.fixture(scope="module")
def world(tiny_dirs, tmp_path_factory):
    path, hf = tiny_dirs["llama"]
    tmp = tmp_path_factory.mktemp("prefix_heads")
    model = load_model(str(path), progress=False)
    heads = {
        "eagle3": write_eagle3_head(tmp / "eagle3", hf, layer_ids=[0, 1, 2], convention="input"),
        "medusa": write_medusa_head(tmp / "medusa", hf, num_heads=3),
        "dflash": write_block_head(tmp / "dflash", hf, kind="dflash", block_size=4, layer_ids=(0,),
                                   mask_token_id=7),
    }
    return model, str(path), heads


ECFG = EngineSection(max_batch_size=2, max_context=128, length_buckets=(16, 32, 64, 128), batch_buckets=(1, 2),
                     page_size=PAGE)


def _runner(model, spec, draft):
    return ModelRunner(model.params, model.config, ECFG, spec=spec, draft=draft, progress=False)


def _slots(cache, row, n):  # [layers, n, kvh, hd]: the K of a sequence's first n slots
    pages = np.asarray(row)[np.arange(n) // PAGE]
    return np.asarray(cache.k)[:, pages, np.arange(n) % PAGE]


def _start(r, sid, tokens, cached_flag=True):
    hit = r.allocator.adopt(sid, tokens, len(tokens) - 1)
    r.allocator.allocate(sid, len(tokens) + 8)
    row = RowInput(list(tokens), len(tokens), np.asarray(r.allocator.page_table_row(sid, r.max_pages)), slot=sid,
                   cached=hit if cached_flag else 0)
    r.prefill([(row, hit, len(tokens) - hit)])
    return hit, row.page_row


@pytest.mark.parametrize("flag", [True, False], ids=["resume", "control-no-flag"])
def test_resumed_prefill_keeps_shared_pages_and_matches_scratch(world, flag):
    """EAGLE-3 (a drafter whose cache pairs each feature with the next token): B resumes after A's
    two cached pages. With the flag, A's pages are untouched and B's target and draft K/V equal
    a prefill of B from scratch; without it (the control) B rewrites the pair at slot 7 of a
    page A still holds."""
    model, _, heads = world
    spec = SpecSection(algorithm="eagle3", draft_model=heads["eagle3"], num_draft_tokens=4,
                       eagle3_layer_ids="input")
    draft = load_draft(spec, model, jnp.float32, progress=False)
    r = _runner(model, spec, draft)
    a_toks = [5, 9, 17, 33, 2, 7, 11, 13, 21, 3, 8, 30, 6]  # 13 tokens: 3 cacheable pages
    b_toks = a_toks[:9] + [40, 41, 42, 43]  # shares pages 0-1 and page 1's lookahead token (21)
    assert _start(r, 0, a_toks)[0] == 0
    r.allocator.cache_pages(0, a_toks, len(a_toks))
    a_row = r.allocator.page_table_row(0, r.max_pages)
    a_draft = _slots(r.draft_cache, a_row, 12)
    hit, b_row = _start(r, 1, b_toks, cached_flag=flag)
    assert hit == 8 and list(b_row[:2]) == list(a_row[:2])
    after = _slots(r.draft_cache, a_row, 12)
    ref = _runner(model, spec, draft)
    ref.allocator.enabled = False
    _, c_row = _start(ref, 0, b_toks)
    b_target, c_target = _slots(r.cache, b_row, 13), _slots(ref.cache, c_row, 13)
    np.testing.assert_allclose(b_target, c_target, atol=1e-5)
    b_draft, c_draft = _slots(r.draft_cache, b_row, 11), _slots(ref.draft_cache, c_row, 11)
    if flag:
        np.testing.assert_array_equal(after, a_draft)
        np.testing.assert_allclose(b_draft, c_draft, atol=1e-5)
    else:
        assert not np.allclose(after[:, 7], a_draft[:, 7], atol=1e-5)  # the shared pair was overwritten


# ---- 3. exactness through the offline engine ------------------------------------------------------------

SPECS = {
    "plain": lambda heads: None,
    "ngram": lambda heads: SpecSection(algorithm="ngram", num_draft_tokens=4),
    "standalone": lambda heads: "standalone",
    "eagle3": lambda heads: SpecSection(algorithm="eagle3", draft_model=heads["eagle3"], topk=2, num_steps=3,
                                        num_draft_tokens=6, eagle3_layer_ids="input"),
    "medusa": lambda heads: SpecSection(algorithm="medusa", draft_model=heads["medusa"], num_draft_tokens=4),
    "dflash": lambda heads: SpecSection(algorithm="dflash", draft_model=heads["dflash"], num_draft_tokens=4),
}


def _turns(engine, system, messages, params_of):
    """Replay a conversation: each turn's prompt is the last prompt + its output + a new message."""
    prompt, outs = list(system), []
    for i, msg in enumerate(messages):
        prompt = prompt + msg
        res = engine.generate([Request(list(prompt), params_of(i), seed=77 + i)])[0]
        outs.append(res)
        prompt = prompt + res.output_ids
    return outs


@pytest.mark.parametrize("alg", list(SPECS))
def test_multi_turn_equals_cache_off(world, alg, monkeypatch):
    model, path, heads = world
    spec = SPECS[alg](heads)
    if spec == "standalone":
        spec = SpecSection(algorithm="standalone", draft_model=path, num_draft_tokens=4)
    draft = load_draft(spec, model, jnp.float32, progress=False) if spec is not None and spec.draft_model else None
    engine = Engine(model.params, model.config, ECFG, progress=False, spec=spec, draft=draft)
    system = [5, 9, 17, 33, 2, 7, 11, 13]  # exactly two pages
    # turn 1 ends mid-page; later turns extend the previous prompt and answer.
    messages = [[21, 3, 8], [30, 6, 19, 44, 45], [50, 51, 52, 53]]
    greedy = lambda i: SamplingParams(max_tokens=9)  # noqa: E731
    # Sampled rows (plain and a sampled verify): the same seeds give the same tokens.
    sampled = lambda i: SamplingParams(max_tokens=9, temperature=0.9, top_p=0.95)  # noqa: E731
    sampling = alg in ("plain", "eagle3")
    monkeypatch.setattr(offline, "SHARE_MIN_TOKENS", PAGE)  # the tiny prompts save 12 tokens, not 64
    shared = [88, 87, 86, 85, 84, 83, 82, 81, 80, 79, 78, 77, 76]
    batch = [Request(shared + tail, SamplingParams(max_tokens=9)) for tail in ([60, 61], [70, 71, 72])]
    on = _turns(engine, system, messages, greedy)
    on_sampled = _turns(engine, system + [99], messages[:2], sampled) if sampling else []
    # The batch's second call resumes after a hit like a later call's; these three cover no drafter
    # state, paired (feature, token) K/V and a per-slot pending feature.
    in_batch = alg in ("plain", "eagle3", "medusa")
    batch_on = engine.generate(batch) if in_batch else []
    engine.runner.allocator.check()
    engine.runner.allocator.enabled = False
    off = _turns(engine, system, messages, greedy)
    off_sampled = _turns(engine, system + [99], messages[:2], sampled) if sampling else []
    batch_off = engine.generate(batch) if in_batch else []
    assert [r.output_ids for r in on_sampled] == [r.output_ids for r in off_sampled]
    # Two prompts of one batch sharing 3 pages the cache lacks: the second follows the first's
    # prefill and reuses its pages (12 tokens), with the same tokens and drafts as the cache off.
    if in_batch:
        assert [r.num_cached_tokens for r in batch_on] == [0, 12]
        assert [r.num_cached_tokens for r in batch_off] == [0, 0]
    assert [r.output_ids for r in batch_on] == [r.output_ids for r in batch_off]
    assert [r.accept_lengths for r in batch_on] == [r.accept_lengths for r in batch_off]
    assert all(r.num_cached_tokens > 0 for r in on_sampled[1:])
    assert [r.output_ids for r in on] == [r.output_ids for r in off]
    assert [r.accept_lengths for r in on] == [r.accept_lengths for r in off]  # same drafts: same drafter state
    assert [r.num_cached_tokens for r in off] == [0, 0, 0]
    assert on[0].num_cached_tokens == 0 and all(r.num_cached_tokens >= 8 for r in on[1:])
    # Turn 3 reuses turn 2's prompt and most of its answer (less the drafter's lag).
    assert on[2].num_cached_tokens >= len(system) + 3 + 9 + 5 - 1 - 1 - engine.runner.prefix_lag - PAGE
    # Without drafter state (plain, n-gram) no lag: every full page of turn 2's prompt and answer but
    # its newest token (which has no K/V yet).
    assert (engine.runner.prefix_lag == 0) == (alg in ("plain", "ngram"))
    if alg in ("plain", "ngram"):
        history = len(system) + len(messages[0]) + len(messages[1]) + len(on[0].output_ids) + len(on[1].output_ids)
        assert on[2].num_cached_tokens == (history - 1) // PAGE * PAGE
    engine.runner.allocator.check()


def test_cache_never_crosses_weights(world):
    """Swapped draft weights (a training run's evaluation) drop the cached prefixes with them."""
    model, _, heads = world
    spec = SPECS["eagle3"](heads)
    draft = load_draft(spec, model, jnp.float32, progress=False)
    engine = Engine(model.params, model.config, ECFG, progress=False, spec=spec, draft=draft)
    prompt = [5, 9, 17, 33, 2, 7, 11, 13, 40, 41]
    engine.generate([Request(prompt, SamplingParams(max_tokens=4))])
    assert engine.runner.allocator.match(prompt, len(prompt) - 1) == 8
    engine.runner.set_draft_params(draft[0])
    assert engine.runner.allocator.match(prompt, len(prompt) - 1) == 0


def test_plain_calls_of_the_adaptive_engine_publish_only_the_prompt(world):
    """The offline adaptive engine's k = 0 runs plain decoding without the drafter, so the drafter
    state of the generated tokens is never written: those pages must not enter the cache."""
    model, _, heads = world
    spec = SPECS["eagle3"](heads)
    draft = load_draft(spec, model, jnp.float32, progress=False)
    engine = Engine(model.params, model.config, ECFG, progress=False, spec=spec, draft=draft, adaptive=True)
    prompt = [5, 9, 17, 33, 2, 7, 11, 13, 21, 3, 8, 30, 6]  # 3 publishable pages
    for k in (0, engine.depth):
        engine.runner.allocator.drop_cached()
        engine.adaptive.choose = lambda key, k=k: k
        res = engine.generate([Request(prompt, SamplingParams(max_tokens=40))])[0]
        history = prompt + res.output_ids
        cached = engine.runner.allocator.match(history, len(history) - 1)
        if k == 0:
            assert cached == 12  # the prompt's pages only
        else:  # speculation kept the drafter's state: the answer's pages too, less the lag
            assert cached == (len(history) - 2 - engine.runner.prefix_lag) // PAGE * PAGE
