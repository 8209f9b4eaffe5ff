"""`decodespec serve`: an OpenAI-compatible HTTP server over one engine.

Starlette routes the requests and uvicorn serves them: an ASGI stack small
enough to read whole. (FastAPI would add pydantic models of the request
bodies; their 422 errors are not OpenAI's, and the values' checks would be a
second copy of the spec's — `openai_api.py` checks the JSON types and leaves
every range to `SamplingParams`.) One `EngineLoop` runs the engine in a
thread of its own, so every client's request joins the same continuous batch.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (`stream` true:
server-sent events, `data: {chunk}` lines ending with `data: [DONE]`),
`GET /v1/models`, `GET /health`, and `GET /`, the token-probability viewer.
A client that disconnects aborts its request: its cache blocks go back at
once. Each request is logged in one line: its id, route, status, token
counts, finish reason, time to first token and tokens per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from importlib import resources

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from decodespec.spec.checks import ParameterError

from .block_manager import CacheCapacityError
from .completions_format import Responder
from .engine import Engine
from .engine_loop import EngineLoop, Stream
from .grammar import GrammarError
from .openai_api import (
    APIError,
    APIRequest,
    Kind,
    bad_param,
    cache_refusal,
    parse_request,
    refusal,
)
from .request import RequestOutput

log = logging.getLogger("decodespec.serve")

VIEWER = resources.files("decodespec.reference") / "static" / "viewer.html"


def create_app(engine: Engine, model: str) -> Starlette:
    """The ASGI application serving `engine` under the model name `model`.

    The engine's thread starts with the application (its lifespan) and stops
    with it, aborting what is unfinished.

    Example:
        >>> app = create_app(Engine(weights, tokenizer), "smollm2")  # doctest: +SKIP
        >>> uvicorn.run(app, host="127.0.0.1", port=8000)            # doctest: +SKIP
    """
    server = OpenAIServer(engine, model)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        server.start()
        try:
            yield
        finally:
            server.stop()

    routes = [
        Route("/", server.viewer, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.one_model, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
    ]
    handlers = {APIError: _api_error, HTTPException: _http_error}
    return Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)


class OpenAIServer:
    """The route handlers, over one engine loop."""

    def __init__(self, engine: Engine, model: str) -> None:
        self.engine = engine
        self.model = model
        self.created = int(time.time())
        self.loop: EngineLoop | None = None

    def start(self) -> None:
        self.loop = EngineLoop(self.engine)

    def stop(self) -> None:
        if self.loop is not None:
            self.loop.close()

    # -- simple routes

    async def viewer(self, request: Request) -> Response:
        return HTMLResponse(VIEWER.read_text(encoding="utf-8"))

    async def health(self, request: Request) -> Response:
        if self.loop is None or not self.loop.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    def _model_card(self) -> dict:
        return {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "decodespec",
            "max_model_len": self.engine.config.max_context,
        }

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def one_model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.model:
            raise APIError(
                404, f"The model `{name}` does not exist.", param="model", code="model_not_found"
            )
        return JSONResponse(self._model_card())

    # -- generation

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, kind: Kind) -> Response:
        arrival = time.perf_counter()
        route = request.url.path
        try:
            api = parse_request(
                await _json_body(request),
                kind,
                tokenizer=self.engine.tokenizer,
                model=self.model,
                vocab_size=self.engine.config.vocab_size,
                max_context=self.engine.config.max_context,
            )
            stream = await self._submit(api, arrival)
        except APIError as error:
            log.info("%s %d %s (param %s)", route, error.status, error.message, error.param)
            raise
        responder = Responder(api, self.engine.tokenizer)
        if api.stream:
            return EventStreamResponse(self._events(api, stream, responder, route))
        return await self._whole(request, api, stream, responder, route)

    async def _submit(self, api: APIRequest, arrival: float) -> Stream:
        if self.loop is None:
            raise APIError(503, "the engine is not running", type="server_error")
        try:
            options = replace(api.options, arrival=arrival)
            return await self.loop.submit(api.prompt_ids, api.params, options)
        except GrammarError as error:  # compiled by the engine when the request is added
            raise bad_param(error.param, str(error)) from None
        except ParameterError as error:  # the engine's checks (the spec's run again, num_draft)
            raise refusal(error, {}) from None
        except CacheCapacityError as error:
            raise cache_refusal(error, api.params) from None
        except (TypeError, ValueError) as error:  # anything else the engine refuses
            raise bad_param(None, str(error)) from None
        except RuntimeError as error:
            raise APIError(503, str(error), type="server_error") from None

    async def _whole(
        self, request: Request, api: APIRequest, stream: Stream, responder: Responder, route: str
    ) -> Response:
        """Wait for the whole answer, or for the client to go away (then abort)."""
        answer = asyncio.ensure_future(_drain(stream))
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not answer.done():
                answer.cancel()
                self._abort(stream)
        if not answer.done() or answer.cancelled():
            log.info("%s %s client disconnected: aborted", route, responder.id)
            return Response(status_code=499)
        output = answer.result()
        _log_output(route, responder.id, output, streamed=False)
        if output.finish_reason == "error":
            message = f"generation failed: {output.error}"
            raise APIError(500, message, type="server_error", code="generation_failed")
        return JSONResponse(responder.response(output))

    async def _events(
        self, api: APIRequest, stream: Stream, responder: Responder, route: str
    ) -> AsyncIterator[str]:
        """The SSE body; cancelled when the client disconnects (`EventStreamResponse`)."""
        try:
            first = responder.first_chunk()
            if first is not None:
                yield _sse(first)
            async for event in stream.events():
                if event.finish_reason == "error":
                    message = f"generation failed: {event.error}"
                    yield _sse(APIError(500, message, type="server_error").body())
                    break
                chunk = responder.chunk(event)
                if chunk is not None:
                    yield _sse(chunk)
            assert stream.output is not None
            if stream.output.finish_reason != "error":
                yield _sse(responder.last_chunk(stream.output))
                if api.include_usage:
                    yield _sse(responder.usage_chunk(stream.output))
            yield "data: [DONE]\n\n"
        finally:
            if stream.output is None:
                self._abort(stream)
                log.info("%s %s client disconnected: aborted", route, responder.id)
            else:
                _log_output(route, responder.id, stream.output, streamed=True)

    def _abort(self, stream: Stream) -> None:
        if self.loop is not None:
            self.loop.abort(stream.request_id)


class EventStreamResponse(StreamingResponse):
    """A server-sent event stream that stops — cancelling its body, whose `finally`
    aborts the request — the moment the client disconnects.

    Starlette's own `StreamingResponse` notices a disconnect only when a write
    fails, and uvicorn drops writes to a closed connection silently: the
    engine would generate on for nobody. This one always listens.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def stream() -> None:
                await self.stream_response(send)
                group.cancel_scope.cancel()

            group.start_soon(stream)
            await _disconnected(receive)
            group.cancel_scope.cancel()


