"""N-gram drafter: device proposal == plain-Python reference of the documented
rule, tree-convention and "really follows an occurrence" properties, edge
cases, and the corpus reader. Shapes come from
a small fixed set so jit caches hit."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxspec.speculative.drafters.ngram import ngram_propose

B, C = 3, 20
# (num_draft_tokens, topk, min_match, max_match[, draft_tokens_by_match])
CONFIGS = ((1, 1, 1, 2), (6, 1, 1, 3), (8, 1, 2, 4), (5, 2, 2, 2), (8, 3, 1, 3),
           (12, 4, 1, 4), (8, 1, 1, 4, (3,)), (8, 3, 1, 3, (2, 4)), (6, 1, 1, 3, (1, 1, 2)))
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
# The corpus (`read_corpus`, `corpus_token_array`)
# --------------------------------------------------------------------------


def test_corpus_jsonl(tmp_path):
    from jaxspec.speculative.drafters.ngram import read_corpus

    path = tmp_path / "corpus.jsonl"
    lines = [{"prompt_ids": [1, 2], "output_ids": [3, 4]}, {"output_ids": [5, 6, 7]}, {},
             {"text": "a b c"}]
    path.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n")
    assert read_corpus(path) == [[1, 2, 3, 4], [5, 6, 7]]

    class Tok:
        def encode(self, text, add_special_tokens=True):
            return [ord(ch) for ch in text] + ([0] if add_special_tokens else [])

    path.write_text(json.dumps(lines[3]) + "\n")
    assert read_corpus(path, Tok()) == [[ord(ch) for ch in "a b c"]]  # no special tokens added
    assert read_corpus(path, lambda s: [len(s), 1]) == [[5, 1]]
    with pytest.raises(ValueError, match="tokenizer"):
        read_corpus(path)
    path.write_text(json.dumps(lines[2]) + "\n")
    with pytest.raises(ValueError, match="expected"):
        read_corpus(path)


def test_corpus_array_keeps_the_newest_tokens_and_drops_single_tokens(tmp_path):
    """Documents of one token are dropped (nothing follows them); past max_tokens the oldest go,
    a cut document starts at a separator, and a document longer than the bound keeps its tail."""
    from jaxspec.speculative.drafters.ngram import CORPUS_SEPARATOR as S
    from jaxspec.speculative.drafters.ngram import corpus_token_array

    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": d}) + "\n" for d in ([1, 2, 3], [9], [4, 5, 6, 7])))
    assert corpus_token_array(path).tolist() == [S, 1, 2, 3, S, 4, 5, 6, 7, S]
    assert corpus_token_array(path, max_tokens=7).tolist() == [S, S, 4, 5, 6, 7, S]  # "3" cut: a separator first
    path.write_text(json.dumps({"prompt_ids": list(range(100, 130))}) + "\n")
    assert corpus_token_array(path, max_tokens=5).tolist() == [S, 127, 128, 129, S]


def test_prepended_corpus_supplies_drafts_and_separators_stop_continuations(tmp_path):
    from jaxspec.speculative.drafters.ngram import CORPUS_SEPARATOR, corpus_token_array

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
    from jaxspec.speculative.drafters.ngram import CorpusError, corpus_token_array

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
    from jaxspec.speculative.drafters.ngram import CorpusError, read_corpus

    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "abc"}) + "\n")
    # A tokenizer whose ids reach past the model's vocabulary (added tokens).
    assert len(read_corpus(path, lambda s: [ord(c) for c in s], vocab_size=100)) == 1
    with pytest.raises(CorpusError, match=r"c.jsonl:1: token id 99 .*vocabulary of 99 ids"):
        read_corpus(path, lambda s: [ord(c) for c in s], vocab_size=99)


def test_corpus_without_vocab_size_still_refuses_negative_ids(tmp_path):
    # A negative id would pass for a document separator in the device array.
    from jaxspec.speculative.drafters.ngram import CorpusError, corpus_token_array

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
