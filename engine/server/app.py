"""create_app: the engine's FastAPI app — OpenAI routes, health, metrics, KV events, error bodies.

The model loads in the background after the server starts, so /health can say "loading" (503)
until it is ready, as a Kubernetes readiness probe expects.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from kvfleet.engine.config import EngineConfig
from kvfleet.engine.layers.compile_watch import WHILE_SERVING
from kvfleet.engine.llm_engine import LLMEngine
from kvfleet.engine.lora.adapter import LoRANotFoundError
from kvfleet.engine.protocol.body_work import BodyWork
from kvfleet.engine.protocol.http import (
    CLIENT_CLOSED,
    APIError,
    BodyLimitMiddleware,
    ClientGone,
    api_error_response,
    error_body,
    unless_disconnected,
)
from kvfleet.engine.protocol.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
    openapi_body,
)
from kvfleet.engine.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStepError,
    RequestFailedError,
)
from kvfleet.engine.server.chat_output import OutputParsers
from kvfleet.engine.server.metrics import EngineMetrics, EngineStats
from kvfleet.engine.server.requests import read_body, read_chat, read_completion
from kvfleet.engine.server.serving import OpenAIServing
from kvfleet.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
FATAL_GRACE_S = 2.0  # /health answers 503 this long before a failed engine's server exits
_Body = TypeVar("_Body", bound=BaseModel)


@dataclass(frozen=True)
class ServerSettings:
    engine: EngineConfig
    served_model_name: str | None = None  # defaults to the model argument
    max_body_bytes: int = MAX_BODY_BYTES
    max_waiting_requests: int = 4096  # beyond this the server answers 503 (overloaded)
    metrics_compat: str | None = None  # "vllm" adds the vllm: metric names
    shutdown_timeout_s: float = 10.0
    tool_call_parser: str = "auto"  # hermes, llama3_json, mistral; auto: from the chat template
    reasoning_parser: str | None = None  # qwen3, deepseek_r1
    # Start the process that reads large request bodies with the engine, not on first need
    # (a server process does; tests leave it to the first large body).
    prestart_body_worker: bool = False

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model


class _State:
    """What the routes share: set once the engine has loaded."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.engine: AsyncEngine | None = None
        self.serving: OpenAIServing | None = None
        self.load_error: BaseException | None = None
        self.fatal_error: str | None = None  # set when the engine died for good
        self.bodies: BodyWork[Tokenizer] | None = None  # where request bodies are read
        self.quantization: dict[str, str] | None = None  # the served weights' scheme
        self.metrics = EngineMetrics(
            settings.model_name, self.read_stats, settings.metrics_compat == "vllm"
        )

    def describe_model(self, core: LLMEngine) -> None:
        """For /v1/models and `kvfleet:model_info`: the loaded weights' dtype and scheme."""
        quantization = core.quantization
        self.quantization = quantization.labels() if quantization is not None else None
        self.metrics.describe_model(
            str(core.dtype).removeprefix("torch."),
            quantization.method if quantization is not None else "none",
        )

    def read_stats(self) -> EngineStats | None:
        """For a scrape: the engine thread's last record, never its live objects."""
        if self.engine is None:
            return None
        stats = self.engine.stats
        lora = self.engine.engine.lora
        return EngineStats(
            num_running=stats.num_running,
            num_waiting=self.engine.num_waiting,
            kv_cache_usage=stats.kv_cache_usage,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            num_preemptions=stats.num_preemptions,
            num_preemptions_swapped=stats.num_preemptions_swapped,
            lora=(
                (list(stats.running_adapters), list(stats.waiting_adapters), lora.max_loras)
                if lora is not None
                else None
            ),
            spec_decode=stats.spec_decode,
            num_step_failures=self.engine.num_step_errors,
            num_requests_isolated=self.engine.num_isolated,
            num_kernel_compiles=WHILE_SERVING.count,
        )

    def body_work(self) -> BodyWork[Tokenizer]:
        assert self.bodies is not None  # (set with the serving, which is checked first)
        return self.bodies

    def ready_serving(self) -> OpenAIServing:
        if self.serving is None or self.engine is None:
            if self.load_error is not None:
                raise APIError(
                    503, f"the model failed to load: {self.load_error}", "service_unavailable"
                )
            raise APIError(503, "the model is still loading; retry shortly", "service_unavailable")
        if not self.engine.is_running:
            raise APIError(503, "the engine loop has stopped", "service_unavailable")
        if self.engine.num_waiting >= self.settings.max_waiting_requests:
            raise APIError(
                503, "the server is overloaded; retry later", "service_unavailable", "overloaded"
            )
        return self.serving


