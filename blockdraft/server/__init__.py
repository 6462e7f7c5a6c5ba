"""OpenAI-compatible HTTP server: `blockdraft serve`.

Modules, one job each:
    config.py        ServerConfig (bind address, auth, request limits) and ModelInfo
    protocol.py      pydantic models of the request bodies; unsupported OpenAI fields
    params.py        request -> prompt token ids + SamplingParams, checked against the model
    responses.py     RequestOutput -> OpenAI response / stream-chunk dicts
    async_engine.py  one thread owns the (synchronous) engine; asyncio side submits and streams
    metrics.py       Prometheus metrics (own registry)
    http.py          body reading with limits, API-key check, SSE that aborts on disconnect
    errors.py        APIError and the OpenAI error JSON
    serving.py       one request end to end (completions and chat)
    api.py           the FastAPI app and its routes
    launch.py        `blockdraft serve`: load the model, run uvicorn
"""
