"""Block drafters keep sampling lossless through the whole loop.

Sampled rows draw each block position from the block's own distribution under
the request's temperature / top-p (DSPARK: plus the Markov bias of the token
drawn before it) and hand that q to rejection verification. End to end through
the Engine on the V = 8 tiny target of tests/test_loop_distribution.py: the
joint of the first 3 generated tokens over SEEDS seeds is chi-square tested
(p > ALPHA) against the exact joint from Hugging Face logits, for DFLASH and
DSPARK (the latter with a falling SPS table, so ragged rows are sampled too)
at T = 1, and DFLASH at T = 0.7 / top_p = 0.9. Positive control: DFLASH with its q
replaced by a uniform one (drafts still from the block) fails (p < 1e-6).
"""

from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp

from jaxspec.config import EngineSection, SpecSection
from jaxspec.engine import Engine
from jaxspec.speculative.drafters.load import load_draft
from tests.heads_fixtures import block_heads_v8
from tests.test_loop_distribution import chi_square_p, exact_joint, first_three, joint_counts
from tests.test_loop_distribution import tiny  # noqa: F401  (the module-scoped V = 8 target fixture)

ALPHA = 1e-3
SEEDS = 60_000
BATCH = 2000
CONTROL_SEEDS = 20_000


@pytest.fixture(scope="module")
def heads(tiny, tmp_path_factory):  # noqa: F811
    return block_heads_v8(tmp_path_factory.mktemp("block_heads"), tiny[1])


def build_engine(model, heads, alg):
    spec = SpecSection(algorithm=alg, draft_model=str(heads[alg]), num_draft_tokens=4, verify="rejection",
                       sps_table=str(heads["table"]) if alg == "dspark" else "default")
    ecfg = EngineSection(max_batch_size=BATCH, batch_buckets=(BATCH,), max_context=32, length_buckets=(8, 16, 32),
                         page_size=4)
    return Engine(model.params, model.config, ecfg, progress=False, spec=spec,
                  draft=load_draft(spec, model, jnp.float32, progress=False))


# Both drafters at T = 1; the filtered distribution (T = 0.7, top_p = 0.9) on DFLASH, whose q is the
# same code path for both (DSPARK adds its Markov bias before it).
@pytest.mark.parametrize("alg,temperature,top_p", [("dflash", 1.0, 1.0), ("dspark", 1.0, 1.0), ("dflash", 0.7, 0.9)],
                         ids=["dflash-T1", "dspark-T1", "dflash-T0.7-p0.9"])
def test_loop_with_block_drafter_samples_the_target(tiny, heads, alg, temperature, top_p):  # noqa: F811
    model, hf = tiny
    toks, accepts = first_three(build_engine(model, heads, alg), temperature, top_p, seeds=range(SEEDS))
    assert np.sum(accepts > 1) > 2000, f"{alg}: only {np.sum(accepts > 1)} steps accepted a draft"
    p = chi_square_p(joint_counts(toks), exact_joint(hf, temperature, top_p))
    assert p > ALPHA, f"{alg} at T={temperature}, top_p={top_p}: joint of the first 3 tokens, chi-square p={p:.2e}"


def test_block_drafter_with_a_wrong_q_fails(tiny, heads, monkeypatch):  # noqa: F811
    import jaxspec.speculative.drafters.block as block_mod

    real = block_mod.choose_draft

    def uniform_q(logits, s, prev, d2t, vocab, sample, coupled=False):
        tok, q = real(logits, s, prev, d2t, vocab, sample, coupled)
        return tok, jnp.full_like(q, 1.0 / vocab)

    monkeypatch.setattr(block_mod, "choose_draft", uniform_q)
    model, hf = tiny
    toks, _ = first_three(build_engine(model, heads, "dflash"), 1.0, 1.0, seeds=range(CONTROL_SEEDS))
    p = chi_square_p(joint_counts(toks), exact_joint(hf, 1.0, 1.0))
    assert p < 1e-6, f"a uniform draft q passed the chi-square test (p={p:.2e})"