def create_app(
    settings: ServerSettings,
    engine_factory: Callable[[EngineConfig], LLMEngine] = LLMEngine,
    on_ready: Callable[[], None] | None = None,
    on_fatal: Callable[[], None] | None = None,
) -> FastAPI:
    """`on_fatal`: how to stop serving once the engine died for good (the CLI stops its
    uvicorn server; by default the process gets SIGTERM)."""
    state = _State(settings)

    async def load() -> None:
        try:
            core = await asyncio.to_thread(engine_factory, settings.engine)
        except Exception as exc:
            logger.exception("the model failed to load")
            state.load_error = exc
            return
        engine = AsyncEngine(core, on_finished=state.metrics.observe_finished)
        WHILE_SERVING.start()  # (the engine is warm: a kernel compiled from now on stalls a step)
        state.describe_model(core)
        engine.start()
        load_tokenizer = None
        if core.tokenizer is not None:  # (the worker process for large bodies makes its own)
            load_tokenizer = functools.partial(
                Tokenizer.load, core.source, settings.engine.tokenizer
            )
        state.bodies = BodyWork(core.tokenizer, load_tokenizer, settings.prestart_body_worker)
        state.engine = engine
        state.serving = OpenAIServing(
            engine,
            settings.model_name,
            core.max_model_len,
            core.tokenizer,
            state.metrics,
            OutputParsers.configure(
                core.tokenizer, settings.tool_call_parser, settings.reasoning_parser
            ),
        )
        logger.info("ready: serving %s", settings.model_name)
        if on_ready is not None:
            on_ready()

    async def watch() -> None:
        """A dead engine (a tensor-parallel worker exited) ends the server: /health has been
        answering 503 since the loop stopped; after a grace period for probes to see it, the
        process shuts down and `kvfleet engine` exits with code 1."""
        while state.fatal_error is None:
            await asyncio.sleep(0.25)
            if state.engine is not None and not state.engine.is_running:
                state.fatal_error = state.engine.fatal_error or "the engine loop stopped"
        logger.critical("the engine failed (%s); shutting the server down", state.fatal_error)
        await asyncio.sleep(FATAL_GRACE_S)
        if on_fatal is not None:
            on_fatal()
        else:
            signal.raise_signal(signal.SIGTERM)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.create_task(load())
        watching = asyncio.create_task(watch())
        app.state.loading = loading
        yield
        watching.cancel()
        loading.cancel()
        if state.bodies is not None:
            state.bodies.close()
        if state.engine is not None:
            await state.engine.shutdown(settings.shutdown_timeout_s)

    app = FastAPI(title="kvfleet engine", lifespan=lifespan)
    app.state.kvfleet = state
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)

    _add_openai_routes(app, state)
    _add_kv_routes(app, state)
    _add_tokenizer_route(app, state)
    return app


