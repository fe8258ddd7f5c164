"""OpenAI request parsing and validation, and the response/chunk shapes.

Bodies are parsed by hand rather than by a pydantic model so every error
names its field the way OpenAI does (`param`), unknown fields are ignored,
and a `true` is never accepted as the integer 1.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from typing import Any

import numpy as np

from jaxspec.prompts import PromptError, check_messages
from jaxspec.sampling_params import (SamplingError, SamplingParams, check_logit_bias, check_stop, check_token_ids,
                                     check_value)
from jaxspec.serve.structured import parse_structured, tool_calls

MAX_N = 16
MAX_STOP_STRINGS = 16
# Deeper than any OpenAI request nests; a fixed bound, so a 10 KB body of brackets is a
# 400 however deep the server's own stack is when it parses.
MAX_JSON_DEPTH = 100


class APIError(Exception):
    """An OpenAI-style error response; `param` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": None}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param)


@dataclasses.dataclass(frozen=True)
class GenParams(SamplingParams):
    """A request's SamplingParams (validated by the rules every front end shares) plus the streaming fields."""

    stream: bool = False
    include_usage: bool = False
    # echo (completions): the prompt's text before the completion; logprobs: per-token log-probabilities
    # with the N likeliest at each position (the prompt's too with echo; engine/scoring.py).
    echo: bool = False
    logprobs: int | None = None
    # tools + tool_choice (chat): "required" or the named function; the reply is returned as tool_calls.
    tool_call: str | None = None


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    kind: str  # "completion" or "chat"
    prompts: list[list[int]]  # token ids, one entry per prompt (chat: exactly one)
    params: GenParams


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _get(body: dict, key: str, default, check, what: str):
    v = body.get(key)
    if v is None:
        return default
    if not check(v):
        raise bad(key, f"must be {what}, got {json.dumps(v)[:60]}")
    return v


def parse_json_body(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "request body is not valid UTF-8") from None
    too_deep = APIError(400, f"request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON ({e.msg} at position {e.pos})") from None
    except RecursionError:  # the parser's own limit, below ours only when the stack is already deep
        raise too_deep from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    if json_depth(body) > MAX_JSON_DEPTH:
        raise too_deep
    try:  # "\ud800" is valid JSON but no text: the tokenizer would fail on it
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "request body contains a lone surrogate escape (\\ud800-\\udfff); not valid text") from None
    return body


def json_depth(obj) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (o.values() if isinstance(o, dict) else o)
                         if isinstance(c, (dict, list)))
    return deepest


def _field(body: dict, key: str, default, field: str | None = None):
    """body[key] under the shared sampling rule of `field` (default: key), or `default` when absent."""
    v = body.get(key)
    if v is None:
        return default
    try:
        return check_value(field or key, v, key)
    except SamplingError as e:
        raise APIError(400, str(e), key) from None


