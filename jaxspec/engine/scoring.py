"""Prompt log-probabilities: the target's own distribution at every prompt position.

What evaluation harnesses read to score text (lm-evaluation-harness's loglikelihood sends a
completion with `echo` and `logprobs`), and what `SamplingParams(prompt_logprobs=N)` returns. One
forward over the prompt, outside the decode loop, so speculation has nothing to do with these
numbers: the value at position i is log p(prompt[i] | prompt[:i]) under the RAW distribution
(the log-softmax of the target's logits, before temperature, top-k or top-p), vLLM's default
`logprobs_mode`. Under "processed" it is the distribution the sampler draws from there: the
request's logit bias, min_tokens and penalties over the tokens before the position (those past
`prompt_len` count as output), then temperature, top-k and top-p.

The LM head runs over the positions in chunks, so a long prompt never holds [T, V] logits at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.cache.paged import KVCache
from jaxspec.engine.types import TokenScores
from jaxspec.models.layers import linear
from jaxspec.models.llama import forward
from jaxspec.sampling_params import SamplingParams
from jaxspec.speculative.logprobs import TOP as MAX_TOP, entries, log_distribution
from jaxspec.speculative.penalties import penalize

CHUNK = 128  # positions per LM-head projection


def _length_bucket(n: int) -> int:
    """Padded length: whole chunks, a power of two of them (few compiled shapes)."""
    chunks = -(-n // CHUNK)
    return CHUNK * (1 << (chunks - 1).bit_length())


class PromptScorer:
    """Scores token sequences with a runner's weights (read only: the runner's caches are never touched, so
    a scoring call may run beside its decode calls)."""

    def __init__(self, runner, stop_ids=()):
        self.runner = runner
        self.stop_ids = tuple(stop_ids)  # the model's EOS (min_tokens bans them, processed mode)
        self._fns: dict[tuple[int, str], object] = {}  # (padded length, logprobs mode) -> jitted scorer

    def _fn(self, length: int, mode: str):
        if (length, mode) not in self._fns:
            cfg = self.runner.cfg

            def logprobs(logits, first, tokens, sp, prompt_len):  # [C, V] (positions first..) -> ([C, V], [C])
                # Each position as a batch row of one (the processors' [B] parameters repeated):
                # row c follows tokens[:first + c + 1].
                c = logits.shape[0]
                rows = jax.tree.map(lambda x: jnp.broadcast_to(x, (c,) + x.shape[1:]), sp)
                hist = first + jnp.arange(c, dtype=jnp.int32) + 1
                z = logits[:, None]
                if mode == "processed":
                    z = penalize(z, rows, jnp.broadcast_to(tokens, (c, length)), hist,
                                 jnp.minimum(jnp.full((c,), prompt_len), hist))
                z, offset = log_distribution(logits[:, None], z, rows, mode)
                return z[:, 0], offset[:, 0]

            def fn(params, tokens, n, sp, prompt_len):
                # 1. Final-norm states of every position: one forward, no cache written.
                cache = KVCache.zeros(cfg.num_layers, 1, 16, cfg.num_kv_heads, cfg.head_dim, params["embed"].dtype)
                zero = jnp.zeros((1,), jnp.int32)
                pos = jnp.arange(length, dtype=jnp.int32)[None]
                out = forward(params, cfg, tokens, pos, cache, jnp.zeros((1, 1), jnp.int32), q_start=zero,
                              kv_len=n[None], logits_index=zero[:, None], capture_final=True, write_cache=False)
                h = out.features[0].reshape(length // CHUNK, CHUNK, -1)  # [chunks, C, H]
                nxt = jnp.concatenate([tokens[0, 1:], tokens[0, :1]]).reshape(length // CHUNK, CHUNK)
                starts = jnp.arange(length // CHUNK, dtype=jnp.int32) * CHUNK

                # 2. Per chunk: log-probabilities, the next token's entry, the top entries.
                def chunk(args):
                    hc, tc, first = args
                    z, c = logprobs(linear(hc, params["head"]), first, tokens[0], sp, prompt_len)
                    return entries(z, c, tc)

                out = jax.lax.map(chunk, (h, nxt, starts))
                return tuple(x.reshape((length,) + x.shape[2:]) for x in out)

            self._fns[(length, mode)] = jax.jit(fn)
        return self._fns[(length, mode)]

    def score(self, prompt_ids, top: int = 0, sampling=None, prompt_len: int | None = None) -> TokenScores:
        """The scores of `prompt_ids` with the `top` (0..20) likeliest tokens at each position (entry
        i: token i, after tokens < i; entry 0 NaN: nothing predicts it); `sampling` (a SamplingParams)
        in the runner's "processed" logprobs mode, else raw, with the tokens from `prompt_len` on
        (default: none) counted as output by the penalties."""
        from jaxspec.engine.device_sampling import DeviceSampling
        from jaxspec.engine.types import RowInput

        n = len(prompt_ids)
        if not 1 <= n <= self.runner.max_context:
            raise ValueError(f"a scored prompt needs 1 to {self.runner.max_context} tokens, got {n}")
        length = _length_bucket(n)
        tokens = np.zeros((1, length), np.int32)
        tokens[0, :n] = prompt_ids
        sp = sampling if sampling is not None else SamplingParams()
        row = RowInput(tokens=(), prompt_len=0, page_row=np.zeros(1, np.int32), slot=0, params=sp,
                       stop_ids=sp.stop_ids(self.stop_ids))
        with self.runner.mesh_context():
            chosen, rank, top_id, top_lp = jax.device_get(self._fn(length, self.runner.ecfg.logprobs_mode)(
                self.runner.params, jnp.asarray(tokens), jnp.int32(n), DeviceSampling.pack([row], 1),
                jnp.int32(n if prompt_len is None else prompt_len)))
        # chosen[i] scores token i + 1 from position i: shift so entry i belongs to token i.
        token_lp = np.concatenate([[np.nan], chosen[: n - 1]]).astype(np.float32)
        k = max(0, min(int(top), MAX_TOP))
        shift = lambda x: np.concatenate([np.zeros_like(x[:1]), x[: n - 1]])[:, :k]  # noqa: E731
        ranks = np.concatenate([[0], rank[: n - 1]]).astype(np.int32)
        return TokenScores(token_lp, ranks, shift(top_id), shift(top_lp))
