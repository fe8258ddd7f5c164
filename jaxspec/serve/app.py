"""FastAPI routes: OpenAI completions and chat (plain and SSE streaming), models, health, metrics.

Every error is an OpenAI-style JSON body (`protocol.APIError`); the scheduler
thread talks to request handlers through one asyncio queue per request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from jaxspec.engine.types import TokenScores
from jaxspec.serve import protocol
from jaxspec.serve.protocol import APIError
from jaxspec.serve.server import Server

log = logging.getLogger("jaxspec.serve")
_DISCONNECT_POLL_S = 0.5
# uvicorn waits for a body without limit: a client that sends less than its
# Content-Length would hold the request (and its connection) forever.
BODY_READ_TIMEOUT_S = 30.0


def _error(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    if e.status == 408:  # the rest of that body may still arrive: it must not be read as a next request
        headers["Connection"] = "close"
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, refusing (413) anything over `limit` bytes before reading it all,
    and (408) a body not complete within `timeout_s` seconds."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, "invalid Content-Length header")
        if int(declared) > limit:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes")
                chunks.append(part)
    except TimeoutError:
        raise APIError(408, f"request body incomplete after {timeout_s:g} s ({size} bytes received"
                            + (f" of a Content-Length of {declared})" if declared else ")")) from None
    except ClientDisconnect:  # nobody will read the answer; no 500 in the log for it
        raise APIError(400, f"client disconnected after {size} bytes of the request body") from None
    return b"".join(chunks)


def _fit_default_max_tokens(parsed: protocol.ParsedRequest, cap: int, default: int,
                            param: str) -> protocol.ParsedRequest:
    """No max_tokens sent: the default, cut to what the tightest prompt leaves of a
    sequence's `cap` tokens. A prompt leaving nothing is blamed, not max_tokens."""
    for i, ids in enumerate(parsed.prompts):
        if len(ids) >= cap:
            who = "the prompt" if len(parsed.prompts) == 1 else f"prompt {i}"
            raise APIError(400, f"{param}: {who} has {len(ids)} tokens; a sequence holds at most {cap} tokens "
                                "here (context and KV cache), leaving none to generate", param)
    room = cap - max(len(ids) for ids in parsed.prompts)
    return dataclasses.replace(parsed, params=dataclasses.replace(parsed.params, max_tokens=min(default, room)))