def parse_gen_params(body: dict, default_max_tokens: int, defaults: dict | None = None,
                     kind: str = "chat") -> GenParams:
    """The request's generation parameters; `defaults` (the model's generation_config.json) fill
    temperature / top_p / top_k a body leaves out, before the OpenAI defaults. Log-probabilities:
    completions' `logprobs` (0-20) and `echo`, chat's `logprobs` (a boolean) and `top_logprobs`."""
    defaults = defaults or {}
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _field(body, key, default_max_tokens, "max_tokens")
    temperature = _field(body, "temperature", defaults.get("temperature", 1.0))
    if temperature > 2:  # OpenAI's range, narrower than what the sampler takes
        raise APIError(400, f"temperature must be a number in [0, 2], got {json.dumps(temperature)}", "temperature")
    top_p = _field(body, "top_p", defaults.get("top_p", 1.0))
    top_k = body.get("top_k")
    top_k = 0 if _is_int(top_k) and top_k == -1 else _field(body, "top_k", defaults.get("top_k", 0))  # -1 = off
    seed = _field(body, "seed", None)
    n = _field(body, "n", 1)
    if n > MAX_N:
        raise APIError(400, f"n must be an integer in [1, {MAX_N}], got {n}", "n")
    stream = _get(body, "stream", False, lambda v: isinstance(v, bool), "a boolean")
    ignore_eos = _get(body, "ignore_eos", False, lambda v: isinstance(v, bool), "a boolean")
    try:
        stop = check_stop(body.get("stop"))
    except SamplingError as e:
        raise APIError(400, str(e), "stop") from None
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop must be at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    opts = _get(body, "stream_options", {}, lambda v: isinstance(v, dict), "an object")
    include_usage = opts.get("include_usage", False)  # OpenAI: the usage chunk only when asked
    if not isinstance(include_usage, bool):
        raise bad("stream_options.include_usage", "must be a boolean")
    top = lambda v: _is_int(v) and 0 <= v <= 20  # noqa: E731
    echo, logprobs = False, None
    if kind == "completion":
        echo = _get(body, "echo", False, lambda v: isinstance(v, bool), "a boolean")
        logprobs = _get(body, "logprobs", None, top, "an integer in [0, 20]")
        if body.get("top_logprobs") is not None:
            raise bad("top_logprobs", "is a chat field; completions take logprobs: N")
    else:
        if body.get("echo") not in (None, False):
            raise bad("echo", "is a completions field")
        want = _get(body, "logprobs", False, lambda v: isinstance(v, bool), "a boolean")
        n_top = _get(body, "top_logprobs", None, top, "an integer in [0, 20]")
        if n_top is not None and not want:
            raise bad("top_logprobs", "needs logprobs: true")
        logprobs = (n_top or 0) if want else None
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise bad("best_of", "is not supported by this server")
    # Penalties, bias and vLLM's extensions (speculative/penalties.py).
    penalties = dict(presence_penalty=_field(body, "presence_penalty", 0.0),
                     frequency_penalty=_field(body, "frequency_penalty", 0.0),
                     repetition_penalty=_field(body, "repetition_penalty", 1.0),
                     min_tokens=_field(body, "min_tokens", 0))
    try:
        penalties["logit_bias"] = check_logit_bias(body.get("logit_bias"))
        penalties["stop_token_ids"] = check_token_ids(body.get("stop_token_ids"))
    except SamplingError as e:
        raise APIError(400, str(e), e.field) from None
    if penalties["min_tokens"] > max_tokens:
        raise bad("min_tokens", f"must be <= max_tokens ({max_tokens}), got {penalties['min_tokens']}")
    # Structured output (serve/structured.py): response_format, structured_outputs, guided_*, tools.
    if kind == "completion" and (body.get("tools") is not None or body.get("tool_choice") is not None):
        raise bad("tools" if body.get("tools") is not None else "tool_choice", "is a chat field")
    try:
        structured, tool_call = parse_structured(body)
    except SamplingError as e:
        raise APIError(400, str(e), e.field) from None
    return GenParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, n=n,
                     stop=stop, stream=stream, include_usage=include_usage, ignore_eos=ignore_eos, echo=echo,
                     logprobs=logprobs, structured_outputs=structured, tool_call=tool_call, **penalties)


def _token_list(v, vocab: int, param: str) -> list[int]:
    if not v or not all(_is_int(t) for t in v):
        raise bad(param, "a token list must be a non-empty list of integers")
    bad_ids = [t for t in v if not 0 <= t < vocab]
    if bad_ids:
        raise bad(param, f"token id {bad_ids[0]} is outside the vocabulary [0, {vocab})")
    return list(v)


def parse_completion(body: dict, tokenizer, vocab: int, default_max_tokens: int,
                     defaults: dict | None = None) -> ParsedRequest:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt", "is required")
    if isinstance(prompt, str):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        items = prompt
    else:
        raise bad("prompt", "must be a string, a list of strings, a token list or a list of token lists")
    if len(items) > MAX_N:
        raise bad("prompt", f"at most {MAX_N} prompts per request")
    params = parse_gen_params(body, default_max_tokens, defaults, "completion")  # cheap checks before tokenizing
    prompts = []
    for p in items:
        if isinstance(p, str):
            if not p:
                raise bad("prompt", "must not be empty")
            if tokenizer is None:
                raise bad("prompt", "the model has no tokenizer; send token ids")
            ids = tokenizer.encode(p, add_special_tokens=False)
            if not ids:
                raise bad("prompt", "tokenizes to no tokens")
            prompts.append(ids)
        else:
            prompts.append(_token_list(p, vocab, "prompt"))
    if len(prompts) * params.n > MAX_N:
        raise bad("n", f"prompts x n must be at most {MAX_N}")
    return ParsedRequest("completion", prompts, params)


def _flatten_content(messages: Any) -> Any:
    """OpenAI content parts ([{"type": "text", "text": ...}]) -> one string (roles: `check_messages`)."""
    if not isinstance(messages, list):
        return messages
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return messages  # check_messages names it
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        out.append({**m, "content": content})
    return out


