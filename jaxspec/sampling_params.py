"""Sampling parameters: one definition and one set of rules for the CLI, the server and `jaxspec.LLM`.

`SamplingParams` is what a request asks for; it is validated when built, so a
bad value fails before anything is loaded or compiled. The rules themselves
(`BOUNDS`, `check_value`, `check_stop`) are shared by the front ends that read
values from elsewhere: the CLI's JSONL lines and `[sampling]` config section,
the server's request bodies (its `GenParams` is a `SamplingParams` plus the
streaming fields). The engine's `Request`, the server's sequences and the runner's
rows hold the SamplingParams itself. Every message reads
"<field> must be <what>, got <value>".

No JAX here: the server's request parsing and the config import it cheaply.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from typing import Any, Callable, Sequence


class SamplingError(ValueError):
    """A bad sampling parameter; `field` names it, and the message starts with it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class Bound:
    """What a numeric field accepts: `kind` + `bound` read as "an integer >= 1"."""

    integer: bool
    ok: Callable[[int | float], bool]
    kind: str
    bound: str

    @property
    def what(self) -> str:
        return f"{self.kind} {self.bound}"


# The bounds follow the device arrays: top_k is int32 and the noise is keyed by a uint32 seed,
# so a wider value would wrap around and alias a smaller one.
BOUNDS: dict[str, Bound] = {
    "max_tokens": Bound(True, lambda v: v >= 1, "an integer", ">= 1"),
    "temperature": Bound(False, lambda v: v >= 0, "a finite number", ">= 0"),
    "top_p": Bound(False, lambda v: 0 < v <= 1, "a number", "in (0, 1]"),
    "top_k": Bound(True, lambda v: 0 <= v < 2**31, "an integer", "in [0, 2^31)"),
    "seed": Bound(True, lambda v: 0 <= v < 2**32, "an integer", "in [0, 2^32)"),
    "n": Bound(True, lambda v: v >= 1, "an integer", ">= 1"),
    "prompt_logprobs": Bound(True, lambda v: 0 <= v <= 20, "an integer", "in [0, 20]"),
    "logprobs": Bound(True, lambda v: 0 <= v <= 20, "an integer", "in [0, 20]"),
    # OpenAI's ranges for its two penalties and the bias; vLLM's for its extensions.
    "presence_penalty": Bound(False, lambda v: -2 <= v <= 2, "a number", "in [-2, 2]"),
    "frequency_penalty": Bound(False, lambda v: -2 <= v <= 2, "a number", "in [-2, 2]"),
    "repetition_penalty": Bound(False, lambda v: 0 < v <= 100, "a number", "in (0, 100]"),
    "min_tokens": Bound(True, lambda v: 0 <= v < 2**31, "an integer", "in [0, 2^31)"),
    "logit_bias_value": Bound(False, lambda v: -100 <= v <= 100, "a number", "in [-100, 100]"),
    "token_id": Bound(True, lambda v: 0 <= v < 2**31, "a token id", ">= 0"),
}

# Entries a request's logit_bias may hold (OpenAI's cap): the device carries them as a fixed-width
# sparse list, so the cap is also that width (`engine.device_sampling`).
MAX_LOGIT_BIAS = 300

# The user-facing CLI names (the [sampling] config section, --max-new-tokens, JSONL lines), kept
# for their users: their name -> the SamplingParams field whose rule they follow. Inside, from the
# engine's `Request` to the device arrays, there is only the SamplingParams (max_tokens).
ENGINE_FIELDS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                 "top_k": "top_k", "seed": "seed"}


def shown(value: Any) -> str:
    """`value` as the message quotes it: JSON (so a CLI line's NaN reads NaN), cut at 60 characters."""
    try:
        return json.dumps(value)[:60]
    except (TypeError, ValueError):
        return repr(value)[:60]