class _Stream:
    """Events of one request's sequences (index, Event), handed over from the scheduler thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def callback(self, index: int):
        def on_event(event):
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))
            except RuntimeError:  # the event loop is gone (shutdown); nobody is listening
                pass

        return on_event


def create_app(server: Server, *, body_timeout_s: float = BODY_READ_TIMEOUT_S) -> FastAPI:
    app = FastAPI(title="jaxspec", docs_url=None, redoc_url=None, openapi_url=None)
    cfg = server.cfg.serve

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        if e.status < 500:
            server.metrics.rejected()
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        return _error(APIError(e.status_code, str(e.detail), type_="not_found_error" if e.status_code == 404
                               else "invalid_request_error"))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("internal error")
        return _error(APIError(500, f"internal error: {type(e).__name__}", type_="server_error"))

    def check_auth(request: Request) -> None:
        if not cfg.api_key:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), cfg.api_key.encode()):
            raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", type_="authentication_error")

    def check_ready() -> None:
        if not server.ready.is_set():
            raise APIError(503, "the server is still compiling; retry when /health reports ready",
                           type_="server_error")

    @app.get("/health")
    async def health():
        if server.startup_error:
            return JSONResponse({"status": "error", "error": server.startup_error}, status_code=500)
        if not server.ready.is_set():
            return JSONResponse({"status": "starting"}, status_code=503)
        return {"status": "ok", "model": server.model_name, "warmup": server.warmup}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": 0, "owned_by": "jaxspec",
            "max_model_len": server.max_context}]}

    async def handle(request: Request, kind: str):
        check_auth(request)
        body = protocol.parse_json_body(await _read_body(request, cfg.max_body_bytes, body_timeout_s))
        model = body.get("model")
        if model is not None and model != server.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {server.model_name!r}",
                           "model", type_="not_found_error")
        check_ready()
        default_max = 16 if kind == "completion" else server.cfg.sampling.max_new_tokens
        param_name = "prompt" if kind == "completion" else "messages"
        with server.scheduler.tokenizer_lock:  # shared with the scheduler thread's detokenizing
            if kind == "completion":
                parsed = protocol.parse_completion(body, server.tokenizer, server.vocab_size, default_max,
                                                   server.sampling_defaults)
            else:
                parsed = protocol.parse_chat(body, server.tokenizer, default_max, server.sampling_defaults)
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            parsed = _fit_default_max_tokens(parsed, server.scheduler.max_sequence_tokens, default_max, param_name)
        p = parsed.params
        stream = _Stream(asyncio.get_running_loop())
        base_seed = p.seed if p.seed is not None else server.random_seed()
        seqs = []
        try:
            for i, ids in enumerate(parsed.prompts):
                for j in range(p.n):
                    index = i * p.n + j
                    # One seed per (prompt, choice): identical prompts of one request sample independently,
                    # and choice j of prompt 0 keeps seed + j (the documented n-choices rule).
                    seqs.append(server.submit(ids, p, (base_seed + index) % 2**32, stream.callback(index), param_name))
        except APIError:
            for s in seqs:
                server.scheduler.cancel(s)
            raise
        prompt_tokens = sum(len(ids) for ids in parsed.prompts)  # OpenAI counts a prompt once, whatever n
        rid = protocol.new_id(kind)
        if p.stream:
            # The generator's `finally` cancels on disconnect, but a client gone before the first
            # chunk never starts it; the background task runs either way.
            return StreamingResponse(_sse(server, kind, rid, seqs, stream, prompt_tokens, (parsed.prompts, p)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(_cancel_unfinished, server, seqs))
        return await _collect(server, request, kind, rid, seqs, stream, prompt_tokens, (parsed.prompts, p))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "chat")

    return app


def _cached_tokens(seqs, n: int) -> int:
    """Prompt tokens served from the prefix cache, each prompt counted once (as its prompt_tokens
    are): its first choice's."""
    return sum(s.cached_tokens or 0 for s in seqs[::n])


def _cancel_unfinished(server: Server, seqs) -> None:
    for s in seqs:  # no-op for finished sequences; frees the pages of abandoned ones
        if s.finish_reason is None:
            server.scheduler.cancel(s)