def parse_chat(body: dict, tokenizer, default_max_tokens: int, defaults: dict | None = None) -> ParsedRequest:
    if "messages" not in body:
        raise bad("messages", "is required")
    messages = _flatten_content(body["messages"])
    try:
        messages = check_messages(messages, "messages")
    except PromptError as e:
        raise bad("messages", str(e).removeprefix("messages: ")) from None
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "the model has no chat template; use /v1/completions", "messages")
    params = parse_gen_params(body, default_max_tokens, defaults)  # tools checked before the template sees them
    tools = {"tools": body["tools"]} if body.get("tools") else {}
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **tools)
    except Exception as e:  # the template itself may reject a conversation (jinja raise_exception)
        raise bad("messages", f"the chat template rejected these messages: {str(e).splitlines()[0][:200]}") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return ParsedRequest("chat", [list(ids)], params)


# ---- responses -------------------------------------------------------------------------


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _message(text: str, finish: str, tool_call: str | None) -> tuple[dict, str]:
    """(the chat message, its finish_reason): a finished constrained tool call becomes tool_calls
    (OpenAI: finish_reason "tool_calls" when the model chose to call, "stop" for a named function)."""
    if tool_call is None or finish != "stop":
        return {"role": "assistant", "content": text}, finish
    return ({"role": "assistant", "content": None, "tool_calls": tool_calls(text, tool_call)},
            "tool_calls" if tool_call == "required" else "stop")


def response(kind: str, rid: str, model: str, choices: list[tuple[str, str]], prompt_tokens: int,
             completion_tokens: int, logprobs: list[dict] | None = None, cached_tokens: int = 0,
             tool_call: str | None = None) -> dict:
    """choices: (text, finish_reason) in index order; logprobs: each choice's, when asked; tool_call:
    the request's tool-call mode (GenParams.tool_call)."""
    if kind == "chat":
        body = []
        for i, (t, f) in enumerate(choices):
            message, f = _message(t, f, tool_call)
            body.append({"index": i, "message": message, "logprobs": logprobs[i] if logprobs else None,
                         "finish_reason": f})
        obj = "chat.completion"
    else:
        body = [{"index": i, "text": t, "logprobs": logprobs[i] if logprobs else None, "finish_reason": f}
                for i, (t, f) in enumerate(choices)]
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": body,
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def chunk(kind: str, rid: str, model: str, index: int, text: str, finish_reason: str | None,
          first: bool = False, logprobs: dict | None = None) -> dict:
    """logprobs: the chunk's tokens' (chat_logprobs / completion_logprobs), when asked."""
    if kind == "chat":
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(kind: str, rid: str, model: str, prompt_tokens: int, completion_tokens: int,
                cached_tokens: int = 0) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


def completion_logprobs(tokenizer, tokens: list[int], scores, first_null: bool = False, offset: int = 0) -> dict:
    """A completion choice's (or stream chunk's) `logprobs` (OpenAI's legacy layout): tokens,
    token_logprobs, top_logprobs ({token text: logprob}) and text_offset (from `offset`, the text
    before them). `scores`: TokenScores of exactly `tokens`; first_null: the first token is a
    prompt's first, which nothing predicts (echo): its entries are None."""
    text = (lambda t: tokenizer.decode([t])) if tokenizer is not None else str
    null = lambda i: first_null and i == 0  # noqa: E731
    lps = [None if null(i) else float(scores.token_logprobs[i]) for i in range(len(tokens))]
    tops = [None if null(i) else {text(int(k)): float(v) for k, v in zip(scores.top_ids[i], scores.top_logprobs[i])}
            for i in range(len(tokens))]
    strs = [text(int(t)) for t in tokens]
    offsets = (offset + np.cumsum([0] + [len(x) for x in strs[:-1]])).tolist() if strs else []
    return {"tokens": strs, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, tokens: list[int], scores) -> dict:
    """A chat choice's (or stream chunk's) `logprobs`: {"content": [{token, logprob, bytes,
    top_logprobs}]} per token; `scores`: TokenScores of exactly `tokens`."""
    def entry(t, lp):
        s = tokenizer.decode([int(t)]) if tokenizer is not None else str(t)
        return {"token": s, "logprob": float(lp), "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(t, scores.token_logprobs[i]),
                         "top_logprobs": [entry(k, v) for k, v in zip(scores.top_ids[i], scores.top_logprobs[i])]}
                        for i, t in enumerate(tokens)]}
