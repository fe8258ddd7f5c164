"""`python -m jaxspec.bench sps` on a tiny random model: the table it writes loads as an SPSTable
with one entry per token count B*w (no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxspec.bench import sps
from jaxspec.speculative.drafters.planner import SPSTable

REPO = Path(__file__).resolve().parents[1]


def test_sps_bench_writes_a_loadable_table(tmp_path, capsys):
    out = tmp_path / "sps" / "tiny.json"
    rc = sps.main(["--model", "tiny", "--batches", "2,1", "--widths", "1,2", "--context", "32", "--repeats", "1",
                   "--steps", "1", "--out", str(out)])
    assert rc == 0
    table = SPSTable.load(out)
    # Token counts B*w: 1, 2 (B=1 w=2 and B=2 w=1: the B=2 one is kept) and 4.
    assert table.tokens == (1, 2, 4)
    assert [(b, w) for b, w, _ in table.measurements] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    rate = {(b, w): r for b, w, r in table.measurements}
    assert table.steps_per_s[1] == rate[(2, 1)]
    assert all(r > 0 for r in table.steps_per_s)
    assert table.context == 32 and table.model == "tiny (random)" and "--repeats 1" in table.source
    printed = capsys.readouterr().out
    assert "| tokens | steps/s |" in printed and str(out) in printed


def test_to_table_keeps_the_largest_batch():
    t = sps.to_table({(1, 4): 10.0, (4, 1): 7.0, (2, 2): 8.0, (1, 1): 12.0})
    assert t.tokens == (1, 4) and t.steps_per_s == (12.0, 7.0)


def test_bad_flags_are_errors(capsys):
    with pytest.raises(SystemExit):
        sps.main(["--batches", "0,1"])
    assert sps.main(["--model", "tiny", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_shipped_cpu_table_loads():
    table = SPSTable.load(REPO / "configs" / "sps" / "cpu-2core.json")
    assert table.tokens == (1, 2, 4, 8, 16, 32, 64)
    assert table.context == 256 and "SmolLM2" in table.model


def test_sampled_verify_steps_decide_what_the_loop_decides(tmp_path, capsys):
    """`--sampled` times verify steps with their accept decision: greedy rows emit the argmax of the
    same forward's logits, sampled rows the coupled walk's bonus (checked against a walk over the
    dense softmax / noise races), and the run writes no table."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.cache.paged import KVCache
    from jaxspec.speculative import sampling

    params, cfg, _, _ = sps.load("tiny", "float32", "xla")
    b, w, ctx = 2, 3, 16
    table = 1 + jnp.arange(b * 2, dtype=jnp.int32).reshape(b, 2)
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (b, w)), jnp.int32)
    lens = jnp.full((b,), ctx, jnp.int32)

    def run(accept):
        cache = KVCache.zeros(cfg.num_layers, 1 + b * 2, 16, cfg.num_kv_heads, cfg.head_dim)
        return np.asarray(sps.make_verify_fn(cfg, accept)(params, cache, toks, table, lens)[1])

    logits = run(None)
    np.testing.assert_array_equal(run(sps.SAMPLED["greedy"]), logits.argmax(-1))
    t, k, p = sps.SAMPLED["T 0.8, top-p 0.9"]
    keys = jax.vmap(jax.vmap(sampling.race_key, in_axes=(None, 0)))(jnp.arange(b, dtype=jnp.uint32),
                                                                    lens[:, None] + 1 + jnp.arange(w)[None])
    probs = sampling.target_probs_from_logits(logits, jnp.full((b,), t), jnp.full((b,), k), jnp.full((b,), p))
    noise = jax.vmap(jax.vmap(lambda key: sampling.exp_noise(key, (cfg.vocab_size,))))(keys)
    races = np.asarray(probs / noise).argmax(-1)  # [b, w]: the race after each fed token
    bonus = []
    for r in range(b):  # the coupled walk over the fed chain: accept while the next token is the race
        j = 0
        while j < w - 1 and toks[r, j + 1] == races[r, j]:
            j += 1
        bonus.append(races[r, j])
    np.testing.assert_array_equal(run((t, k, p)), bonus)
    rc = sps.main(["--model", "tiny", "--batches", "1", "--widths", "2", "--context", "32", "--repeats", "1",
                   "--steps", "1", "--sampled", "--out", str(tmp_path / "x.json")])
    assert rc == 0 and not (tmp_path / "x.json").exists()
    assert "T 0.8, top-p 0.9 / greedy" in capsys.readouterr().out


def test_sampled_steps_read_chat_text_from_a_prefilled_cache(monkeypatch):
    """With `text`, each row's cache holds the text's first `context` tokens and the verified block is
    its next w tokens: the block's logits equal one forward over the whole text (checked here through
    the prefill `measure` runs). `chat_rows` cuts held-out ShareGPT conversations to that length."""
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.cache.paged import KVCache

    params, cfg, _, _ = sps.load("tiny", "float32", "xla")
    b, ctx, w, ps = 2, 16, 4, 16
    text = np.random.default_rng(1).integers(0, cfg.vocab_size, (b, ctx + w)).astype(np.int32)
    table = 1 + jnp.arange(b * 2, dtype=jnp.int32).reshape(b, 2)
    fresh = lambda: KVCache.zeros(cfg.num_layers, 1 + b * 2, ps, cfg.num_kv_heads, cfg.head_dim)  # noqa: E731
    fn = sps.make_verify_fn(cfg)
    _, whole = fn(params, fresh(), jnp.asarray(text), table, jnp.zeros((b,), jnp.int32))
    cache, _ = fn(params, fresh(), jnp.asarray(text[:, :ctx]), table, jnp.zeros((b,), jnp.int32))
    _, block = fn(params, cache, jnp.asarray(text[:, ctx:]), table, jnp.full((b,), ctx, jnp.int32))
    np.testing.assert_allclose(np.asarray(block), np.asarray(whole)[:, ctx:], rtol=1e-4, atol=1e-4)
    # Control: over the zero cache (no prefill) the same block reads other logits.
    _, cold = fn(params, fresh(), jnp.asarray(text[:, ctx:]), table, jnp.full((b,), ctx, jnp.int32))
    assert not np.allclose(np.asarray(cold), np.asarray(whole)[:, ctx:], atol=1e-3)
    rates = sps.measure(params, cfg, (b,), (w,), context=ctx, repeats=1, steps=1, page_size=ps,
                        accepts={"greedy": sps.SAMPLED["greedy"]}, text=text)
    assert set(rates) == {(b, w, "greedy")}

    class Tok:  # one token per character of each message, so the lengths are known
        def apply_chat_template(self, messages, tokenize=True):
            return [ord(c) % 97 for m in messages for c in m["content"]]

    from jaxspec.train import sharegpt

    convs = [sharegpt.Conversation(str(i), ({"role": "user", "content": "hi " * (40 * i)},
                                            {"role": "assistant", "content": "ok " * 50})) for i in range(5)]
    monkeypatch.setattr(sharegpt, "sharegpt_conversations", lambda split: iter(convs))
    rows = sps.chat_rows(Tok(), 3, 200)  # conversation 0 (150 characters) is too short
    assert rows.shape == (3, 200) and rows.dtype == np.int32 and (rows[0, :3] == [ord(c) % 97 for c in "hi "]).all()
    with pytest.raises(ValueError, match="only 2 conversations of 400"):
        sps.chat_rows(Tok(), 3, 400)