async def _collect(server: Server, request: Request, kind: str, rid: str, seqs, stream: _Stream,
                   prompt_tokens: int, request_of):
    """The whole response; request_of: (the prompts, the GenParams) for echo and logprobs."""
    texts = [""] * len(seqs)
    ids: list[list[int]] = [[] for _ in seqs]
    lps: list[list] = [[] for _ in seqs]  # each choice's events' TokenScores, when asked
    reasons: list[str | None] = [None] * len(seqs)
    completion_tokens = 0
    last_check = time.monotonic()
    try:
        while any(r is None for r in reasons):
            try:
                index, event = await asyncio.wait_for(stream.queue.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                index, event = None, None
            # On a clock, not only when idle: a live request has events more often than the poll.
            if time.monotonic() - last_check >= _DISCONNECT_POLL_S:
                last_check = time.monotonic()
                if await request.is_disconnected():
                    return Response(status_code=499)
            if event is None:
                continue
            texts[index] += event.text
            ids[index] += list(event.token_ids)
            if event.logprobs is not None:
                lps[index].append(event.logprobs)
            completion_tokens += len(event.token_ids)
            if event.finish_reason is not None:
                reasons[index] = event.finish_reason
    finally:
        _cancel_unfinished(server, seqs)
    if "abort" in reasons:
        raise APIError(500, f"generation aborted: {server.scheduler.last_error or 'server error'}",
                       type_="server_error")
    logprobs = None
    prompts, p = request_of
    if p.echo or p.logprobs is not None:  # echo scores the prompt: a forward, off the event loop
        texts, logprobs = await asyncio.to_thread(_choice_logprobs, server, kind, prompts, p, texts, ids, lps)
    return protocol.response(kind, rid, server.model_name, list(zip(texts, reasons)), prompt_tokens,
                             completion_tokens, logprobs, _cached_tokens(seqs, p.n), tool_call=p.tool_call)


def _choice_logprobs(server: Server, kind: str, prompts: list[list[int]], p, texts: list[str],
                     ids: list[list[int]], lps: list[list]):
    """(texts, logprobs) of the choices: the prompt's text before each with echo, and each choice's
    `logprobs` when asked: its tokens' as the loop recorded them (speculative/logprobs.py), after
    the prompt's from one scoring forward with echo (engine/scoring.py); choice i * n + j is prompt i's."""
    tok = server.tokenizer
    out_texts, out_lps = list(texts), []
    for i, prompt in enumerate(prompts):
        head = (tok.decode(prompt) if tok is not None else "") if p.echo else ""
        prompt_scores = None
        if p.echo and p.logprobs is not None:
            prompt_scores = server.scorer().score(prompt, p.logprobs, p)
        for j in range(p.n):
            c = i * p.n + j
            out_texts[c] = head + texts[c]
            if p.logprobs is None:
                continue
            gen = TokenScores.concat(lps[c], p.logprobs)
            with server.scheduler.tokenizer_lock:  # shared with the scheduler thread's detokenizing
                if kind == "chat":
                    out_lps.append(protocol.chat_logprobs(tok, ids[c], gen))
                elif prompt_scores is not None:
                    out_lps.append(protocol.completion_logprobs(tok, prompt + ids[c],
                                                                TokenScores.concat([prompt_scores, gen]), first_null=True))
                else:
                    out_lps.append(protocol.completion_logprobs(tok, ids[c], gen))
    return out_texts, (out_lps or None)


async def _sse(server: Server, kind: str, rid: str, seqs, stream: _Stream, prompt_tokens: int, request_of):
    """The stream; request_of: (the prompts, the GenParams). With logprobs each chunk carries its
    tokens' (as the loop recorded them); with echo each choice opens with its prompt (and the
    prompt's logprobs, from one scoring forward)."""
    prompts, p = request_of
    logprobs = p.logprobs is not None

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def chunk_logprobs(index: int, event):
        if not logprobs or not event.token_ids:
            return None
        with server.scheduler.tokenizer_lock:
            if kind == "chat":
                return protocol.chat_logprobs(server.tokenizer, event.token_ids, event.logprobs)
            out = protocol.completion_logprobs(server.tokenizer, event.token_ids, event.logprobs, offset=offsets[index])
        offsets[index] += sum(len(t) for t in out["tokens"])
        return out

    open_choices = set(range(len(seqs)))
    offsets = [0] * len(seqs)  # completions' text_offset: the choice's token text so far
    completion_tokens = 0
    try:
        if kind == "chat":
            for i in range(len(seqs)):
                yield sse(protocol.chunk(kind, rid, server.model_name, i, "", None, first=True))
        for i, prompt in enumerate(prompts if p.echo else []):
            scores = await asyncio.to_thread(server.scorer().score, prompt, p.logprobs, p) if logprobs else None
            with server.scheduler.tokenizer_lock:
                text = server.tokenizer.decode(prompt) if server.tokenizer is not None else ""
                lp = None if scores is None else protocol.completion_logprobs(server.tokenizer, prompt, scores,
                                                                              first_null=True)
            for index in range(i * p.n, (i + 1) * p.n):
                if lp is not None:
                    offsets[index] = sum(len(t) for t in lp["tokens"])
                yield sse(protocol.chunk(kind, rid, server.model_name, index, text, None, logprobs=lp))
        while open_choices:
            index, event = await stream.queue.get()
            completion_tokens += len(event.token_ids)
            if event.finish_reason == "abort":  # an error event, then [DONE]: the client sees the stream end
                yield sse(APIError(500, f"generation aborted: {server.scheduler.last_error or 'server error'}",
                                   type_="server_error").body())
                yield "data: [DONE]\n\n"
                return
            lp = chunk_logprobs(index, event)
            if event.text or event.finish_reason is not None or lp is not None:
                yield sse(protocol.chunk(kind, rid, server.model_name, index, event.text, event.finish_reason,
                                         logprobs=lp))
            if event.finish_reason is not None:
                open_choices.discard(index)
        if p.include_usage:
            yield sse(protocol.usage_chunk(kind, rid, server.model_name, prompt_tokens, completion_tokens,
                                           _cached_tokens(seqs, p.n)))
        yield "data: [DONE]\n\n"
    finally:
        # A client that went away cancels its sequences; their pages return within one device call.
        _cancel_unfinished(server, seqs)

