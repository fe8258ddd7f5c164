"""Hugging Face references and the tie-aware greedy comparison."""

from __future__ import annotations

import numpy as np


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face `generate`, greedy, EOS ignored."""
    import torch

    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=0, eos_token_id=None,
        )
    return out[0, len(prompt_ids):].tolist()


def hf_last_logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].numpy()


def assert_teacher_forced_greedy(model, prompt_ids, ours, eps: float = 1e-4) -> int:
    """`ours` is Hugging Face's greedy continuation of `prompt_ids`, checked by one forward pass over
    prompt + ours (teacher forcing) instead of a token-by-token `generate`: every token must be the
    argmax of HF's logits given the tokens before it, or, at a genuine fp32 near-tie (top-2 margin
    under `eps`), the runner-up. Greedy decoding is exactly that rule, so a sequence passing it is
    HF's greedy sequence up to ties; unlike comparing with `generate`, positions after a tie are
    still checked (given our own history). Returns the number of near-ties met."""
    import torch

    ids = list(prompt_ids) + list(ours)
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits[0, len(prompt_ids) - 1:].double().numpy()
    ties = 0
    for i, (tok, row) in enumerate(zip(ours, logits)):
        top = int(np.argsort(row)[-1])  # the helper's order, so an exact tie ranks the same
        if tok != top:
            _assert_near_tie_runner_up(row, tok, eps, f"token {i}: ours {tok}, HF's argmax {top}")
            ties += 1
    return ties


def _assert_near_tie_runner_up(logits: np.ndarray, ours: int, eps: float, what: str) -> None:
    """Our token differs from the reference's argmax: legitimate only at a genuine fp32 near-tie
    (top-2 margin under `eps`, relative) where ours is the runner-up."""
    top2 = np.argsort(logits)[-2:][::-1]
    margin = float(logits[top2[0]] - logits[top2[1]])
    assert margin < eps * max(1.0, abs(float(logits[top2[0]]))) and ours == int(top2[1]), (
        f"{what} (top-2 {top2.tolist()}, margin {margin:.3g})"
    )


def assert_greedy_equal(model, prompt_ids, ours, ref, eps: float = 1e-4):
    """Token-for-token equality, except at a genuine fp32 near-tie.

    At the first divergence the reference's top-2 logit margin must be under
    `eps` and our token must be its runner-up; anything else is a bug. After a
    legitimate tie the continuations differ, so comparison stops there.
    """
    assert len(ours) == len(ref), (len(ours), len(ref))
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a == b:
            continue
        logits = hf_last_logits(model, list(prompt_ids) + list(ref[:i]))
        _assert_near_tie_runner_up(logits, a, eps, f"divergence at token {i}: ours {a}, reference {b}")
        return i
    return len(ref)


def compile_events(fn) -> list[str]:
    """JAX compile events seen while `fn()` runs (the no-recompile checks)."""
    import jax

    seen = []

    def listener(event, duration, **kw):
        if "compile" in event:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return seen



def chi_square_pvalue(counts, probs) -> float:
    """Pearson chi-square of counts against probs, cells with expected count < 5 pooled."""
    from scipy import stats

    counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
    assert counts[probs == 0].sum() == 0, "a zero-probability token was sampled"
    expected = probs / probs.sum() * counts.sum()
    big = expected >= 5
    obs, exp = counts[big], expected[big]
    if (~big).any():  # an empty pooled cell would be 0/0
        obs, exp = np.append(obs, counts[~big].sum()), np.append(exp, expected[~big].sum())
    if obs.size < 2:
        return 1.0  # one possible outcome: nothing to test
    return float(stats.chisquare(obs, exp).pvalue)


def hf_first_two_marginals(model, prompt_ids: list[int]):
    """f(t) -> (p(token 1), p(token 2)) at temperature t: HF logits after the prompt and after
    every possible first token, so the second token's marginal is exact."""
    import torch

    with torch.no_grad():
        first = model(torch.tensor([prompt_ids])).logits[0, -1].double().numpy()
        vocab = first.shape[-1]
        second = model(torch.tensor([prompt_ids + [v] for v in range(vocab)])).logits[:, -1].double().numpy()

    def softmax(x, t):
        z = np.exp((x - x.max(-1, keepdims=True)) / t)
        return z / z.sum(-1, keepdims=True)

    return lambda t: (softmax(first, t), softmax(first, t) @ softmax(second, t))


def greedy_rows(b: int):
    """The DeviceSampling of b greedy rows with no processors: the `sampling` of a hand-built loop state."""
    from jaxspec.engine.device_sampling import DeviceSampling

    return DeviceSampling.pack([None] * b, b)
