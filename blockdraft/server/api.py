"""The FastAPI app: routes, lifespan (engine thread start/stop) and error handlers.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id},
GET /health (503 once the engine has stopped), GET /metrics (Prometheus text), and vLLM's extras
POST /tokenize, POST /detokenize (server.tokenization), GET /version and GET / POST /ping (= /health). Only /v1/* needs
the API key when one is set (http.V1KeyCheck, unknown /v1 paths included).
"""

from __future__ import annotations

import copy
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from blockdraft.server.async_engine import AsyncEngine
from blockdraft.server.config import ModelInfo, ServerConfig
from blockdraft.server.errors import install_error_handlers, model_not_found
from blockdraft.server.http import V1KeyCheck
from blockdraft.server.metrics import Metrics
from blockdraft.server.responses import TokenText
from blockdraft.server import tokenization
from blockdraft.server.serving import ChatFormat, CompletionFormat, ServerContext, Serving


def model_info(llm, config: ServerConfig) -> ModelInfo:
    """What requests are checked against, read from a built `blockdraft.llm.LLM`."""
    kv = llm.engine.scheduler.kv
    spec = llm.speculator
    return ModelInfo(
        name=config.served_model_name,
        vocab_size=llm.target.config.vocab_size,
        max_model_len=llm.engine.max_model_len,
        kv_capacity_tokens=kv.num_blocks * kv.kv_block_size,
        num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
        created=int(time.time()),
        max_logprobs=llm.engine.max_logprobs,
        default_sampling=dict(getattr(llm, "default_sampling_params", {})),
        max_tokens_cap=max_tokens_cap(llm),
    )


def max_tokens_cap(llm) -> int | None:
    """vLLM's override_max_tokens: a --generation-config FOLDER's max_new_tokens limits every
    request's output (tokens); the model's own file ("auto") only sets the default."""
    if getattr(llm, "generation_config", "vllm") in ("auto", "vllm"):
        return None
    return getattr(llm, "default_sampling_params", {}).get("max_tokens")


def build_app(llm, config: ServerConfig) -> FastAPI:
    """The app serving `llm` (a `blockdraft.llm.LLM`; its engine is driven by the app from now on)."""
    info = model_info(llm, config)
    metrics = Metrics(info.num_speculative_tokens)
    engine = AsyncEngine(llm.engine, metrics, max_pending=config.max_pending)
    ctx = ServerContext(config, info, engine, _own_copy(llm.tokenizer), TokenText(_own_copy(llm.tokenizer)))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        metrics.on_step(llm.engine, [])  # KV gauges before the first request
        engine.start()
        yield
        await engine.shutdown()
        ctx.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="blockdraft", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    app.state.metrics = metrics
    install_error_handlers(app, metrics.on_error)
    app.add_middleware(V1KeyCheck, api_key=config.api_key, on_error=metrics.on_error)
    completions = Serving(ctx, CompletionFormat())
    chat = Serving(ctx, ChatFormat())

    @app.post("/v1/completions")
    async def create_completion(request: Request):
        return await completions.handle(request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request):
        return await chat.handle(request)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card(ctx.model)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id != ctx.model.name:
            raise model_not_found(model_id, ctx.model.name)
        return _model_card(ctx.model)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await tokenization.handle(ctx, request, detok=False)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await tokenization.handle(ctx, request, detok=True)

    @app.get("/version")
    async def version():
        from blockdraft import __version__

        return {"version": __version__}

    @app.get("/ping")  # vLLM's (SageMaker's) liveness path, GET and POST: /health's answer
    @app.post("/ping")
    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app


def _model_card(model: ModelInfo) -> dict:
    return {
        "id": model.name, "object": "model", "created": model.created, "owned_by": "blockdraft",
        "max_model_len": model.max_model_len,
    }


def _own_copy(tokenizer):
    """A tokenizer for the event-loop thread: HF fast tokenizers must not be used by two threads at once."""
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # an uncopyable tokenizer: share it (encode/decode do not mutate it)
        return tokenizer