# ---------------------------------------------------------------- helpers


async def _json_body(request: Request) -> object:
    body = await request.body()
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the request body is not valid JSON: {error}") from None


async def _drain(stream: Stream) -> RequestOutput:
    async for _ in stream.events():
        pass
    assert stream.output is not None
    return stream.output


async def _disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the client has gone away."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


def _log_output(route: str, request_id: str, output: RequestOutput, streamed: bool) -> None:
    ttft = f"{output.ttft_s * 1000:.0f} ms" if output.ttft_s is not None else "-"
    rate = f"{output.tokens_per_s:.1f}" if output.tokens_per_s else "-"
    gaps = output.inter_token_latencies_s
    itl = f"{statistics.median(gaps) * 1000:.0f} ms" if gaps else "-"
    log.info(
        "%s %s %s prompt %d (%d cached) completion %d finish %s ttft %s itl p50 %s %s tok/s",
        route,
        request_id,
        "stream" if streamed else "whole",
        output.prompt_tokens,
        output.cached_tokens,
        output.completion_tokens,
        output.finish_reason,
        ttft,
        itl,
        rate,
    )


async def _api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, APIError)
    return JSONResponse(error.body(), status_code=error.status)


async def _http_error(request: Request, error: Exception) -> Response:
    """Starlette's 404 and 405 as OpenAI error objects."""
    assert isinstance(error, HTTPException)
    body = APIError(error.status_code, f"{request.method} {request.url.path}: {error.detail}")
    return JSONResponse(body.body(), status_code=error.status_code)
