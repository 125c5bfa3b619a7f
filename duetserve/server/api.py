"""The OpenAI-compatible HTTP server (FastAPI): completions, chat completions, models, health, metrics."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from duetserve import __version__
from duetserve.engine.async_engine import EngineError, EngineFront
from duetserve.engine.engine import RequestOutput
from duetserve.sampling import ParamError, SamplingParams, check_text
from duetserve.server.metrics import ServerMetrics
from duetserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    template_messages,
)

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25
"""How often a request waiting on the engine checks whether its client went away (seconds)."""


class ModelNotFound(ParamError):
    """A request names a model this server does not serve: HTTP 404, as OpenAI and vLLM answer."""


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def unless_disconnected(request: Request, awaitable):
    """The result of ``awaitable``, run as a task while ``request.is_disconnected()`` is polled
    every ``DISCONNECT_POLL_S``.

    Raises:
        ClientGone: the client went away first. The task was cancelled and has unwound, so an
            ``EngineFront.generate`` stream it was reading has aborted its request, whether still
            queued, prefilling or decoding.
    """
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait((task,), timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.wait((task,))
                if not task.cancelled():  # it finished meanwhile: nobody reads its outcome
                    task.exception()
                raise ClientGone
    finally:
        task.cancel()  # the handler itself was cancelled (a no-op once the task is done)


def error_response(status: int, message: str, param: str | None = None, err_type: str | None = None) -> JSONResponse:
    """An OpenAI-style error body ``{"error": {"message", "type", "param", "code"}}``."""
    kinds = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
             500: "InternalServerError"}
    body = {"error": {"message": message, "type": err_type or kinds.get(status, "Error"), "param": param,
                      "code": status}}
    return JSONResponse(body, status_code=status)


def _sse(payload: dict | str) -> str:
    """One server-sent event; a dict as compact JSON, written by orjson (non-ASCII text as UTF-8,
    not as ``\\u`` escapes), or by json where orjson refuses a string that is not valid Unicode (a
    model name from an undecodable path, an error message): json escapes it, the stream goes on.
    Serving 128 streams on a CPU, a chunk cost the event loop about 60 us with json and asyncio +
    h11, which the engine thread waits for on the GIL (docs/benchmarks.md, twenty-eighth session)."""
    if isinstance(payload, str):
        return f"data: {payload}\n\n"
    try:
        body = orjson.dumps(payload).decode()
    except orjson.JSONEncodeError:
        body = json.dumps(payload, separators=(",", ":"))
    return f"data: {body}\n\n"


def create_app(engine: EngineFront, metrics: ServerMetrics, model_name: str, api_key: str | None = None,
               default_max_tokens: int = 16, on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    """Build the FastAPI app around a started ``EngineFront`` (``AsyncEngine`` or ``EngineProcess``).

    Every bad request gets HTTP 400 with an OpenAI error body; a missing or wrong Bearer key
    (when ``api_key`` is set) gets 401 on ``/v1/*``. ``on_shutdown`` runs at the app's (ASGI
    lifespan) shutdown: uvicorn runs that on SIGINT or SIGTERM and then raises the signal again,
    which ends the process before code after ``uvicorn.Server.run`` could run.
    """
    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        if on_shutdown is not None:
            on_shutdown()

    app = FastAPI(title="duetserve", lifespan=lifespan)
    tokenizer = engine.tokenizer

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return error_response(400, f"request body is not valid JSON: {message}")
        if not loc and first.get("type") == "missing":  # FastAPI's reading of a body of zero bytes
            return error_response(400, "the request body is empty: expected a JSON object")
        if not loc and first.get("type") in ("model_attributes_type", "dict_type"):  # e.g. a text/plain body
            # FastAPI parses no body without a Content-Type as JSON (its strict_content_type, against CSRF)
            content_type = request.headers.get("content-type", "")
            sent = f"as {content_type.split(';')[0]}" if content_type else "without a Content-Type"
            hint = "" if "json" in content_type else f" (it was sent {sent}: send it with Content-Type: application/json)"
            return error_response(400, f"the request body must be a JSON object{hint}")
        return error_response(400, f"{message}{' (' + '.'.join(loc) + ')' if loc else ''}",
                              loc[0] if loc else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        cause = exc.__cause__  # FastAPI's "There was an error parsing the body" wraps the reason
        if isinstance(cause, UnicodeDecodeError):
            return error_response(400, f"request body is not valid JSON: it is not UTF-8 text ({cause.reason} at "
                                       f"byte {cause.start})")
        if isinstance(cause, RecursionError):
            return error_response(400, "request body is not valid JSON: nested too deeply")
        if isinstance(cause, ValueError) and "integer string conversion" in str(cause):  # CPython's digit limit
            return error_response(400, f"request body holds an integer of more than {sys.get_int_max_str_digits()} "
                                       "digits")
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(ParamError)
    async def _param(_: Request, exc: ParamError):
        return error_response(404 if isinstance(exc, ModelNotFound) else 400, str(exc), exc.param)

    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ModelNotFound(f"the model `{name}` does not exist; this server serves `{model_name}`", "model")

    # A token is at most this many characters, so a longer text cannot fit the context.
    max_chars = engine.max_model_len * max((len(t) for t in tokenizer.get_vocab()), default=1) \
        if tokenizer is not None else 0

    async def tokenize(text: str | int, param: str, encode) -> list[int]:
        """Run ``encode`` in a worker thread (a long text must not stall other streams).

        Raises:
            ParamError: the text is longer than any prompt that fits the context, or the
                tokenizer rejects it (e.g. lone surrogates, chat-template errors).
        """
        length = text if isinstance(text, int) else len(text)
        if length > max_chars:
            raise ParamError(f"{param}: {length} characters, more than the {engine.max_model_len}-token "
                             "context can hold", param)
        try:
            return await run_in_threadpool(encode)
        except Exception as exc:  # tokenizer and template errors are the client's input
            raise ParamError(f"cannot tokenize the {param}: {type(exc).__name__}", param) from exc

    async def chat_prompt_ids(messages: list[ChatMessage], add_generation_prompt: bool = True,
                              add_special_tokens: bool = False) -> list[int]:
        """Token ids of chat ``messages`` as the tokenizer's chat template renders them: the text,
        then its tokens without the tokenizer's special tokens, as transformers'
        ``apply_chat_template(tokenize=True)`` does (``add_special_tokens`` adds them: vLLM's
        ``/tokenize`` option). The tokenizer must exist.

        Raises:
            ParamError: no messages, text that is not valid Unicode or too long for the context, or a
                template or tokenizer error.
        """
        plain = template_messages(messages)
        for m in plain:
            check_text(m["content"], "messages")
        text = await tokenize(sum(len(m["content"]) for m in plain), "messages", lambda: tokenizer.apply_chat_template(
            plain, add_generation_prompt=add_generation_prompt, tokenize=False))
        return await tokenize(text, "messages", lambda: tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def need_tokenizer(param: str, hint: str = ": send the prompt as token ids") -> None:
        if tokenizer is None:
            raise ParamError(f"this model has no tokenizer{hint}", param)

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with either
    async def health():
        if not engine.is_alive:
            return error_response(500, "engine loop is not running")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        # vLLM's card: root is the model the name serves (--served-model-name may rename it)
        return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "duetserve",
                "root": engine.model_name, "parent": None, "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            return error_response(404, f"the model `{model_id}` does not exist; this server serves `{model_name}`",
                                  "model")
        return model_card()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize_endpoint(body: TokenizeRequest):
        """Token ids of a prompt, or of chat messages as ``/v1/chat/completions`` renders them
        (vLLM's ``/tokenize``): ``{"count", "max_model_len", "tokens", "token_strs"}``."""
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ParamError("send exactly one of prompt and messages", "prompt")
        param = "prompt" if body.messages is None else "messages"
        need_tokenizer(param, "")
        if body.messages is None:
            check_text(body.prompt, "prompt")
            ids = await tokenize(body.prompt, "prompt", lambda: tokenizer.encode(
                body.prompt, add_special_tokens=body.add_special_tokens is not False))
        else:
            ids = await chat_prompt_ids(body.messages, body.add_generation_prompt, bool(body.add_special_tokens))
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        """The text of token ids (vLLM's ``/detokenize``): ``{"prompt"}``."""
        check_model(body.model)
        need_tokenizer("tokens", "")
        vocab = engine.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ParamError(f"token ids must be in [0, {vocab})", "tokens")
        return {"prompt": await run_in_threadpool(tokenizer.decode, body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        params = body.sampling_params(default_max_tokens)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ParamError("send one prompt per request", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            need_tokenizer("prompt")
            check_text(prompt, "prompt")
            prompt_ids = await tokenize(prompt, "prompt", lambda: tokenizer.encode(prompt))
        else:
            prompt_ids = list(prompt)
        try:
            return await _respond(request, body, prompt_ids, params, chat=False)
        except ParamError as exc:  # say where a max_tokens the client never sent came from
            if exc.param == "max_tokens" and body.max_tokens is None:
                default = f"max_tokens={params.max_tokens}"
                message = str(exc).replace(default, f"{default} (the default for /v1/completions)", 1)
                raise ParamError(message, "max_tokens") from exc
            raise

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        try:
            return await _chat(body, request)
        except ParamError as exc:  # name the field the client sent (sampling and context-length checks)
            if exc.param == "max_tokens" and body.max_completion_tokens is not None:
                raise ParamError(str(exc).replace("max_tokens", "max_completion_tokens"),
                                 "max_completion_tokens") from exc
            raise

    async def _chat(body: ChatCompletionRequest, request: Request):
        params = body.sampling_params(default_max_tokens=_room(engine, 0))
        need_tokenizer("messages")
        prompt_ids = await chat_prompt_ids(body.messages)
        if body.max_tokens is None:
            params.max_tokens = _room(engine, len(prompt_ids))
        return await _respond(request, body, prompt_ids, params, chat=True)

    async def _respond(request: Request, body, prompt_ids: list[int], params: SamplingParams, chat: bool):
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:  # a ParamError is HTTP 400, before any byte is sent
            engine.check_request(prompt_ids, params)
        except ParamError as exc:
            if chat and exc.param == "prompt":  # a chat request's prompt is its messages
                exc.param = "messages"
            raise
        stream = engine.generate(request_id, prompt_ids, params)
        created = int(time.time())
        if body.stream:  # the headers go out now, as OpenAI's and vLLM's do, not after the prefill
            return StreamingResponse(_stream_chunks(request, request_id, created, len(prompt_ids), stream, chat,
                                                    body.include_usage, body.continuous_usage), media_type="text/event-stream")
        try:  # a client leaving while its request is queued or prefilling aborts it
            first = await unless_disconnected(request, anext(stream))
        except EngineError as exc:
            return error_response(500, str(exc))
        except ClientGone:
            await stream.aclose()  # aborts the request if its first output came as the client left
            return Response(status_code=499)
        return await _full_response(request, request_id, created, first, stream, chat)

    def _choice(chat: bool, text: str, out: RequestOutput, delta: bool) -> dict:
        """A choice of ``text`` with ``out``'s finish (None while running) and vLLM's ``stop_reason``."""
        finish = {"finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
        if not chat:
            return {"index": 0, "text": text, "logprobs": None, **finish}
        key = "delta" if delta else "message"
        msg = {"content": text} if delta else {"role": "assistant", "content": text}
        return {"index": 0, key: msg, "logprobs": None, **finish}

    def _usage(out: RequestOutput, completion_tokens: int | None = None) -> dict:
        """OpenAI's usage object for ``out`` (``completion_tokens``: instead of ``out``'s count)."""
        done = out.num_output_tokens if completion_tokens is None else completion_tokens
        return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": done,
                "total_tokens": out.num_prompt_tokens + done}

    async def _stream_chunks(request: Request, request_id: str, created: int, prompt_tokens: int,
                             stream: AsyncIterator, chat: bool, include_usage: bool,
                             continuous_usage: bool) -> AsyncIterator[str]:
        """The SSE events of a streamed response of a ``prompt_tokens``-token prompt; the first
        output is awaited here (the headers are sent already), and a client leaving before it
        aborts the request."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": request_id, "object": obj, "created": created, "model": model_name}
        # with include_usage every chunk has a usage field, null but in the last (OpenAI's stream_options);
        # with continuous_usage_stats too, each carries the usage so far (vLLM's)
        chunk = {**head, "usage": None} if include_usage else head
        last = None
        try:
            if chat:  # the role first, before the prefill ends (as vLLM sends it)
                role = {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                              "logprobs": None, "finish_reason": None, "stop_reason": None}]}
                if continuous_usage:
                    role["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": 0,
                                     "total_tokens": prompt_tokens}
                yield _sse(role)
            try:
                out = last = await unless_disconnected(request, anext(stream))
            except ClientGone:
                await stream.aclose()  # aborts the request if its first output came as the client left
                return
            while True:
                # A completions client sees only text: no chunk for tokens whose text is held back
                # (a possible stop string, an unfinished UTF-8 character)
                if (out.new_token_ids if chat else out.new_text) or out.finished:
                    piece = {**chunk, "choices": [_choice(chat, out.new_text, out, True)]}
                    if continuous_usage:
                        piece["usage"] = _usage(out)
                    yield _sse(piece)
                last = out
                if out.finished:
                    break
                out = await anext(stream)
            if include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(last)})
            yield _sse("[DONE]")
        except EngineError as exc:  # then [DONE], as vLLM ends a stream that failed
            yield _sse({"error": {"message": str(exc), "type": "InternalServerError", "param": None, "code": 500}})
            yield _sse("[DONE]")
        finally:
            if last is None or not last.finished:  # client went away: no await here, the task may be cancelled
                engine.abort(request_id)

    async def _full_response(request: Request, request_id: str, created: int, first: RequestOutput,
                             stream: AsyncIterator, chat: bool):
        async def collect() -> tuple[list[str], RequestOutput]:
            text, out = [first.new_text], first
            while not out.finished:
                out = await anext(stream)
                text.append(out.new_text)
            return text, out

        try:
            text, out = await unless_disconnected(request, collect())
        except EngineError as exc:
            return error_response(500, str(exc))
        except ClientGone:
            await stream.aclose()  # aborts the request unless it finished as the client left
            return Response(status_code=499)
        body = {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "choices": [_choice(chat, "".join(text), out, False)],
                "usage": _usage(out)}
        return body

    return app


class BearerAuth:
    """ASGI middleware: ``/v1/*`` requests need ``Authorization: Bearer <api_key>`` (else 401).

    A plain ASGI wrapper (not Starlette's ``BaseHTTPMiddleware``) so handlers still see a
    client's disconnect; it answers before the body is read.
    """

    def __init__(self, app, api_key: str):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            headers = dict(scope.get("headers") or [])
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or token.strip() != self.api_key:
                response = error_response(401, "invalid or missing API key (Authorization: Bearer ...)")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _room(engine: EngineFront, prompt_len: int) -> int:
    """Default ``max_tokens`` for chat: the context left after the prompt (vLLM's behaviour), at
    least 1. The engine's ``max_model_len`` is already capped to what the KV cache holds, so a
    chat without ``max_tokens`` is not refused for a length the client never asked for."""
    return max(1, engine.max_model_len - prompt_len)