def _add_openai_routes(app: FastAPI, state: _State) -> None:
    settings = state.settings

    app.add_exception_handler(APIError, api_error_response)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        if state.engine is not None and state.engine.is_running:
            return JSONResponse({"status": "ok"})
        status = "failed" if state.load_error is not None or state.engine is not None else "loading"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        max_len = state.serving.max_model_len if state.serving else None
        cards = [
            ModelCard(
                id=settings.model_name,
                root=settings.engine.model,
                max_model_len=max_len,
                quantization=state.quantization,
            )
        ]
        if state.engine is not None:
            cards += [
                ModelCard(id=name, root=name, parent=settings.model_name, max_model_len=max_len)
                for name in state.engine.lora_names
            ]
        return ModelList(data=cards).model_dump()

    @app.post("/v1/load_lora_adapter", openapi_extra=openapi_body(LoadLoRAAdapterRequest))
    async def load_lora_adapter(request: Request) -> JSONResponse:
        engine = _ready_engine(state)
        body = await _parse(request, LoadLoRAAdapterRequest)
        if body.lora_name == settings.model_name:
            raise APIError(400, f"{body.lora_name!r} is the base model's name")
        try:
            await engine.add_lora(body.lora_name, body.lora_path)
        except ValueError as exc:  # LoRAError: a bad folder, shapes, rank, target, a name taken
            raise APIError(400, str(exc)) from exc
        return JSONResponse({"message": f"the adapter {body.lora_name!r} is loaded"})

    @app.post("/v1/unload_lora_adapter", openapi_extra=openapi_body(UnloadLoRAAdapterRequest))
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        engine = _ready_engine(state)
        body = await _parse(request, UnloadLoRAAdapterRequest)
        try:
            running = await engine.remove_lora(body.lora_name)
        except LoRANotFoundError as exc:
            raise APIError(404, str(exc), code="model_not_found") from exc
        note = f"; its {running} running requests finish first" if running else ""
        return JSONResponse({"message": f"the adapter {body.lora_name!r} is unloaded{note}"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        arrived = time.monotonic()  # (queue time and TTFT count from here, as vLLM's do)
        serving = state.ready_serving()
        raw = await request.body()
        req, prompts = await state.body_work().run(len(raw), read_completion, raw)
        return await _run(serving, serving.prepare_completion(req, prompts), request, arrived)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        arrived = time.monotonic()
        serving = state.ready_serving()
        raw = await request.body()
        req, prompts = await state.body_work().run(len(raw), read_chat, raw)
        return await _run(serving, serving.prepare_chat(req, prompts), request, arrived)


def _add_kv_routes(app: FastAPI, state: _State) -> None:
    @app.get("/kv/snapshot")
    async def kv_snapshot() -> dict[str, Any]:
        engine = _ready_engine(state)
        snapshot, subscriber = await engine.kv_snapshot_and_subscribe()
        engine.kv_unsubscribe(subscriber)
        return snapshot.model_dump()

    @app.get("/kv/events")
    async def kv_events() -> StreamingResponse:
        """Server-sent events: first `event: snapshot` (the cached blocks), then every change."""
        engine = _ready_engine(state)
        snapshot, subscriber = await engine.kv_snapshot_and_subscribe()

        async def events() -> AsyncIterator[str]:
            try:
                yield f"event: snapshot\ndata: {snapshot.model_dump_json()}\n\n"
                while True:
                    event = await subscriber.events.get()
                    yield f"event: kv\ndata: {event.model_dump_json()}\n\n"
            finally:
                engine.kv_unsubscribe(subscriber)

        return StreamingResponse(events(), media_type="text/event-stream")


def _add_tokenizer_route(app: FastAPI, state: _State) -> None:
    @app.get("/tokenizer")
    async def tokenizer() -> dict[str, Any]:
        """The tokenizer, chat template and block size, for a gateway's exact prefix hashes."""
        engine = _ready_engine(state)
        core = engine.engine
        if core.tokenizer is None:
            raise APIError(404, "this engine has no tokenizer", code="no_tokenizer")
        return core.tokenizer.info(state.settings.model_name, core.block_size).model_dump()


def _ready_engine(state: _State) -> AsyncEngine:
    state.ready_serving()
    assert state.engine is not None
    return state.engine


async def _parse(request: Request, model: type[_Body]) -> _Body:
    raw = await request.body()
    return read_body(raw, model)  # (small bodies: the LoRA routes)


async def _run(serving: OpenAIServing, prepared: Any, request: Request, arrived: float) -> Response:
    try:
        streams = await serving.start(prepared, arrived)
    except EngineDeadError as exc:
        raise APIError(503, str(exc), "service_unavailable") from exc
    if prepared.stream:
        return StreamingResponse(
            _guard_stream(serving.sse_stream(prepared, streams)), media_type="text/event-stream"
        )
    try:
        body = await unless_disconnected(request, serving.full_response(prepared, streams))
    except EngineStepError as exc:
        raise APIError(500, str(exc), "internal_error") from exc
    except RequestFailedError as exc:  # this request's fault: the replica serves on
        raise APIError(400, str(exc), code="request_failed") from exc
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)  # aborted: nobody is there to answer
    return JSONResponse(body)


async def _guard_stream(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """An engine failure mid-stream becomes an error event, not a dropped connection."""
    try:
        async for chunk in chunks:
            yield chunk
    except EngineStepError as exc:
        yield f"data: {json.dumps(error_body(str(exc), 'internal_error'))}\n\n"
        yield "data: [DONE]\n\n"
    except RequestFailedError as exc:
        body = error_body(str(exc), "invalid_request_error", code="request_failed")
        yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
