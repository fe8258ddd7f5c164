"""What makes a request impossible to serve on a `ModelRunner`: each check raises RequestError
naming the field. Shared by the offline engine (whole requests) and the server (token ids)."""

from __future__ import annotations

from typing import Sequence

from jaxspec.engine.types import RequestError
from jaxspec.sampling_params import SamplingParams


def check_request(runner, prompt_ids: Sequence[int], params: SamplingParams, stop_ids: Sequence[int]) -> None:
    """RequestError naming what makes this request impossible to serve here."""
    from jaxspec.speculative.algorithm import check_request_sampling

    if not prompt_ids:
        raise RequestError("empty prompt: at least one prompt token is required")
    bad = [t for t in prompt_ids if not 0 <= int(t) < runner.cfg.vocab_size]
    if bad:
        raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {runner.cfg.vocab_size})")
    max_tokens = params.max_tokens  # >= 1: SamplingParams checked it
    if len(prompt_ids) + max_tokens + runner.reserve > runner.max_context:
        raise RequestError(f"prompt of {len(prompt_ids)} tokens + max_tokens {max_tokens} (+{runner.reserve} "
                           f"draft-tree slots) exceeds the context of {runner.max_context} tokens")
    check_token_ids(runner, params, stop_ids)
    try:
        check_request_sampling(runner.base_plan.verify, params.temperature)
    except ValueError as e:
        raise RequestError(str(e)) from None


def check_token_ids(runner, params: SamplingParams, stop_ids: Sequence[int]) -> None:
    """RequestError "<field>: ..." for token ids the device arrays cannot hold: stop ids past
    MAX_STOP_IDS, stop_token_ids / logit_bias ids outside the vocabulary."""
    from jaxspec.engine.device_sampling import MAX_STOP_IDS

    if len(stop_ids) > MAX_STOP_IDS:
        raise RequestError(f"stop_token_ids: at most {MAX_STOP_IDS} stop token ids (the model's EOS included) "
                           f"are supported, got {len(stop_ids)}")
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias])):
        out = [t for t in ids if t >= runner.cfg.vocab_size]
        if out:
            raise RequestError(f"{name}: token id {out[0]} is outside the vocabulary [0, {runner.cfg.vocab_size})")
