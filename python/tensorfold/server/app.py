"""The FastAPI app: OpenAI-compatible endpoints in front of one EngineWorker."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import RequestError
from .protocol import (content_type_error, parse_detokenize, parse_json, parse_request, parse_tokenize,
                       sampling_with_defaults)
from .choices import Choice
from .tools import tool_format
from .responses import ReplyBuilder, echo_text, error_body, sse
from .tokenizing import TokenizePool
from .worker import EngineWorker, Job

log = logging.getLogger("tensorfold.server")


class _Gone(Exception):
    """The client disconnected before its request body arrived."""


_HTTP_CODES = {400: "bad_request", 401: "invalid_api_key", 403: "forbidden", 404: "not_found",
               405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large", 415: "unsupported_media_type",
               422: "invalid_value"}


def max_body_default(context_length: int) -> int:
    """The largest request body read: 16 MiB, or 256 bytes a context token where that is more. A
    prompt that fills the context as text or as token ids is far smaller; a larger body is refused
    (413) before it is read, not tokenized on the engine's thread first. At most 1 GiB (a 4M-token
    context's 256 bytes a token)."""
    return min(max(16 << 20, 256 * int(context_length)), 1 << 30)


class _CutAtShutdown:
    """A reply still being sent when uvicorn's shutdown grace ran out (a stream whose client reads
    slowly, after the engine finished it) is cancelled by uvicorn: logged here in one line, where
    the cancellation had reached uvicorn as "Exception in ASGI application" with a traceback."""

    def __init__(self, app, worker):
        self.app, self.worker = app, worker

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if scope.get("type") != "http" or not self.worker.closing:
                raise
            log.warning("shutdown: a reply to %s still being sent was cut off (its client had not read it "
                        "within the grace period)", scope.get("path"))


