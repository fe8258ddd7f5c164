"""Prompt log-probabilities: the target's own distribution at every prompt position.

What evaluation harnesses read to score text (lm-evaluation-harness's loglikelihood sends a
completion with `echo` and `logprobs`), and what `SamplingParams(prompt_logprobs=N)` returns. One
forward over the prompt, outside the decode loop, so speculation has nothing to do with these
numbers: the value at position i is log p(prompt[i] | prompt[:i]) under the RAW distribution
(the log-softmax of the target's logits, before temperature, top-k or top-p), vLLM's default
`logprobs_mode`. The last position's row is the distribution of the first generated token,
whatever the sampler then drew from it.

The LM head runs over the positions in chunks, so a long prompt never holds [T, V] logits at once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache.paged import KVCache
from jaxspec.models.layers import linear
from jaxspec.models.llama import forward
from jaxspec.sampling_params import SamplingParams
from jaxspec.speculative.sampling import target_probs_from_logits

MAX_TOP = 20  # OpenAI's and vLLM's cap on top logprobs
CHUNK = 128  # positions per LM-head projection
FLOOR = -9999.0  # a token the processed distribution excludes (log 0), as OpenAI writes it: JSON has no -inf


@dataclasses.dataclass
class PromptScores:
    """token_logprobs [T]: log p(token i | tokens < i), NaN at position 0 (nothing predicts it);
    token_ranks [T]: its rank there (1 = likeliest); top_ids / top_logprobs [T, k]: the k likeliest
    tokens after position i - 1 (row 0 unused); next_logprobs [V]: the distribution after the last
    prompt token (the first generated one's)."""

    token_logprobs: np.ndarray
    token_ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    next_logprobs: np.ndarray


def _length_bucket(n: int) -> int:
    """Padded length: whole chunks, a power of two of them (few compiled shapes)."""
    chunks = -(-n // CHUNK)
    return CHUNK * (1 << (chunks - 1).bit_length())


class PromptScorer:
    """Scores token sequences with a runner's weights (read only: the runner's caches are never touched, so
    a scoring call may run beside its decode calls)."""

    def __init__(self, runner):
        self.runner = runner
        self._fns: dict[tuple[int, bool], object] = {}  # (padded length, processed mode) -> jitted scorer

    def _fn(self, length: int, processed: bool):
        if (length, processed) not in self._fns:
            cfg = self.runner.cfg

            def logprobs(logits, sampling):  # [C, V] -> [C, V] f32 in the configured mode
                if not processed:
                    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
                t, k, p = sampling
                probs = target_probs_from_logits(logits[None], t[None], k[None], p[None])[0]
                return jnp.maximum(jnp.log(probs), FLOOR)

            def fn(params, tokens, n, sampling):
                # 1. Final-norm states of every position: one forward, no cache written.
                cache = KVCache.zeros(cfg.num_layers, 1, 16, cfg.num_kv_heads, cfg.head_dim, params["embed"].dtype)
                zero = jnp.zeros((1,), jnp.int32)
                pos = jnp.arange(length, dtype=jnp.int32)[None]
                out = forward(params, cfg, tokens, pos, cache, jnp.zeros((1, 1), jnp.int32), q_start=zero,
                              kv_len=n[None], logits_index=zero[:, None], capture_final=True, write_cache=False)
                h = out.features[0].reshape(length // CHUNK, CHUNK, -1)  # [chunks, C, H]
                nxt = jnp.concatenate([tokens[0, 1:], tokens[0, :1]]).reshape(length // CHUNK, CHUNK)

                # 2. Per chunk: log-softmax, the next token's entry, the top entries.
                def chunk(args):
                    hc, tc = args
                    lp = logprobs(linear(hc, params["head"]), sampling)  # [C, V]
                    chosen = jnp.take_along_axis(lp, tc[:, None], axis=1)[:, 0]
                    rank = jnp.sum(lp > chosen[:, None], axis=-1, dtype=jnp.int32) + 1
                    top_lp, top_id = jax.lax.top_k(lp, MAX_TOP)
                    return chosen, rank, top_lp, top_id

                chosen, rank, top_lp, top_id = jax.lax.map(chunk, (h, nxt))
                flat = lambda x: x.reshape((length,) + x.shape[2:])  # noqa: E731
                last = logprobs(linear(out.features[0, n - 1][None], params["head"]), sampling)[0]
                return flat(chosen), flat(rank), flat(top_lp), flat(top_id), last

            self._fns[(length, processed)] = jax.jit(fn)
        return self._fns[(length, processed)]

    def score(self, prompt_ids, top: int = 0, sampling=None) -> PromptScores:
        """The scores of `prompt_ids` with the `top` (0..20) likeliest tokens at each position;
        `sampling` (a SamplingParams) in the runner's "processed" logprobs mode, else raw."""
        n = len(prompt_ids)
        if not 1 <= n <= self.runner.max_context:
            raise ValueError(f"a scored prompt needs 1 to {self.runner.max_context} tokens, got {n}")
        length = _length_bucket(n)
        tokens = np.zeros((1, length), np.int32)
        tokens[0, :n] = prompt_ids
        processed = self.runner.ecfg.logprobs_mode == "processed"
        sp = sampling if sampling is not None else SamplingParams()
        knobs = (jnp.float32(sp.temperature), jnp.int32(sp.top_k), jnp.float32(sp.top_p))
        with self.runner.mesh_context():
            chosen, rank, top_lp, top_id, last = jax.device_get(
                self._fn(length, processed)(self.runner.params, jnp.asarray(tokens), jnp.int32(n), knobs))
        # chosen[i] scores token i + 1 from position i: shift so entry i belongs to token i.
        token_lp = np.concatenate([[np.nan], chosen[: n - 1]]).astype(np.float32)
        k = max(0, min(int(top), MAX_TOP))
        shift = lambda x: np.concatenate([np.zeros_like(x[:1]), x[: n - 1]])[:, :k]  # noqa: E731
        ranks = np.concatenate([[0], rank[: n - 1]]).astype(np.int32)
        return PromptScores(token_lp, ranks, shift(top_id), shift(top_lp), np.asarray(last))
