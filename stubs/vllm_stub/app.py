"""The starlette app: every route of VLLM_API.md, plus the stub's fault route.

Dev routes (sleep, pause, cache, collective_rpc, weights) exist only with
``VLLM_SERVER_DEV_MODE=1``; otherwise they answer 404 like any unknown path.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stubs.vllm_stub.engine import Engine, log
from stubs.vllm_stub.errors import EngineError, invalid, rpc_failed
from stubs.vllm_stub.openai import parse_chat, parse_completion, render, stream

__all__ = ["AppConfig", "build_app"]

VERSION = "0.33.0"
PAUSE_MODES = ("abort", "wait", "keep")


@dataclass(frozen=True)
class AppConfig:
    """What the routes need to know about the server."""

    served_model_names: tuple[str, ...]
    model: str
    max_model_len: int
    dev_mode: bool


def error(e: EngineError) -> JSONResponse:
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return JSONResponse(e.body(), status_code=e.status)


Handler = Callable[[Request], Awaitable[Response]]


def _guard(fn: Handler) -> Handler:
    async def wrapped(request: Request) -> Response:
        try:
            return await fn(request)
        except EngineError as e:
            return error(e)

    return wrapped


def _decode(raw: bytes) -> Any:
    """JSON, or FastAPI's ``json_invalid`` error (``param`` ``body.<offset>``)."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise invalid(("body", e.pos), "json_invalid", "JSON decode error", {}, error=e.msg) from e
    except UnicodeDecodeError as e:
        raise invalid(("body", e.start), "json_invalid", "JSON decode error", {}) from e


