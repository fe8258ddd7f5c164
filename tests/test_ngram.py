"""N-gram drafter: device proposal == plain-Python reference of the documented
rule, tree-convention and "really follows an occurrence" properties, edge
cases, merge_extra, and the host corpus against a brute force. Shapes come from
a small fixed set so jit caches hit."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxspec.speculative.ngram import NgramCorpus, merge_extra, ngram_propose

B, C = 3, 20
# (num_draft_tokens, topk, min_match, max_match[, draft_tokens_by_match])
CONFIGS = ((1, 1, 1, 2), (6, 1, 1, 3), (8, 1, 2, 4), (5, 2, 2, 2), (8, 3, 1, 3),
           (12, 4, 1, 4), (8, 1, 1, 4, (3,)), (8, 3, 1, 3, (2, 4)), (6, 1, 1, 3, (1, 1, 2)))
EXTRA = 4
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------
# Plain-Python references
# --------------------------------------------------------------------------


def ref_propose(h, hist_len, n_nodes, topk, min_match, max_match, cap=()):
    """The module-docstring rule, written out with loops and a dict trie."""
    length = max(1, min(hist_len, len(h)))
    h = [int(t) for t in h[:length]]
    depth = n_nodes - 1
    tokens, parents = [h[-1]] + [-1] * depth, [-1] + [0] * depth
    if depth == 0:
        return tokens, parents
    ml = {}
    for q in range(1, length):
        m = 0
        for n in range(1, max_match + 1):
            if q - n < 0 or h[q - n : q] != h[length - n :]:
                break
            m = n
        if m >= min_match:
            ml[q] = m
    branches = []
    for _ in range(topk):
        firsts = {br[0] for br in branches}
        best = None
        for q, m in ml.items():
            cont = h[q : min(length, q + depth, q + (cap[m - 1] if m <= len(cap) else depth))]
            if any(br[: len(cont)] == cont for br in branches):
                continue  # adds no trie node
            key = (cont[0] not in firsts, m, len(cont), q)
            if best is None or key > best[0]:
                best = (key, cont)
        if best is None:
            break
        branches.append(best[1])
    owner = {}
    for k, br in enumerate(branches):
        for d in range(len(br)):
            owner.setdefault(tuple(br[: d + 1]), k)
    slot = {(): 0}
    for i, path in enumerate(sorted(owner, key=lambda p: (len(p), owner[p]))[:depth], 1):
        tokens[i], parents[i], slot[path] = path[-1], slot[path[:-1]], i
    return tokens, parents


def paths(tokens, parents):
    """{node: token path from the root (excluded)} for real nodes."""
    out = {0: ()}
    for i in range(1, len(tokens)):
        if tokens[i] >= 0:
            out[i] = out[parents[i]] + (tokens[i],)
    return out


def check_convention(tokens, parents, root, chain):
    n = len(tokens)
    assert tokens[0] == root and parents[0] == -1
    real = [i for i in range(1, n) if tokens[i] >= 0]
    assert real == list(range(1, 1 + len(real))), "padding must follow real nodes"
    for i in range(1, n):
        if tokens[i] >= 0:
            assert 0 <= parents[i] < i and (parents[i] == 0 or tokens[parents[i]] >= 0)
            if chain:
                assert parents[i] == i - 1
        else:
            assert tokens[i] == -1 and parents[i] == 0
    ps = list(paths(tokens, parents).values())
    assert len(set(ps)) == len(ps), "sibling duplicates: the trie was not merged"


def follows_occurrence(h, length, path, min_match, max_match):
    """Some suffix n-gram occurs strictly earlier and is followed by `path`."""
    h = list(h[:length])
    for q in range(1, length):
        if q + len(path) > length or tuple(h[q : q + len(path)]) != tuple(path):
            continue
        for n in range(min_match, min(max_match, q) + 1):
            if h[q - n : q] == h[length - n :]:
                return True
    return False


def ref_merge(tokens, parents, extra, chain):
    tokens, parents = list(tokens), list(parents)
    n = len(tokens)
    ext = []
    for t in extra:
        if t < 0:
            break
        ext.append(int(t))
    num_real = next((i for i in range(1, n) if tokens[i] < 0), n)
    cur, m = 0, 0
    while m < len(ext):
        kids = [i for i in range(1, num_real) if parents[i] == cur and tokens[i] == ext[m]]
        if not kids:
            break
        cur, m = kids[0], m + 1
    if chain and cur != num_real - 1:
        return tokens, parents
    slot = num_real
    for t in ext[m:]:
        if slot >= n:
            break
        tokens[slot], parents[slot] = t, cur
        cur, slot = slot, slot + 1
    return tokens, parents


def run_device(hist, lens, cfg):
    n, k, lo, hi, *cap = cfg
    t, p = ngram_propose(jnp.asarray(hist), jnp.asarray(lens), num_draft_tokens=n, topk=k,
                         min_match=lo, max_match=hi, draft_tokens_by_match=tuple(cap[0]) if cap else ())
    return np.asarray(t), np.asarray(p)


# --------------------------------------------------------------------------
# Device proposal vs reference
# --------------------------------------------------------------------------


@st.composite
def histories(draw):
    """(history [B, C] int32, hist_len [B] int32): small vocab so matches are
    frequent; the garbage past hist_len uses the same vocab so reading it
    would show up as a wrong match."""
    rnd = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    vocab = draw(st.sampled_from([2, 3, 5]))
    hist = rnd.integers(0, vocab, size=(B, C)).astype(np.int32)
    lens = np.array(draw(st.lists(st.integers(1, C), min_size=B, max_size=B)), np.int32)
    return hist, lens


@settings(max_examples=120, **SETTINGS)
@given(data=histories(), cfg=st.sampled_from(CONFIGS))
def test_propose_matches_reference(data, cfg):
    hist, lens = data
    n, k, lo, hi, *cap = cfg
    tok, par = run_device(hist, lens, cfg)
    assert tok.shape == par.shape == (B, n) and tok.dtype == par.dtype == np.int32
    for b in range(B):
        want_t, want_p = ref_propose(hist[b], int(lens[b]), n, k, lo, hi, *cap)
        assert tok[b].tolist() == want_t and par[b].tolist() == want_p, (b, hist[b], lens[b])
        check_convention(tok[b].tolist(), par[b].tolist(), int(hist[b, lens[b] - 1]), k == 1)
        for path in paths(tok[b].tolist(), par[b].tolist()).values():
            if path:
                assert follows_occurrence(hist[b], int(lens[b]), path, lo, hi)


def test_chain_prefers_longest_n_then_full_and_recent():
    h = [1, 2, 9, 9, 9, 1, 2, 8, 8, 8, 1, 2]
    hist = np.zeros((B, C), np.int32)
    hist[:, : len(h)] = h
    lens = np.full((B,), len(h), np.int32)
    # D = 2: both occurrences of [1, 2] cover it, the recent one wins.
    tok, par = run_device(hist, lens, (3, 1, 1, 4))
    assert tok[0].tolist() == [2, 8, 8] and par[0].tolist() == [-1, 0, 1]
    # D = 7: only the older occurrence has 7 tokens after it.
    tok, _ = run_device(hist, lens, (8, 1, 2, 4))
    assert tok[0].tolist() == [2, 9, 9, 9, 1, 2, 8, 8]
    # A longer n-gram wins over a longer continuation.
    h2 = [4, 1, 2, 5, 5, 5, 5, 3, 1, 2, 6, 3, 1, 2]
    hist[:, : len(h2)] = h2
    tok, _ = run_device(hist, np.full((B,), len(h2), np.int32), (6, 1, 1, 3))
    assert tok[0].tolist() == [2, 6, 3, 1, 2, -1]


def test_tree_branches_and_bfs_layout():
    h = [1, 2, 9, 1, 2, 8, 1, 2]
    hist = np.zeros((B, C), np.int32)
    hist[:, : len(h)] = h
    tok, par = run_device(hist, np.full((B,), len(h), np.int32), (5, 2, 2, 2))
    # Branches 9 1 2 8 and 8 1 2; depth-major: 9, 8, then their children.
    assert tok[0].tolist() == [2, 9, 8, 1, 1] and par[0].tolist() == [-1, 0, 0, 1, 2]


@pytest.mark.parametrize("h,lens,cfg,want", [
    ([5], 1, (6, 1, 1, 3), [5, -1, -1, -1, -1, -1]),  # hist_len 1
    ([1, 2, 3, 4, 0], 5, (6, 1, 1, 3), [0, -1, -1, -1, -1, -1]),  # no match
    ([5, 5], 2, (6, 1, 1, 3), [5, 5, -1, -1, -1, -1]),  # match at the very end
    ([7, 7, 7, 7], 4, (6, 1, 1, 3), [7, 7, -1, -1, -1, -1]),  # longest n, short run
    ([1, 1], 2, (8, 1, 2, 4), [1, -1, -1, -1, -1, -1, -1, -1]),  # min_match > hist_len
    ([1, 2, 1, 3, 3], 3, (6, 1, 1, 3), [1, 2, 1, -1, -1, -1]),  # garbage past hist_len
    ([1, 2, 3, 1, 2, 3, 1], 0, (6, 1, 1, 3), [1, -1, -1, -1, -1, -1]),  # hist_len 0 -> 1
])
def test_edge_cases(h, lens, cfg, want):
    hist = np.full((B, C), 1, np.int32)
    hist[:, : len(h)] = h
    tok, par = run_device(hist, np.full((B,), lens, np.int32), cfg)
    assert tok[0].tolist() == want
    assert par[0].tolist() == [-1] + [i if want[i + 1] >= 0 else 0 for i in range(len(want) - 1)]


def test_draft_cap_by_match_length():
    # Only a 1-gram matches (the final 1): its 7-token continuation is cut to
    # the cap; a 2-gram match in the same history still drafts the whole chain.
    h = [1, 2, 3, 4, 5, 6, 7, 8, 1]
    hist = np.zeros((B, C), np.int32)
    hist[:, : len(h)] = h
    tok, _ = run_device(hist, np.full((B,), len(h), np.int32), (8, 1, 1, 4, (3,)))
    assert tok[0].tolist() == [1, 2, 3, 4, -1, -1, -1, -1]
    h2 = h + [2]
    hist[:, : len(h2)] = h2
    tok, _ = run_device(hist, np.full((B,), len(h2), np.int32), (8, 1, 1, 4, (3,)))
    assert tok[0].tolist() == [2, 3, 4, 5, 6, 7, 8, 1]


def test_bad_config():
    hist = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="min_match"):
        ngram_propose(hist, jnp.ones((1,), jnp.int32), num_draft_tokens=4, topk=1,
                      min_match=3, max_match=2)
    with pytest.raises(ValueError, match="draft_tokens_by_match"):
        ngram_propose(hist, jnp.ones((1,), jnp.int32), num_draft_tokens=4, topk=1,
                      min_match=1, max_match=2, draft_tokens_by_match=(0,))
    with pytest.raises(ValueError, match="draft_tokens_by_match"):
        ngram_propose(hist, jnp.ones((1,), jnp.int32), num_draft_tokens=4, topk=1,
                      min_match=1, max_match=2, draft_tokens_by_match=(1, 2, 3))


# --------------------------------------------------------------------------
# merge_extra
# --------------------------------------------------------------------------


@settings(max_examples=60, **SETTINGS)
@given(data=histories(), cfg=st.sampled_from([c for c in CONFIGS if c[0] > 1]),
       seed=st.integers(0, 2**32 - 1))
def test_merge_matches_reference(data, cfg, seed):
    hist, lens = data
    tok, par = run_device(hist, lens, cfg)
    rnd = np.random.default_rng(seed)
    extra = rnd.integers(0, 3, size=(B, EXTRA)).astype(np.int32)
    cut = rnd.integers(0, EXTRA + 1, size=B)
    extra[np.arange(EXTRA)[None, :] >= cut[:, None]] = -1
    chain = cfg[1] == 1
    mt, mp = merge_extra(jnp.asarray(tok), jnp.asarray(par), jnp.asarray(extra), chain=chain)
    mt, mp = np.asarray(mt), np.asarray(mp)
    for b in range(B):
        want_t, want_p = ref_merge(tok[b].tolist(), par[b].tolist(), extra[b].tolist(), chain)
        assert mt[b].tolist() == want_t and mp[b].tolist() == want_p
        check_convention(want_t, want_p, int(tok[b, 0]), chain)


def test_merge_examples():
    tok = jnp.array([[3, 9, 8, 1, -1, -1]], jnp.int32)
    par = jnp.array([[-1, 0, 0, 1, 0, 0]], jnp.int32)
    t, p = merge_extra(tok, par, jnp.array([[9, 1, 3, 4]], jnp.int32))
    assert t.tolist() == [[3, 9, 8, 1, 3, 4]] and p.tolist() == [[-1, 0, 0, 1, 3, 4]]
    t, p = merge_extra(tok, par, jnp.array([[7, 6, -1, 5]], jnp.int32))  # new root branch
    assert t.tolist() == [[3, 9, 8, 1, 7, 6]] and p.tolist() == [[-1, 0, 0, 1, 0, 4]]
    t, _ = merge_extra(tok, par, jnp.array([[9, 1, -1, -1]], jnp.int32))  # already there
    assert t.tolist() == tok.tolist()
    chain_par = jnp.array([[-1, 0, 0, 0]], jnp.int32)
    for drafts, extra, want in [([3, -1, -1, -1], [5, 6, 7, 8, 9], [3, 5, 6, 7]),
                                ([3, 5, -1, -1], [5, 6], [3, 5, 6, -1]),
                                ([3, 4, -1, -1], [5, 6], [3, 4, -1, -1])]:
        t, p = merge_extra(jnp.array([drafts], jnp.int32), chain_par,
                           jnp.array([extra], jnp.int32), chain=True)
        assert t.tolist() == [want]
        assert p.tolist() == [[-1] + [i if want[i + 1] >= 0 else 0 for i in range(3)]]


# --------------------------------------------------------------------------
# Host corpus
# --------------------------------------------------------------------------


def brute_lookup(docs, ctx, k, lo, hi):
    for n in range(min(hi, len(ctx)), lo - 1, -1):
        best = None
        for d, doc in enumerate(docs):
            for q in range(n, len(doc)):
                if list(doc[q - n : q]) == list(ctx[len(ctx) - n :]):
                    key = (min(len(doc) - q, k), d, q)
                    if best is None or key > best[0]:
                        best = (key, list(doc[q : q + k]))
        if best is not None:
            return best[1]
    return []


@settings(max_examples=60, **SETTINGS)
@given(seed=st.integers(0, 2**32 - 1), lo=st.integers(1, 2), hi=st.integers(2, 4),
       k=st.integers(1, 6))
def test_corpus_matches_brute_force(seed, lo, hi, k):
    rnd = np.random.default_rng(seed)
    docs = [rnd.integers(0, 3, size=rnd.integers(0, 12)).tolist() for _ in range(4)]
    corpus = NgramCorpus(min_match=lo, max_match=hi, max_occurrences=1000)
    for doc in docs:
        corpus.add(doc)
    kept = [d for d in docs if len(d) >= 2]
    ctxs = [rnd.integers(0, 3, size=rnd.integers(0, 6)).tolist() for _ in range(4)]
    extra = corpus.lookup_batch(ctxs, k)
    assert extra.shape == (4, k) and extra.dtype == np.int32
    for i, ctx in enumerate(ctxs):
        want = brute_lookup(kept, ctx, k, lo, hi)
        assert corpus.lookup(ctx, k) == want
        assert extra[i].tolist() == want + [-1] * (k - len(want))


def test_corpus_bounds_and_eviction():
    corpus = NgramCorpus(min_match=1, max_match=2, max_tokens=10, max_occurrences=2)
    corpus.add([1, 2, 3, 4, 5])
    assert corpus.lookup([9, 1, 2], 3) == [3, 4, 5]
    corpus.add([6, 2, 7, 8])
    assert corpus.lookup([1, 2], 2) == [3, 4]  # 2-gram beats the newer 1-gram
    assert corpus.lookup([2], 2) == [7, 8]  # most recent among full continuations
    corpus.add([2, 9, 9])  # 12 tokens > 10: the first document goes
    assert len(corpus) == 2 and corpus.num_tokens == 7
    assert corpus.lookup([1, 2], 2) == [9, 9]  # (1, 2) left with doc 0; newest [2]
    assert not any(d == 0 for occ in corpus._index.values() for d, _ in occ)
    corpus.add([2, 5, 2, 6])  # [2] now occurs 4 times; only the last 2 are kept
    assert len(corpus._index[(2,)]) == 2
    corpus.add(list(range(100, 130)))  # longer than the bound: keeps the tail
    assert corpus.num_tokens == 10 and corpus.lookup([125], 3) == [126, 127, 128]
    assert corpus.lookup([], 3) == [] and corpus.lookup([1, 2], 0) == []


def test_corpus_jsonl(tmp_path):
    path = tmp_path / "corpus.jsonl"
    lines = [{"prompt_ids": [1, 2], "output_ids": [3, 4]}, {"output_ids": [5, 6, 7]}, {},
             {"text": "a b c"}]
    path.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n")
    corpus = NgramCorpus.from_jsonl(path, max_match=2)
    assert len(corpus) == 2 and corpus.lookup([2], 2) == [3, 4]
    assert corpus.lookup([6], 2) == [7]

    class Tok:
        def encode(self, text, add_special_tokens=True):
            return [ord(ch) for ch in text] + ([0] if add_special_tokens else [])

    path.write_text(json.dumps(lines[3]) + "\n")
    corpus = NgramCorpus.from_jsonl(path, Tok())
    assert corpus.lookup([ord("a")], 4) == [ord(ch) for ch in " b c"]
    assert NgramCorpus.from_jsonl(path, lambda s: [len(s), 1]).lookup([5], 1) == [1]
    with pytest.raises(ValueError, match="tokenizer"):
        NgramCorpus.from_jsonl(path)
    path.write_text(json.dumps(lines[2]) + "\n")
    with pytest.raises(ValueError, match="expected"):
        NgramCorpus.from_jsonl(path)


def test_corpus_extra_into_device_proposal():
    """End to end: no match in the own history, the corpus fills the chain."""
    corpus = NgramCorpus()
    corpus.add([10, 11, 12, 13, 14])
    hist = np.zeros((B, C), np.int32)
    hist[:, :3] = [20, 21, 11]
    lens = np.full((B,), 3, np.int32)
    tok, par = run_device(hist, lens, (4, 1, 1, 3))
    extra = corpus.lookup_batch([hist[b, : lens[b]].tolist() for b in range(B)], 3)
    t, p = merge_extra(jnp.asarray(tok), jnp.asarray(par), jnp.asarray(extra), chain=True)
    assert t.tolist()[0] == [11, 12, 13, 14] and p.tolist()[0] == [-1, 0, 1, 2]


def test_prepended_corpus_supplies_drafts_and_separators_stop_continuations(tmp_path):
    from jaxspec.speculative.ngram import CORPUS_SEPARATOR, corpus_token_array

    path = tmp_path / "corpus.jsonl"
    path.write_text('{"prompt_ids": [1, 2, 3, 4, 5]}\n{"output_ids": [7, 8, 9]}\n')
    corpus = corpus_token_array(path)
    assert corpus.tolist() == [CORPUS_SEPARATOR, 1, 2, 3, 4, 5, CORPUS_SEPARATOR, 7, 8, 9, CORPUS_SEPARATOR]
    # The history "... 2 3" has no earlier match of its own; the corpus continues it with 4 5,
    # and the continuation stops at the separator instead of running into the next document.
    history = np.array([[11, 12, 2, 3]], np.int32)
    full = np.concatenate([corpus[None], history], axis=1)
    tokens, parents = ngram_propose(jnp.asarray(full), jnp.array([full.shape[1]]), num_draft_tokens=5, topk=1,
                                    min_match=2, max_match=3)
    assert tokens.tolist() == [[3, 4, 5, -1, -1]]
    # Without the corpus there is nothing to propose.
    tokens, _ = ngram_propose(jnp.asarray(history), jnp.array([4]), num_draft_tokens=5, topk=1,
                              min_match=2, max_match=3)
    assert tokens.tolist() == [[3, -1, -1, -1, -1]]


# --------------------------------------------------------------------------
# Corpus ids are checked against the vocabulary at load (issue 10, defect 7)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [50, 99_999_999, -3, 1.5, True, "7"])
def test_corpus_id_outside_vocab_is_refused_at_load(tmp_path, bad):
    from jaxspec.speculative.ngram import CorpusError, corpus_token_array

    vocab = 50
    path = tmp_path / "corpus.jsonl"

    def write(x):
        # Line 3 (after a blank line) holds the tested id at position 2.
        path.write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n\n"
                        + json.dumps({"prompt_ids": [4], "output_ids": [5, x, 6]}) + "\n")

    write(vocab - 1)  # positive control: the largest real id loads
    assert (vocab - 1) in corpus_token_array(path, vocab_size=vocab).tolist()
    write(bad)
    with pytest.raises(CorpusError) as err:
        corpus_token_array(path, vocab_size=vocab)
    msg = str(err.value)
    assert f"corpus.jsonl:3: token id {bad!r}" in msg or f"corpus.jsonl:3: token id {bad}" in msg
    assert "(position 2)" in msg
    if isinstance(bad, int) and not isinstance(bad, bool):
        assert "vocabulary of 50 ids (0..49)" in msg
    else:
        assert "not an integer" in msg
    assert issubclass(CorpusError, ValueError)  # generate.py turns ValueErrors into `error: ...`


def test_corpus_text_lines_are_checked_too(tmp_path):
    from jaxspec.speculative.ngram import CorpusError, NgramCorpus

    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "abc"}) + "\n")
    # A tokenizer whose ids reach past the model's vocabulary (added tokens).
    assert len(NgramCorpus.from_jsonl(path, lambda s: [ord(c) for c in s], vocab_size=100)) == 1
    with pytest.raises(CorpusError, match=r"c.jsonl:1: token id 99 .*vocabulary of 99 ids"):
        NgramCorpus.from_jsonl(path, lambda s: [ord(c) for c in s], vocab_size=99)


def test_corpus_without_vocab_size_still_refuses_negative_ids(tmp_path):
    # A negative id would pass for a document separator in the device array.
    from jaxspec.speculative.ngram import CorpusError, corpus_token_array

    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1, 10**6]}) + "\n")
    assert corpus_token_array(path).tolist()[1:3] == [1, 10**6]
    path.write_text(json.dumps({"prompt_ids": [1, -2, 3]}) + "\n")
    with pytest.raises(CorpusError, match="token id -2 .*ids >= 0"):
        corpus_token_array(path)


def test_generate_cli_reports_corpus_id_outside_vocab(tiny_dirs, tmp_path, capsys):
    from jaxspec.generate import main

    path, _ = tiny_dirs["llama"]
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [5, 17, 33, 9]}) + "\n")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"prompt_ids": [5, 17, 33, 9, 99_999_999]}) + "\n")
    argv = ["--model", str(path), "--prompts", str(prompts), "--spec", "ngram", "--num-draft-tokens", "4",
            "--ngram-corpus", str(corpus), "--max-new-tokens", "2", "--max-context", "64", "--quiet",
            "--set", "engine.length_buckets=16,32,64"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --ngram-corpus"), err
    assert "corpus.jsonl:1: token id 99999999 (position 4)" in err
    assert f"vocabulary of {vocab} ids" in err
