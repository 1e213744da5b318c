"""The HTTP front end: `create_app(tm, server_args)` builds the FastAPI app.

The app talks only to a `TokenizerManager` (`tm`). Bad input is a 400 naming the field, a dead
backend a 503, a missing API key a 401, an oversized body a 413; never a traceback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from importlib import metadata
from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from specserve.runtime.entrypoints import native_api
from specserve.runtime.entrypoints.middleware import RequestGuard
from specserve.runtime.entrypoints.openai_api import OpenAIServing
from specserve.runtime.entrypoints.openapi import openapi_body
from specserve.runtime.entrypoints.playground import PAGE_PATHS, add_playground
from specserve.runtime.entrypoints.protocol import (
    BodyTooLarge,
    error_body,
    error_for,
    parse_model,
    read_json,
)
from specserve.runtime.entrypoints.request_bodies import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from specserve.runtime.entrypoints.streaming import ClientDisconnected, last_chunk
from specserve.runtime.errors import InvalidRequestError, ModelNotFoundError, QueueFullError
from specserve.runtime.sampling.sampling_params import SamplingParams
from specserve.runtime.tokenizer.tokenizer_manager import BackendDeadError

logger = logging.getLogger(__name__)
HEALTH_GENERATE_TIMEOUT_S = 20.0
INFO_ERRORS = (BackendDeadError, TimeoutError, asyncio.TimeoutError)  # distinct in 3.10


def _version() -> str:
    try:
        return metadata.version("specserve")
    except metadata.PackageNotFoundError:
        return "dev"


def public_server_args(server_args: Any) -> dict:
    """Server args as JSON, with the API key redacted."""
    args = dataclasses.asdict(server_args) if dataclasses.is_dataclass(server_args) \
        else dict(vars(server_args))
    if args.get("api_key"):
        args["api_key"] = "<redacted>"
    return args


def create_app(tm: Any, server_args: Any) -> FastAPI:
    # The spec and its docs page sit behind --api-key like every route but /health.
    app = FastAPI(title="specserve", version=_version(), docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")
    playground = not getattr(server_args, "disable_playground", False)
    app.add_middleware(RequestGuard, api_key=server_args.api_key,
                       max_body_bytes=server_args.max_request_bytes,
                       open_paths=PAGE_PATHS if playground else frozenset())
    openai = OpenAIServing(tm, server_args.model_path)
    limits = {"vocab_size": tm.vocab_size, "context_length": tm.context_length,
              "max_sequences_per_request": server_args.max_sequences_per_request}
    _add_error_handlers(app)
    if playground:
        add_playground(app)

    @app.get("/health")
    async def health() -> Response:
        if not tm.healthy:
            return _unavailable(tm.dead_reason or "the server is shutting down")
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """Healthy only if a one-token generation completes end to end."""
        if not tm.healthy:
            return _unavailable(tm.dead_reason or "the server is shutting down")
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        gen = tm.generate([0], params, False, f"health-{uuid.uuid4().hex}")
        try:
            await asyncio.wait_for(last_chunk(gen), HEALTH_GENERATE_TIMEOUT_S)
        except (*INFO_ERRORS, InvalidRequestError) as exc:
            return _unavailable(f"test generation failed: {exc!r}")
        return JSONResponse({"status": "ok"})

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {**tm.ready_info, "model_path": server_args.model_path,
                "tokenizer_path": server_args.model_path, "served_model_name": tm.model_name,
                "context_length": tm.context_length, "vocab_size": tm.vocab_size,
                "is_generation": True}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> dict:
        info = await tm.server_info()
        # SGLang clients read per-scheduler stats (avg_spec_accept_length) from internal_states
        return {**public_server_args(server_args), **info, "internal_states": [dict(info)],
                "version": _version()}

    async def flush_cache() -> Response:
        if await tm.flush_cache():
            return JSONResponse({"success": True, "message": "cache flushed"})
        msg = "cache not flushed: requests are running or waiting; retry when idle"
        return JSONResponse(error_body(msg, None, 400), status_code=400)

    for method in ("GET", "POST"):  # one operation id each, for the OpenAPI spec
        app.add_api_route("/flush_cache", flush_cache, methods=[method],
                          operation_id=f"flush_cache_{method.lower()}")

    @app.post("/abort_request", openapi_extra=openapi_body(AbortRequest, limits))
    async def abort_request(request: Request) -> dict:
        body = parse_model(AbortRequest, await read_json(request))
        tm.abort(body.rid)
        return {"success": True}

    @app.get("/metrics")
    async def metrics() -> Response:
        if not server_args.enable_metrics:
            msg = "metrics are disabled; start the server with --enable-metrics"
            return JSONResponse(error_body(msg, None, 404, "not_found_error"), status_code=404)
        try:
            await tm.server_info()  # refreshes the scheduler gauges
        except INFO_ERRORS as exc:
            logger.warning("metrics: scheduler gauges are stale: %r", exc)
        return Response(tm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/generate", openapi_extra=openapi_body(GenerateRequest, limits))
    async def generate(request: Request) -> Response:
        return await native_api.generate(request, tm, server_args.incremental_streaming_output)

    @app.get("/v1/models")
    async def models() -> dict:
        return openai.models()

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest, limits))
    async def completions(request: Request) -> Response:
        return await openai.completions(request)

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest, limits))
    async def chat_completions(request: Request) -> Response:
        return await openai.chat(request)

    return app


def _unavailable(message: str) -> JSONResponse:
    body = error_body(message, None, 503, "service_unavailable_error")
    return JSONResponse(body, status_code=503)


def _add_error_handlers(app: FastAPI) -> None:
    async def known(request: Request, exc: Exception) -> Response:
        status, body = error_for(exc)
        return JSONResponse(body, status_code=status)

    for kind in (InvalidRequestError, ModelNotFoundError, QueueFullError, BodyTooLarge,
                 *INFO_ERRORS):
        app.add_exception_handler(kind, known)

    @app.exception_handler(ClientDisconnected)
    async def gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = error_body(str(exc.detail), None, exc.status_code, kind)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error serving %s", request.url.path)
        return JSONResponse(error_for(exc)[1], status_code=500)