async def _model_body(request: Request) -> Any:
    """The body of a route that takes a whole request model (completions, chat)."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise EngineError(
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
            400,
            etype="Bad Request",
        )
    raw = await request.body()
    if not raw:
        raise invalid(("body",), "missing", "Field required")
    return _decode(raw)


async def _embedded(request: Request) -> dict[str, Any]:
    """The body of a route whose fields are ``Body(embed=True)`` parameters."""
    raw = await request.body()
    body = _decode(raw) if raw else {}
    return body if isinstance(body, dict) else {}


def _query_int(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    loc = ("query", name)
    if not re.fullmatch(r"\s*[+-]?\d+\s*", raw):
        raise invalid(
            loc,
            "int_parsing",
            "Input should be a valid integer, unable to parse string as an integer",
            raw,
        )
    value = int(raw)
    if value < lo:
        raise invalid(
            loc, "greater_than_equal", f"Input should be greater than or equal to {lo}", raw, ge=lo
        )
    if value > hi:
        raise invalid(
            loc, "less_than_equal", f"Input should be less than or equal to {hi}", raw, le=hi
        )
    return value


def _query_mode(request: Request) -> str:
    value = request.query_params.get("mode", "abort")
    if value not in PAUSE_MODES:
        expected = "'abort', 'wait' or 'keep'"
        raise invalid(
            ("query", "mode"),
            "literal_error",
            f"Input should be {expected}",
            value,
            expected=expected,
        )
    return value


def _query_bool(request: Request, name: str, default: bool) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if raw.strip().lower() in ("1", "on", "t", "true", "y", "yes"):
        return True
    if raw.strip().lower() in ("0", "off", "f", "false", "n", "no"):
        return False
    raise invalid(
        ("query", name),
        "bool_parsing",
        "Input should be a valid boolean, unable to interpret input",
        raw,
    )


def build_app(engine: Engine, cfg: AppConfig) -> Starlette:
    """The ASGI app serving ``engine``."""
    names = cfg.served_model_names

    async def health(request: Request) -> Response:
        return Response(status_code=503 if engine.dead else 200)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def models(request: Request) -> Response:
        now = int(time.time())
        permission = {
            "id": f"modelperm-{uuid.uuid4().hex[:16]}",
            "object": "model_permission",
            "created": now,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }
        cards = [
            {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "vllm",
                "root": cfg.model,
                "parent": None,
                "max_model_len": cfg.max_model_len,
                "permission": [permission],
            }
            for name in names
        ]
        return JSONResponse({"object": "list", "data": cards})

    async def metrics(request: Request) -> Response:
        labels = f'engine="0",model_name="{names[0]}"'
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
        body = await _model_body(request)
        parse = parse_chat if chat else parse_completion
        job = parse(body, names, cfg.max_model_len, request.headers.get("x-request-id"))
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
        level = _query_int(request, "level", 1, 0, 2)
        mode = _query_mode(request)
        await engine.sleep(level, mode)
        return JSONResponse({"status": "sleeping", "level": level})

    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        awake = await engine.wake(tags)
        return JSONResponse({"status": "awake" if awake else "sleeping", "tags": tags})

    async def is_sleeping(request: Request) -> Response:
        return JSONResponse({"is_sleeping": engine.sleeping or engine.paused is not None})

    async def pause(request: Request) -> Response:
        mode = _query_mode(request)
        _query_bool(request, "clear_cache", True)
        await engine.pause(mode)
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
        # vLLM's route raises HTTPExceptions: 400 "Bad Request" with a null param
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise EngineError(f"JSON decode error: {e}", 400, etype="Bad Request") from e
        if not isinstance(body, dict):
            raise EngineError("Request body must be a JSON object", 400, etype="Bad Request")
        method = body.get("method")
        if method is None:
            raise EngineError("Missing 'method' in request body", 400, etype="Bad Request")
        args, kwargs = body.get("args", []), body.get("kwargs", {})
        if not isinstance(args, list | str | dict):  # tuple(args) in the API server
            raise EngineError(f"'{type(args).__name__}' object is not iterable", 400)
        if not isinstance(method, str):
            raise rpc_failed(f"attribute name must be string, not '{type(method).__name__}'")
        if not isinstance(kwargs, dict):
            raise rpc_failed(f"argument after ** must be a mapping, not {type(kwargs).__name__}")
        results = await engine.collective_rpc(method, list(args), kwargs)
        return JSONResponse({"results": results})

    async def update_weight_version(request: Request) -> Response:
        body = await _embedded(request)
        if "new_version" not in body:
            raise invalid(("body", "new_version"), "missing", "Field required")
        version = body["new_version"]
        if not isinstance(version, str):
            raise invalid(
                ("body", "new_version"), "string_type", "Input should be a valid string", version
            )
        engine.set_weight_version(version)
        return JSONResponse({"success": True, "new_version": version})

    async def weight_info(request: Request) -> Response:
        return JSONResponse({"weight_version": engine.weight_version})

    async def start_weight_update(request: Request) -> Response:
        engine.start_weight_update()
        return JSONResponse({"message": "Weight update started"})

    async def finish_weight_update(request: Request) -> Response:
        body = await _embedded(request)
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise invalid(
                ("body", "weight_version"), "string_type", "Input should be a valid string", version
            )
        engine.finish_weight_update(version)
        return JSONResponse({"message": "Weight update finished"})

    async def fault(request: Request) -> Response:
        body = await _embedded(request)
        if "hang_requests" in body:
            engine.hang_requests = bool(body["hang_requests"])
            engine._notify()
        if "fail_reload" in body:
            engine.fail_reload = bool(body["fail_reload"])
        for key in ("hang_sleep", "hang_wake"):
            if key in body:
                setattr(engine, key, bool(body[key]))
                engine._notify()
        for key in ("fail_sleep", "fail_wake"):
            if key in body:
                n = body[key]
                if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                    raise EngineError(f"{key} must be an integer >= 0, got {n!r}", 400)
                setattr(engine, key, n)
        if "sleep_seconds" in body:
            seconds = body["sleep_seconds"]
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
                raise EngineError(f"sleep_seconds must be a number >= 0, got {seconds!r}", 400)
            engine.sleep_seconds = float(seconds)
        log(f"fault {json.dumps(body, sort_keys=True)}")
        if body.get("crash"):
            engine.core.kill()
        return JSONResponse(
            {
                "hang_requests": engine.hang_requests,
                "fail_reload": engine.fail_reload,
                "hang_sleep": engine.hang_sleep,
                "hang_wake": engine.hang_wake,
                "sleep_seconds": engine.sleep_seconds,
                "fail_sleep": engine.fail_sleep,
                "fail_wake": engine.fail_wake,
            }
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
