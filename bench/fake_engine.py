"""A fake engine for gateway tests and benchmarks: the engine's HTTP surface, no model.

    python -m kvfleet.bench.fake_engine --port 8101 [--delay 0.05] [--chunks 8 --chunk-delay 0.05]

/health, /metrics (empty), /v1/models, /kv/events (an empty snapshot, then nothing),
/tokenizer (when given one), and /v1/completions answering at once or after a delay, streamed
or not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "fake"


def fake_engine(
    tokenizer_info: dict[str, Any] | None = None,
    delay_s: float = 0.0,
    stream_chunks: int = 8,
    chunk_delay_s: float = 0.05,
) -> FastAPI:
    """A stand-in engine: a completion answers " ok" after `delay_s`; a streamed one sends
    `stream_chunks` chunks `chunk_delay_s` apart, then [DONE]."""
    app = FastAPI()
    answer = {
        "id": "cmpl-fake",
        "object": "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    }

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> JSONResponse:
        return JSONResponse("")

    adapters: dict[str, str] = {}  # loaded LoRA adapters: name -> path
    app.state.adapter_loads = 0

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        cards = [{"id": MODEL, "object": "model"}]
        cards += [
            {"id": n, "object": "model", "root": p, "parent": MODEL} for n, p in adapters.items()
        ]
        return {"object": "list", "data": cards}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        body = await request.json()
        name = body["lora_name"]
        if name in adapters:
            error = {"message": f"an adapter named {name!r} is already loaded"}
            return JSONResponse({"error": error}, status_code=400)
        adapters[name] = body["lora_path"]
        app.state.adapter_loads += 1
        return JSONResponse({"message": "loaded"})

    @app.get("/kv/events")
    async def events() -> StreamingResponse:
        async def stream() -> Any:
            snapshot = json.dumps({"seq": 0, "block_size": 16, "blocks": []})
            yield f"event: snapshot\ndata: {snapshot}\n\n"
            await asyncio.Event().wait()  # then no events: nothing is cached

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await request.json()
        if body.get("model") not in (MODEL, *adapters):
            error = {"message": f"the model {body.get('model')!r} does not exist"}
            return JSONResponse({"error": error}, status_code=404)
        if body.get("stream"):
            return StreamingResponse(_chunks(), media_type="text/event-stream")
        if delay_s:
            await asyncio.sleep(delay_s)
        return answer

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = await request.json()
        if body.get("model") not in (MODEL, *adapters):
            error = {"message": f"the model {body.get('model')!r} does not exist"}
            return JSONResponse({"error": error}, status_code=404)
        message = {"role": "assistant", "content": "ok"}
        choice = {"index": 0, "message": message, "finish_reason": "length", "logprobs": None}
        return {**answer, "object": "chat.completion", "choices": [choice]}

    async def _chunks() -> AsyncIterator[str]:
        for i in range(stream_chunks):
            await asyncio.sleep(chunk_delay_s)
            choice = {"index": 0, "text": f" t{i}", "finish_reason": None, "logprobs": None}
            yield f"data: {json.dumps({'id': 'cmpl-fake', 'choices': [choice]})}\n\n"
        yield "data: [DONE]\n\n"

    @app.get("/tokenizer")
    async def tokenizer() -> JSONResponse:
        if tokenizer_info is None:
            return JSONResponse({"error": {"message": "no tokenizer"}}, status_code=404)
        return JSONResponse(tokenizer_info)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description="a fake kvfleet engine")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--chunk-delay", type=float, default=0.05)
    args = parser.parse_args()
    app = fake_engine(None, args.delay, args.chunks, args.chunk_delay)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
