"""The starlette app: every route of VLLM_API.md, plus the stub's fault route.

Dev routes (sleep, pause, cache, collective_rpc, weights) exist only with
``VLLM_SERVER_DEV_MODE=1``; otherwise they answer 404 like any unknown path.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stubs.vllm_stub.engine import Engine, EngineError, log
from stubs.vllm_stub.openai import parse_chat, parse_completion, render, stream

__all__ = ["AppConfig", "build_app"]

VERSION = "0.33.0"
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}


@dataclass(frozen=True)
class AppConfig:
    """What the routes need to know about the server."""

    served_model_name: str
    model: str
    max_model_len: int
    dev_mode: bool


def error(message: str, status: int) -> JSONResponse:
    """vLLM's error body: ``{"error": {"message", "type", "param": null, "code"}}``."""
    body = {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "InternalServerError"),
            "param": None,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status)


Handler = Callable[[Request], Awaitable[Response]]


def _guard(fn: Handler) -> Handler:
    async def wrapped(request: Request) -> Response:
        try:
            return await fn(request)
        except EngineError as e:
            return error(str(e), e.status)

    return wrapped


async def _json(request: Request, required: bool = True) -> Any:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise EngineError("Expecting value: the request body must be JSON", 400)
        return {}
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise EngineError(f"JSON decode error: {e}", 400) from e


