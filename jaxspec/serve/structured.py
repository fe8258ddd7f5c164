"""The request fields that constrain the output, read into one `StructuredOutputs`, and the
tool-call shape of a constrained reply.

    response_format      {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}}
    structured_outputs   vLLM's object: {"json": ...} | {"regex": ...} | {"choice": [...]} | {"grammar": ...}
    guided_json / guided_regex / guided_choice / guided_grammar   vLLM's older fields
    tools + tool_choice  "required" (one or more calls to the listed functions; one with
                         parallel_tool_calls false) or a named function (its arguments): the output
                         is the JSON of the call(s), returned as tool_calls

At most one of them may constrain a request; each error names the field it came from. "auto" tool
choice needs a parser for free-form tool calls, which this server does not have: it is refused,
never silently treated as "none".
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from jaxspec.sampling_params import SamplingError, StructuredOutputs, check_structured

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _bad(param: str, message: str) -> SamplingError:
    """What every error here raises (the server's parser answers it with a 400 naming `param`)."""
    return SamplingError(param, f"{param}: {message}")


def _response_format(rf: Any) -> StructuredOutputs | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise _bad("response_format", 'must be an object with "type": "text", "json_object" or "json_schema"')
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return check_structured({"json_object": True}, "response_format")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise _bad("response_format.json_schema", 'must be an object with a "schema"')
        return check_structured({"json": js["schema"]}, "response_format.json_schema.schema")
    raise _bad("response_format.type", f'must be "text", "json_object" or "json_schema", got {json.dumps(kind)}')


def _tools(body: dict) -> tuple[StructuredOutputs | None, str | None]:
    """(the constraint, the tool-call mode: "required" or the named function) of tools + tool_choice."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise _bad("tool_choice", "needs tools")
        return None, None
    if not isinstance(tools, list) or not tools:
        raise _bad("tools", "must be a non-empty list of functions")
    schemas = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{i}]", 'must be {"type": "function", "function": {"name": ..., "parameters": ...}}')
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise _bad(f"tools[{i}].function.parameters", "must be a JSON schema (an object)")
        schemas[fn["name"]] = params
    if choice in (None, "auto"):
        raise _bad("tool_choice", 'only "required", "none" or a named function are supported: "auto" needs a '
                                  "tool-call parser, which this server does not have")
    if choice == "none":
        return None, None
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in schemas.items()]
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise _bad("parallel_tool_calls", "must be a boolean")
        calls_schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({} if parallel else {"maxItems": 1})}
        return check_structured({"json": calls_schema}, "tools"), "required"
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise _bad("tool_choice", 'must be "none", "required" or {"type": "function", "function": {"name": ...}}')
    if name not in schemas:
        raise _bad("tool_choice.function.name", f"{json.dumps(name)} is not one of the tools")
    return check_structured({"json": schemas[name]}, f"tools[{list(schemas).index(name)}].function.parameters"), name


def parse_structured(body: dict) -> tuple[StructuredOutputs | None, str | None]:
    """(the request's constraint or None, the tool-call mode or None); SamplingError naming the field."""
    found: list[tuple[str, StructuredOutputs]] = []
    if body.get("response_format") is not None:
        so = _response_format(body["response_format"])
        if so is not None:
            found.append(("response_format", so))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", check_structured(body["structured_outputs"], "structured_outputs")))
    for key, kind in GUIDED.items():
        if body.get(key) is not None:
            found.append((key, check_structured({kind: body[key]}, key)))
    so, mode = _tools(body)
    if so is not None:
        found.append(("tool_choice", so))
    if len(found) > 1:
        raise _bad(found[1][0], f"only one constraint per request; {found[0][0]} is already given")
    if mode is not None and body.get("stream"):
        raise _bad("stream", "streaming is not supported with tool_choice (tool calls are returned whole)")
    return (found[0][1] if found else None), mode


def tool_calls(text: str, mode: str) -> list[dict]:
    """The OpenAI tool_calls of a constrained reply: `mode` "required" (a JSON array of
    {"name", "parameters"}) or a function's name (the text is its arguments)."""
    def call(name: str, arguments: str) -> dict:
        return {"id": "call_" + secrets.token_hex(12), "type": "function",
                "function": {"name": name, "arguments": arguments}}

    if mode != "required":
        return [call(mode, text)]
    return [call(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