def create_app(engine, *, model_name: str | None = None, api_key: str | None = None,
               defaults: dict | None = None, aliases=(), max_body: int | None = None,
               body_timeout: float = 60.0) -> FastAPI:
    """Build the app around `engine`: an Engine, an `EngineWorker`, or a zero-argument factory that builds
    the Engine (it then runs on the worker thread, which MLX needs: its streams belong to one thread).

    defaults: server-wide request defaults - temperature/top_p/top_k/min_p (override the engine's
    generation_defaults), max_tokens (used when a request gives none) and thinking (enable_thinking used
    when a request gives none). max_body: the largest request body in bytes (default
    max_body_default(context)); body_timeout: seconds a request body may take to arrive (408
    after). The app stops the worker on shutdown."""
    worker = engine if isinstance(engine, EngineWorker) else EngineWorker(engine)
    eng = worker.wait_ready()
    name = model_name or eng.model_name
    accepted = {name, eng.model_name, str(eng.model_path), *aliases}
    ctx = int(eng.context_length)
    opts = dict(getattr(eng, "generation_defaults", None) or {})
    opts.update({k: v for k, v in (defaults or {}).items() if v is not None})
    tags = getattr(getattr(eng, "tokenizer", None), "think_tags", None)
    limit = max_body or max_body_default(ctx)
    created = int(time.time())
    tokenize = TokenizePool()

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)
        disk = getattr(worker.engine, "disk", None)
        if disk is not None:        # snapshots still queued for the writer: on disk before exit
            await asyncio.to_thread(disk.flush, 60)       # (SIGTERM skips atexit)

    app = FastAPI(title="TensorFold", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.worker = worker
    app.state.model_name = name
    app.add_middleware(_CutAtShutdown, worker=worker)

    # -- errors: always {"error": {...}}, never FastAPI's shapes or a traceback ---------------------
    @app.exception_handler(RequestError)
    async def _request_error(_req, e: RequestError):
        return JSONResponse(e.to_dict(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req, e: RequestValidationError):
        errs = e.errors()
        loc = ".".join(str(x) for x in errs[0].get("loc", ())[1:]) if errs else None
        msg = errs[0].get("msg", "invalid request") if errs else "invalid request"
        return JSONResponse(error_body(f"Invalid request: {msg}", param=loc or None, code="invalid_value"),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), code=_HTTP_CODES.get(e.status_code)),
                            status_code=e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(_Gone)
    async def _gone(_req, _e):
        return Response(status_code=499)        # the client left while sending its body

    @app.exception_handler(Exception)
    async def _any_error(_req, e: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(f"Internal server error: {type(e).__name__}", type="server_error",
                                       code="internal_error"), status_code=500)

    # -- helpers -----------------------------------------------------------------------------------
    def check_key(request: Request) -> None:
        if not api_key:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            if given:
                msg = "Incorrect API key provided."
            elif auth:
                msg = "Malformed Authorization header: expected 'Bearer <key>'."
            else:
                msg = "Missing API key: send 'Authorization: Bearer <key>'."
            raise RequestError(msg, code="invalid_api_key", status=401)

    async def read_body(request: Request) -> bytes:
        """The body, refused with a 413 past `limit` bytes: by its Content-Length before reading,
        or while reading one sent in chunks."""
        def too_large():
            return RequestError(f"Request body is larger than this server's limit of {limit} bytes.",
                                code="request_too_large", status=413)
        bad_type = content_type_error(request.headers.get("content-type"))
        if bad_type:
            raise RequestError(bad_type, code="unsupported_media_type", status=415)
        n = request.headers.get("content-length")
        if n is not None and n.strip().isdigit() and int(n) > limit:
            raise too_large()
        parts = []

        async def read():
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large()
                parts.append(chunk)
        # read while watching for a shutdown: a body still arriving when it began got a text/plain
        # 500 (uvicorn cancelled the task when its grace period ran out), not the JSON 503
        task = asyncio.ensure_future(read())
        deadline = time.monotonic() + body_timeout
        try:
            while not (await asyncio.wait({task}, timeout=min(0.1, max(0.0, deadline - time.monotonic()))))[0]:
                if worker.closing:
                    raise RequestError("The server is shutting down.", type="server_error",
                                       code="server_shutting_down", status=503)
                if time.monotonic() >= deadline:    # a client that sends its headers and stalls
                    raise RequestError(f"The request body did not arrive within {body_timeout:g} s.",
                                       code="request_timeout", status=408)
            task.result()
        except ClientDisconnect:
            raise _Gone from None
        finally:
            task.cancel()
        return b"".join(parts)

    def check_tools(tools) -> None:
        if tools and tool_format(getattr(worker.engine, "tokenizer", None)) is None:
            raise RequestError("Unsupported parameter: 'tools': this model's chat template has no tool-call "
                               "format this server parses (it parses Hermes / Qwen <tool_call> JSON).",
                               param="tools", code="unsupported_parameter")

    def check_model(model) -> None:
        if model is not None and not isinstance(model, str):
            raise RequestError("Invalid value for 'model': expected a string.", param="model", code="invalid_value")
        if isinstance(model, str) and model and model not in accepted:
            raise RequestError(f"The model '{model}' does not exist; this server serves '{name}'.",
                               param="model", code="model_not_found", status=404)

    async def tokenized(request: Request, work, size: int):
        """work() on a tokenizing thread, awaited while watching for a shutdown (a 503: /tokenize of a
        12 MB prompt had been cancelled by uvicorn's grace period, a text/plain 500 and a traceback)
        and for the client leaving."""
        fut = tokenize.submit(work, (), size)
        try:
            while not (await asyncio.wait({fut}, timeout=0.1))[0]:
                if worker.closing:
                    raise RequestError("The server is shutting down.", type="server_error",
                                       code="server_shutting_down", status=503)
                if await request.is_disconnected():
                    raise _Gone
        finally:
            fut.cancel()            # a no-op once done; else its tokenization is skipped
        return fut.result()

    async def watch(request: Request, job: Job) -> None:
        """Cancel the job (and wake its handler) when the client goes away."""
        try:
            while not job.cancel.is_set():
                if await request.is_disconnected():
                    job.cancel.set()
                    job.items.put_nowait(("gone", None))
                    return
                await asyncio.sleep(0.1)
        except asyncio.CancelledError:
            pass

    # -- endpoints ---------------------------------------------------------------------------------
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok", "model": name, "context_length": ctx,
                "busy": worker.current is not None, **worker.stats, "tokenizing": tokenize.pending}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [_model_card()]}

    @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
    async def model(model: str, request: Request):
        check_key(request)
        if not model:                           # /v1/models/
            return {"object": "list", "data": [_model_card()]}
        check_model(model)
        return _model_card()

    def _model_card() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "tensorfold",
                "context_length": ctx}

    @app.post("/tokenize")
    async def tokenize_prompt(request: Request):
        """vLLM's /tokenize: the ids a completions prompt or a chat's messages run as (the chat
        template rendered as a request renders it), counted even past the context."""
        check_key(request)
        body = await read_body(request)
        data = parse_json(body)
        check_model(data.get("model"))
        kw = parse_tokenize(data)
        check_tools(kw.get("tools"))    # as the request with these messages would be
        ids = await tokenized(request, lambda: worker.engine.tokenize(**kw), len(body))
        return {"count": len(ids), "max_model_len": ctx, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        check_key(request)
        body = await read_body(request)
        data = parse_json(body)
        check_model(data.get("model"))
        tok = worker.engine.tokenizer

        def decode():       # on a tokenizing thread: 2M ids decoded on the event loop held every stream 1.2 s
            ids = parse_detokenize(data)
            if ids and max(ids) >= tok.vocab_size:
                raise RequestError(f"token ids must be in [0, {tok.vocab_size})", param="tokens")
            return tok.decode(ids)
        return {"prompt": await tokenized(request, decode, len(body))}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completion")

    async def handle(request: Request, kind: str):
        check_key(request)
        body = await read_body(request)
        body_size = len(body)
        data = parse_json(body)
        del body
        check_model(data.get("model"))
        req = parse_request(data, kind, context_length=ctx)
        kwargs = dict(max_tokens=req.max_tokens if req.max_tokens is not None else int(opts.get("max_tokens") or ctx),
                      sampling=sampling_with_defaults(req, data, opts), stop=req.stop, draft=req.draft)
        if req.ignore_eos:
            kwargs["ignore_eos"] = True
        if req.stop_token_ids:
            kwargs["stop_token_ids"] = req.stop_token_ids
        if req.min_tokens:
            kwargs["min_tokens"] = req.min_tokens
        if req.logprobs is not None:
            kwargs["logprobs"] = req.logprobs
            if req.echo:                # the prompt's tokens scored too (engine.prompt_logprobs_of)
                kwargs["prompt_logprobs"] = req.logprobs
        if kind == "chat":
            thinking = req.enable_thinking if req.enable_thinking is not None else opts.get("thinking")
            kwargs.update(messages=req.messages, enable_thinking=thinking)
            check_tools(req.tools)
        else:
            kwargs.update(prompt=req.prompt)
        prepare = getattr(worker.engine, "prepare", None)
        if prepare is not None:
            # tokenized off the engine's thread (the tokenizer lets the GIL go): a large prompt
            # holds up neither the engine's thread nor the other requests (tokenizing.py)
            args = (kwargs.pop("messages", None), kwargs.pop("prompt", None), kwargs.pop("enable_thinking", None))
            extra = {"tools": req.tools} if req.tools else {}
            if kind == "chat" and req.template_kwargs:
                extra["template_kwargs"] = req.template_kwargs
            if not req.add_generation_prompt:
                extra["add_generation_prompt"] = False
            if req.continue_final_message:
                extra["continue_final_message"] = True
            if req.echo and req.logprobs is not None and kwargs["max_tokens"] == 0:
                extra["room"] = 0       # a prompt scored, nothing generated: it may fill the context
            kwargs["prepared"] = await tokenized(request, lambda: prepare(*args, **extra), body_size)
            if await request.is_disconnected():
                raise _Gone             # the client left while its prompt was tokenized
        elif kind == "chat" and req.template_kwargs:
            raise RequestError("chat_template_kwargs other than enable_thinking need an engine "
                               "that renders prompts itself", param="chat_template_kwargs")
        elif not req.add_generation_prompt or req.continue_final_message:
            raise RequestError("add_generation_prompt false / continue_final_message need an engine that "
                               "renders prompts itself", param="continue_final_message",
                               code="unsupported_parameter")
        elif req.tools:
            kwargs["tools"] = req.tools
        job = worker.submit(kwargs, chat=kind == "chat", n=req.n)
        watcher = asyncio.create_task(watch(request, job))
        try:
            first = await job.items.get()
        except BaseException:
            job.cancel.set()
            watcher.cancel()
            raise
        if first[0] == "error":
            watcher.cancel()
            raise first[1]
        if first[0] in ("gone", "end"):
            watcher.cancel()
            return Response(status_code=499)    # the client left before anything was generated
        prepared = kwargs.get("prepared")
        ids = prepared.ids if prepared is not None else None
        tok = getattr(worker.engine, "tokenizer", None)
        echo = echo_text(tok, req.prompt, ids) if req.echo else None
        reply = ReplyBuilder(kind, name, usage_field=req.stream and req.include_usage, tokenizer=tok, echo=echo,
                             prompt_ids=ids, skip_bos=req.echo and ids is not None and tok.added_bos(req.prompt, ids))

        def choice(i: int) -> Choice:
            return Choice(i, tags if kind == "chat" else None, job.in_think, bool(req.tools), echo, req.stream)
        if req.stream:
            return StreamingResponse(stream(job, first, reply, choice, req.include_usage, watcher),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            return await collect(job, first, reply, choice)
        finally:
            watcher.cancel()

    async def collect(job: Job, item, reply: ReplyBuilder, choice):
        """The whole reply: the job's events, choice by choice (("choice", i) starts choice i)."""
        choices = [choice(0)]
        while True:
            kind, ev = item
            if kind == "error":
                raise ev
            if kind == "choice":
                choices.append(choice(ev))
            elif kind != "event":
                break
            else:
                choices[-1].add(ev)
            item = await job.items.get()
        if kind == "gone":
            return Response(status_code=499)
        for ch in choices:
            ch.close()
            _log_done(reply.kind, ch.stats, ch.finish)
        return JSONResponse(reply.full(choices))

    async def stream(job: Job, item, reply: ReplyBuilder, choice, include_usage: bool, watcher: asyncio.Task):
        """Server-sent chunks, choice after choice, each chunk naming its choice's index; then the
        usage of them all (stream_options.include_usage) and [DONE]."""
        done, ch, stats = False, None, []
        try:
            while True:
                kind, ev = item
                if kind == "error":
                    yield sse(ev.to_dict())
                    break
                if kind == "choice" or ch is None:
                    ch = choice(ev if kind == "choice" else 0)
                    # with tools, content stays null until the reply has some, as the unstreamed
                    # message's does where it makes calls (the join of "" deltas was "")
                    tools_on, spoke = ch.tools.enabled, False
                    if reply.kind == "chat":
                        yield sse(reply.chunk(role=True, content=None if tools_on else "", index=ch.index))
                if kind == "event":
                    if not ch.started and ch.echo is not None:     # the prompt first, with its logprobs where asked
                        yield sse(reply.chunk(content=ch.echo, logprobs=ev.prompt_logprobs, index=ch.index))
                    r, c, calls, first_call = ch.add(ev)
                    if tools_on:    # content null until there is some; "" for a reply of none and no calls
                        spoke = spoke or bool(c)
                        content = c or ("" if ch.finish is not None and not spoke and not ch.calls else None)
                    else:
                        # a token whose text is held back (a stop string's start, part of a character)
                        # still has its logprobs sent with it, in a chunk of empty text
                        content = c or ("" if ev.logprobs else None)
                    if r or content is not None or ev.logprobs or calls:
                        yield sse(reply.chunk(content=content, reasoning=r or None,
                                              logprobs=ev.logprobs, tool_calls=calls, first_call=first_call,
                                              index=ch.index)
                                  if reply.kind == "chat" else
                                  reply.chunk(content=c, logprobs=ev.logprobs, index=ch.index))
                    if ch.finish is not None:
                        yield sse(reply.chunk(finish=ch.finish, stats=ch.stats, index=ch.index))
                        stats.append(ch.stats)
                        _log_done(reply.kind, ch.stats, ch.finish)
                elif kind != "choice":      # ("end", None): every choice is done
                    if include_usage and stats:
                        yield sse(reply.usage_chunk(stats))
                    break
                item = await job.items.get()
            yield sse("[DONE]")
            done = True
        finally:
            if not done:
                job.cancel.set()
            watcher.cancel()

    def _log_done(kind: str, stats, finish) -> None:
        if stats is None:
            return
        log.info("%s: %d prompt tokens (%d cached), %d generated, finish=%s, ttft %.3fs, %.1f tok/s%s",
                 kind, stats.prompt_tokens, stats.cached_tokens, stats.completion_tokens, finish,
                 stats.ttft_s, stats.decode_tps,
                 f", drafts {stats.accepted}/{stats.drafted} accepted" if stats.drafted else "")

    return app