def _choice(request: Request, name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = request.query_params.get(name, default)
    if value not in allowed:
        raise EngineError(f"Invalid {name} {value!r}: expected one of {list(allowed)}", 400)
    return value


def build_app(engine: Engine, cfg: AppConfig) -> Starlette:
    """The ASGI app serving ``engine``."""
    created = int(time.time())

    async def health(request: Request) -> Response:
        return Response(status_code=503 if engine.dead else 200)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def models(request: Request) -> Response:
        card = {
            "id": cfg.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": cfg.model,
            "parent": None,
            "max_model_len": cfg.max_model_len,
            "permission": [],
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics(request: Request) -> Response:
        labels = f'engine="0",model_name="{cfg.served_model_name}"'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(engine.running())}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {float(engine.waiting())}",
            "# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is "
            "sleeping; weights_offloaded = 1 means sleep level 1; discard_all = 1 means "
            "sleep level 2.",
            "# TYPE vllm:engine_sleep_state gauge",
        ]
        for state in ("awake", "weights_offloaded", "discard_all"):
            value = 1.0 if engine.sleep_state == state else 0.0
            lines.append(f'vllm:engine_sleep_state{{{labels},sleep_state="{state}"}} {value}')
        lines += [
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {float(engine.prompt_tokens)}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {float(engine.generated_tokens)}",
        ]
        return PlainTextResponse(
            "\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def generate(request: Request, chat: bool) -> Response:
        body = await _json(request)
        parse = parse_chat if chat else parse_completion
        job = parse(body, cfg.served_model_name, cfg.max_model_len)
        engine.admit()
        if job.stream:
            return StreamingResponse(stream(job, engine), media_type="text/event-stream")
        try:
            async with engine.steps(job.req) as steps:
                async for _ in steps:
                    pass
        except EngineError:
            raise
        except Exception as e:  # the engine core died
            raise EngineError(str(e)) from e
        return JSONResponse(render(job))

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat(request: Request) -> Response:
        return await generate(request, chat=True)

    # -- dev routes ----------------------------------------------------------------

    async def sleep(request: Request) -> Response:
        raw = request.query_params.get("level", "1")
        if raw not in ("0", "1", "2"):
            raise EngineError(f"Invalid sleep level {raw!r}: expected 0, 1 or 2", 400)
        mode = _choice(request, "mode", "abort", ("abort", "wait", "keep"))
        await engine.sleep(int(raw), mode)
        return JSONResponse({"status": "sleeping", "level": int(raw)})

    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        for tag in tags or ():
            if tag not in ("weights", "kv_cache"):
                raise EngineError(f"Invalid tag {tag!r}: expected weights or kv_cache", 400)
        await engine.wake(tags)
        return JSONResponse({"status": "sleeping" if engine.sleeping else "awake", "tags": tags})

    async def is_sleeping(request: Request) -> Response:
        return JSONResponse({"is_sleeping": engine.sleeping or engine.paused is not None})

    async def pause(request: Request) -> Response:
        await engine.pause(_choice(request, "mode", "abort", ("abort", "wait", "keep")))
        return JSONResponse({"status": "paused"})

    async def resume(request: Request) -> Response:
        await engine.resume()
        return JSONResponse({"status": "resumed"})

    async def is_paused(request: Request) -> Response:
        return JSONResponse({"is_paused": engine.sleeping or engine.paused is not None})

    async def reset_prefix_cache(request: Request) -> Response:
        log("prefix cache reset")
        return JSONResponse({"success": True})

    async def collective_rpc(request: Request) -> Response:
        body = await _json(request)
        if not isinstance(body, dict) or not isinstance(body.get("method"), str):
            raise EngineError("Field required: method", 400)
        args, kwargs = body.get("args") or [], body.get("kwargs") or {}
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise EngineError("args must be a list and kwargs an object", 400)
        results = await engine.collective_rpc(body["method"], args, kwargs)
        return JSONResponse({"results": results})

    async def update_weight_version(request: Request) -> Response:
        body = await _json(request)
        version = body.get("new_version") if isinstance(body, dict) else None
        if not isinstance(version, str):
            raise EngineError("Field required: new_version (a string)", 400)
        engine.set_weight_version(version)
        return JSONResponse({"success": True, "new_version": version})

    async def weight_info(request: Request) -> Response:
        return JSONResponse({"weight_version": engine.weight_version})

    async def start_weight_update(request: Request) -> Response:
        engine.start_weight_update()
        return JSONResponse({"message": "Weight update started"})

    async def finish_weight_update(request: Request) -> Response:
        body = await _json(request, required=False)
        version = body.get("weight_version") if isinstance(body, dict) else None
        if version is not None and not isinstance(version, str):
            raise EngineError("weight_version must be a string", 400)
        engine.finish_weight_update(version)
        return JSONResponse({"message": "Weight update finished"})

    async def fault(request: Request) -> Response:
        body = await _json(request)
        if not isinstance(body, dict):
            raise EngineError("expected a JSON object", 400)
        if "hang_requests" in body:
            engine.hang_requests = bool(body["hang_requests"])
            engine._notify()
        if "fail_reload" in body:
            engine.fail_reload = bool(body["fail_reload"])
        log(f"fault {json.dumps(body, sort_keys=True)}")
        if body.get("crash"):
            engine.core.kill()
        return JSONResponse(
            {"hang_requests": engine.hang_requests, "fail_reload": engine.fail_reload}
        )

    routes = [
        Route("/health", _guard(health), methods=["GET"]),
        Route("/version", _guard(version), methods=["GET"]),
        Route("/v1/models", _guard(models), methods=["GET"]),
        Route("/metrics", _guard(metrics), methods=["GET"]),
        Route("/v1/completions", _guard(completions), methods=["POST"]),
        Route("/v1/chat/completions", _guard(chat), methods=["POST"]),
        Route("/_stub/fault", _guard(fault), methods=["POST"]),
    ]
    if cfg.dev_mode:
        routes += [
            Route("/sleep", _guard(sleep), methods=["POST"]),
            Route("/wake_up", _guard(wake_up), methods=["POST"]),
            Route("/is_sleeping", _guard(is_sleeping), methods=["GET"]),
            Route("/pause", _guard(pause), methods=["POST"]),
            Route("/resume", _guard(resume), methods=["POST"]),
            Route("/is_paused", _guard(is_paused), methods=["GET"]),
            Route("/reset_prefix_cache", _guard(reset_prefix_cache), methods=["POST"]),
            Route("/collective_rpc", _guard(collective_rpc), methods=["POST"]),
            Route("/update_weight_version", _guard(update_weight_version), methods=["POST"]),
            Route("/weight_info", _guard(weight_info), methods=["GET"]),
            Route("/start_weight_update", _guard(start_weight_update), methods=["POST"]),
            Route("/finish_weight_update", _guard(finish_weight_update), methods=["POST"]),
        ]

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    return app


def dev_mode_from_env() -> bool:
    return os.environ.get("VLLM_SERVER_DEV_MODE", "0") == "1"


class AccessLog:
    """ASGI middleware: one stderr line per HTTP request (method, path, status, time)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        status = 0

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            query = scope.get("query_string", b"").decode()
            path = scope["path"] + (f"?{query}" if query else "")
            log(f"{scope['method']} {path} {status} {time.monotonic() - t0:.3f}s")