def as_number(value: Any, integer: bool) -> int | float | None:
    """`value` as a number, or None. NaN/inf, booleans and, for an integer, 2.7 are
    refused rather than turned into something the caller never said; 3.0 is 3."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    if not isinstance(value, numbers.Integral):
        value = float(value)
        if not math.isfinite(value) or (integer and not value.is_integer()):
            return None
    return int(value) if integer else float(value)


def check_value(field: str, value: Any, name: str | None = None) -> int | float:
    """`value` as numeric field `field` takes it (see BOUNDS), or SamplingError.

    `name` is what the caller calls the field (the CLI's max_new_tokens is
    max_tokens here); the message uses it."""
    name = name or field
    b = BOUNDS[field]
    v = as_number(value, b.integer)
    if v is None or not b.ok(v):
        raise SamplingError(name, f"{name} must be {b.what}, got {shown(value)}")
    return v


def check_stop(value: Any, name: str = "stop") -> tuple[str, ...]:
    """Stop strings as a tuple: None, one string or a list of non-empty strings."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise SamplingError(name, f"{name} must be a string or a list of strings, got {shown(value)}")
    if not all(value):
        raise SamplingError(name, f"{name} must not contain an empty string")
    return tuple(value)


def check_logit_bias(value: Any, name: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs: a {token id: bias} mapping whose keys may be
    strings of integers (JSON objects have string keys), or None."""
    if value is None:
        return ()
    if isinstance(value, (tuple, list)) and all(isinstance(e, (tuple, list)) and len(e) == 2 for e in value):
        value = dict(value)
    if not isinstance(value, dict):
        raise SamplingError(name, f"{name} must be an object mapping token ids to biases, got {shown(value)}")
    if len(value) > MAX_LOGIT_BIAS:
        raise SamplingError(name, f"{name} must hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
    out = {}
    for key, bias in value.items():
        tid = key
        if isinstance(key, str):
            tid = int(key) if key.strip().lstrip("-").isdigit() else None
        tid = as_number(tid, True) if tid is not None else None
        if tid is None or not BOUNDS["token_id"].ok(tid):
            raise SamplingError(name, f"{name} keys must be token ids (integers >= 0), got {shown(key)}")
        out[tid] = check_value("logit_bias_value", bias, f"{name}[{tid}]")
    return tuple(sorted(out.items()))


def check_token_ids(value: Any, name: str = "stop_token_ids") -> tuple[int, ...]:
    """A list of token ids as a tuple (None: empty)."""
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise SamplingError(name, f"{name} must be a list of token ids, got {shown(value)}")
    ids = [as_number(v, True) for v in value]
    if any(v is None or not BOUNDS["token_id"].ok(v) for v in ids):
        raise SamplingError(name, f"{name} must be a list of token ids (integers >= 0), got {shown(value)}")
    return tuple(dict.fromkeys(ids))


def check_bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SamplingError(field, f"{field} must be a boolean, got {shown(value)}")
    return value


# ---- structured outputs -------------------------------------------------------------------
# What a request constrains its output to, in vLLM's naming (its StructuredOutputsParams):
#     StructuredOutputs(json={...})            a JSON schema (dict or its JSON text)
#     StructuredOutputs(json_object=True)      any JSON object (OpenAI's response_format json_object)
#     StructuredOutputs(regex=r"\d{3}-\d{4}")  a regular expression (Rust `regex` syntax)
#     StructuredOutputs(choice=["yes", "no"])  exactly one of these strings
#     StructuredOutputs(grammar="start: ...")  a Lark grammar (llguidance's dialect), GBNF or EBNF
# Each becomes an llguidance grammar, validated when built and without a tokenizer, so a bad
# schema or regex fails where the request is parsed, with llguidance's message, and never reaches
# the device. jaxspec/grammar/matcher.py runs it on the host, speculative/grammar.py on device.

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# JSON is compact (", " and ": " separators, no free whitespace): a model cannot wander off into
# whitespace that the schema allows anywhere. A schema's own "x-guidance" options override it.
JSON_DEFAULTS = {"whitespace_flexible": False}


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint; `field` is what the caller called it (error messages name it).

    json: a JSON schema, kept as canonical JSON text (so the params stay hashable).
    choice: a tuple of non-empty strings. The llguidance grammar is built once, in `lark`."""

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    field: str = dataclasses.field(default="structured_outputs", compare=False)
    lark: str = dataclasses.field(default="", compare=False, repr=False)

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise SamplingError(self.field, f"{self.field} must set exactly one of {', '.join(KINDS)}, got "
                                            f"{', '.join(given) or 'none'}")
        kind = given[0]
        where = f"{self.field}.{kind}" if self.field == "structured_outputs" else self.field
        value = getattr(self, kind)
        object.__setattr__(self, "lark", _to_llguidance(kind, value, where, self))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


def _to_llguidance(kind: str, value: Any, where: str, obj: StructuredOutputs) -> str:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if kind == "json_object":
        if value is not True:
            raise SamplingError(where, f"{where} must be true, got {shown(value)}")
        grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    elif kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise SamplingError(where, f"{where} must be a JSON schema, got text that is not JSON ({e})") from None
        if not isinstance(value, (dict, bool)):
            raise SamplingError(where, f"{where} must be a JSON schema (an object), got {shown(value)}")
        object.__setattr__(obj, "json", json.dumps(value, sort_keys=True))
        try:
            grammar = LLMatcher.grammar_from_json_schema(value, defaults=JSON_DEFAULTS)
        except ValueError as e:
            raise SamplingError(where, f"{where}: {e}") from None
    elif kind == "regex":
        if not isinstance(value, str) or not value:
            raise SamplingError(where, f"{where} must be a non-empty string, got {shown(value)}")
        grammar = LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        if (not isinstance(value, (list, tuple)) or not value
                or not all(isinstance(c, str) and c for c in value)):
            raise SamplingError(where, f"{where} must be a non-empty list of non-empty strings, got {shown(value)}")
        object.__setattr__(obj, "choice", tuple(value))
        grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    else:
        if not isinstance(value, str) or not value.strip():
            raise SamplingError(where, f"{where} must be a non-empty grammar (Lark, GBNF or EBNF), got "
                                       f"{shown(value)}")
        try:
            grammar = LLMatcher.grammar_from_lark(any_to_lark(value))
        except Exception as e:  # noqa: BLE001 - the converter raises what its parser raises
            raise SamplingError(where, f"{where} is not a valid grammar: {str(e).splitlines()[0]}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise SamplingError(where, f"{where} is not valid: {' '.join(error.split())}")  # one line
    return grammar


def check_structured(value: Any, field: str = "structured_outputs") -> StructuredOutputs | None:
    """A StructuredOutputs from what a caller passed: one itself, None, or a mapping of its fields
    (vLLM's `structured_outputs` object: {"json": ...}, {"regex": ...}, {"choice": [...]},
    {"grammar": ...}, {"json_object": true}). Unknown keys are refused, never ignored."""
    if value is None or isinstance(value, StructuredOutputs):
        return value
    if not isinstance(value, dict):
        raise SamplingError(field, f"{field} must be an object with one of {', '.join(KINDS)}, got {shown(value)}")
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        raise SamplingError(f"{field}.{unknown[0]}", f"{field}.{unknown[0]} is not supported (one of "
                                                     f"{', '.join(KINDS)})")
    return StructuredOutputs(**{k: v for k, v in value.items() if v is not None}, field=field)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one prompt, in vLLM's naming; validated when built.

    temperature: 0 = greedy (the default here, unlike vLLM's 1.0).
    top_p: nucleus mass in (0, 1]; top_k: 0 = off.
    max_tokens: new tokens at most (the prompt not counted).
    stop: strings that end the output; the text is cut before the first one
        to complete. The engine stops on token ids, so these are applied to the
        finished output: generation still runs to EOS or max_tokens.
    seed: the noise key of sampled rows (a uint32). Sample j of n gets seed + j.
        None draws a fresh seed per call; a seeded request gives the same tokens
        whatever else is in its batch.
    n: outputs per prompt.
    ignore_eos: do not stop at the model's EOS tokens.
    logprobs / prompt_logprobs: None = off; N = each generated / prompt token's log-probability
        under the target's raw distribution, with the N likeliest tokens at its position
        (`CompletionOutput.logprobs`, `RequestOutput.prompt_logprobs`; jaxspec/engine/scoring.py).
    presence_penalty / frequency_penalty: OpenAI's, over the output so far: a token's logit
        loses presence_penalty once it has appeared and frequency_penalty per appearance.
    repetition_penalty: vLLM's (and HF's) multiplicative one over prompt + output: a seen
        token's logit is divided by it when positive, multiplied by it when not. 1 = off.
    logit_bias: {token id: bias in [-100, 100]} added to the logits (before the penalties).
    min_tokens: no stop token (EOS, stop_token_ids) may end the output before this many tokens,
        and no stop string is looked for before the min_tokens-th token (vLLM's rule).
    stop_token_ids: token ids that end the output besides the model's EOS (kept in the output).
    All of them apply at every position, drafts included: `jaxspec/speculative/penalties.py`.
    structured_outputs: a StructuredOutputs (or a dict of its fields): the output follows a JSON
        schema, a regex, a choice or a grammar, under speculation too (`jaxspec/speculative/grammar.py`).

    A bad value raises SamplingError (a ValueError) naming the field, with the
    messages the CLI and the server give. Strings and lists for `stop` are
    stored as a tuple; integer temperatures as floats.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self):
        # Frozen: normalised values go in through object.__setattr__, once, here.
        for f in ("temperature", "top_p", "top_k", "max_tokens", "n", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "min_tokens"):
            object.__setattr__(self, f, check_value(f, getattr(self, f)))
        for f in ("seed", "prompt_logprobs", "logprobs"):
            if getattr(self, f) is not None:
                object.__setattr__(self, f, check_value(f, getattr(self, f)))
        object.__setattr__(self, "stop", check_stop(self.stop))
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        object.__setattr__(self, "stop_token_ids", check_token_ids(self.stop_token_ids))
        check_bool("ignore_eos", self.ignore_eos)
        object.__setattr__(self, "structured_outputs", check_structured(self.structured_outputs))
        if self.min_tokens > self.max_tokens:
            raise SamplingError("min_tokens", f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                                              f"got {self.min_tokens}")

    def stop_ids(self, eos: Sequence[int]) -> tuple[int, ...]:
        """The token ids that end this request's output: the model's `eos` (unless ignore_eos)
        and stop_token_ids. The one rule every front end uses."""
        return tuple(dict.fromkeys((() if self.ignore_eos else tuple(eos)) + self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """Temperature 0: every sample is the same, and seeds do not matter."""
        return self.temperature == 0

    def replace(self, **changes: Any) -> "SamplingParams":
        """A copy with `changes` applied (and validated)."""
        return dataclasses.replace(self, **changes)


def sampling_list(sampling: "SamplingParams | Sequence[SamplingParams] | None", count: int,
                  default: SamplingParams | None = None) -> list[SamplingParams]:
    """One SamplingParams per prompt: `sampling` repeated, or its list when it has one per prompt."""
    if sampling is None:
        return [default or SamplingParams()] * count
    if isinstance(sampling, SamplingParams):
        return [sampling] * count
    if not isinstance(sampling, (list, tuple)) or not all(isinstance(s, SamplingParams) for s in sampling):
        raise SamplingError("sampling", "sampling must be a SamplingParams or a list of them, got "
                                        f"{type(sampling).__name__}")
    if len(sampling) != count:
        raise SamplingError("sampling", f"sampling has {len(sampling)} entries for {count} prompts")
    return list(sampling)
