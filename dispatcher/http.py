"""The HTTP front: an OpenAI-compatible adapter over the turn loop (starlette, served by
the lean HTTP/1.1 server :mod:`dispatcher.httpserver`).

Routes
------
``POST /v1/completions``, ``POST /v1/chat/completions``
    The request is validated, journaled, and the call waits (bounded by the request's
    deadline) for its result, which is vLLM's own response body (with each choice's
    ``weight_versions`` where vLLM returns them: 0.33 and later) with its ``model`` set
    to ``NAME@REV``, the revision that served it (NAME: ``--model``, else the pool; see
    :mod:`dispatcher.oai`). The response carries ``x-sample-id``: a client that lost
    the connection fetches the result with ``GET /v1/samples/{id}``. ``stream: true``
    returns Server-Sent Events, but results are produced whole inside a turn, so the
    stream is ``: waiting`` comments every 15 s while pending, then one chunk per choice
    holding its whole text (``delta`` for chat), then, with ``stream_options:
    {"include_usage": true}``, one chunk with ``choices: []`` and the ``usage``, then
    ``data: [DONE]``.

    A completions ``prompt`` that is a list of prompts (strings, or token-id lists; at
    most ``MAX_BATCH``) is fanned out: one pending sample per prompt, all journaled in
    one group commit (all or nothing; an invalid one is a 400 naming ``prompt[i]``),
    answered together as one body whose choice ``index`` is ``i * n + j`` (prompt ``i``,
    its choice ``j``) with the usage summed and ``sample_ids`` (each prompt's sample, in
    order) instead of the ``x-sample-id`` header (a list of at most ``MAX_ID_HEADER``
    prompts also has them in ``x-sample-ids``, comma-separated). Streamed too: first
    ``: sample_ids ID,...`` SSE comments (every prompt's sample, in order, before any
    wait, so a client cut off mid-stream can fetch the results with ``POST
    /v1/samples/results``), then each prompt's chunks in prompt order, numbered the same
    way, all with one ``id`` (the first result's). A failed prompt fails a non-streamed
    list as its own error would (vLLM fails the whole request too), the message starting
    ``prompt[i] failed: ``, the error object holding every ``sample_ids``: the others'
    results stay fetchable. A stream ends at a failure, any failure (a store error
    included), with an error event and ``data: [DONE]``.
``GET /v1/models``, ``GET /v1/models/{NAME@REV}``
    Every published revision as an OpenAI model ``NAME@REV``, newest first
    (``{"object": "list", "data": [{"id", "object": "model", "created", "owned_by",
    "root", "revision"}]}``); an unknown one 404.
``POST /v1/samples``
    The same body plus ``"kind": "completion" | "chat"`` (default: "chat" when the body
    has ``messages``, else "completion"). Answers 202 ``{"id", "status": "pending"}``
    once the request is journaled.
``GET /v1/samples/{id}?wait=SECONDS``
    Long-poll (default 30 s, at most 300): ``{"id", "status", "revision", "pool"}`` plus
    ``"result"`` (done) or ``"error"`` (failed).
``POST /v1/samples/batch`` ``{"requests": [body, ...]}``
    Many ``POST /v1/samples`` bodies (``kind`` included) at once, at most ``MAX_BATCH``
    (10,000): 202 ``{"samples": [{"id", "status": "pending", "revision"}, ...]}`` in the
    order given, once all are journaled, in one group commit. All or nothing: an invalid
    item answers as ``POST /v1/samples`` would (400, an unknown revision 404) with a
    message that starts with ``requests[i]: ``, and nothing is journaled::

        curl -s localhost:8100/v1/samples/batch -H 'content-type: application/json' \
            -d '{"requests": [{"prompt": [1, 2], "max_tokens": 8}, {"prompt": "hi"}]}'
``POST /v1/samples/results`` ``{"ids": [id, ...], "wait": SECONDS}``
    Long-poll many (wait default 30, at most 300; at most ``MAX_BATCH`` ids): 200
    ``{"results": [...]}``, each exactly as ``GET /v1/samples/{id}`` answers, in the
    order of ``ids``, once every one is finished or the wait is over; an unknown id
    404 naming it::

        curl -s localhost:8100/v1/samples/results -H 'content-type: application/json' \
            -d '{"ids": ["smp-3f0c...", "smp-81aa..."], "wait": 60}'

A finished sample's ``result`` is the bytes vLLM returned, as stored: the front neither
parses nor re-encodes it (``/v1/completions`` serves the same bytes with only the
``model`` string replaced in place: :func:`dispatcher.oai.with_model`).
``POST /v1/revisions`` ``{"revision", "path"}``
    Publish weights; 201 when new, 200 when the same pair was published before; 400 when
    ``path`` is not a readable checkpoint directory (:mod:`dispatcher.checkpoint`).
    ``GET /v1/revisions`` lists them.
``GET /v1/events``
    The declared event stream (:mod:`dispatcher.events`; README.md "Events"): JSON lines
    (``application/x-ndjson``), one event per line as it happens, from a ``subscribed``
    line holding the loop's state on; ends with a ``dropped`` line for a reader that fell
    ``EVENT_BUFFER`` events behind, a ``closed`` line when the dispatcher stops.
``GET /status`` (JSON), ``GET /ready`` (200, or 503 with the reason: what probes read),
``GET /metrics`` (Prometheus text, prometheus-client).

Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (``param``:
the field at fault, or null), mapped from the dispatcher's error classes in one place
(:data:`ERROR_MAP`); an unknown route is a 404, a method a route does not take a 405
(with ``Allow``), and what the lean server refuses itself (400, 413, 431, 501, ...)
has the same body (:func:`dispatcher.httphead.error_json`). Malformed JSON (NaN and
Infinity included) and invalid fields (a string with a lone surrogate included) 400, an unknown
revision 404 (like vLLM's unknown model), an unknown sample 404, a body over
``MAX_BODY_BYTES`` 413 (checked while the body streams in), a missed deadline 504, a
full disk 507, a store failure (a damaged database included) 503, anything unexpected
500 (logged with its traceback; the front keeps serving). A refused request is never
journaled. A sample that failed answers by its error: a missed deadline 504, a revision
that could not be loaded 502, a request that could not be sent 500, a refusal by vLLM
400.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gpu_slicer.dispatcher.errors import (
    BadRequest,
    DeadlineExceeded,
    DispatchError,
    NotFound,
    ReplicaError,
    StoreError,
    StoreFull,
    UnknownRevision,
    quoted,
)
from gpu_slicer.dispatcher.events import encode
from gpu_slicer.dispatcher.health import ready_endpoint
from gpu_slicer.dispatcher.httphead import error_json
from gpu_slicer.dispatcher.httpserver import serve_asgi
from gpu_slicer.dispatcher.metrics import CONTENT_TYPE, render_metrics
from gpu_slicer.dispatcher.model import Pending, Result
from gpu_slicer.dispatcher.oai import (
    chunks,
    error_body,
    include_usage,
    merge_results,
    model_id,
    model_object,
    models_body,
    param_of,
    split_prompts,
    usage_chunk,
    with_model,
)
from gpu_slicer.dispatcher.serve import LOAD_FAILED, SEND_FAILED
from gpu_slicer.dispatcher.turns import TurnLoop

__all__ = [
    "ERROR_MAP",
    "MAX_BATCH",
    "MAX_BODY_BYTES",
    "build_app",
    "error_response",
    "serve_http",
]

log = logging.getLogger("dispatcher.http")

MAX_BODY_BYTES = 64 << 20
MAX_BATCH = 10_000  # requests of one POST /v1/samples/batch, ids of one /results
MAX_WAIT_S = 300.0
DEFAULT_WAIT_S = 30.0
SSE_KEEPALIVE_S = 15.0
SHUTDOWN_GRACE_S = 2.0  # serve_http: open requests after shutdown, by default
MAX_ID_HEADER = 64  # a prompt list up to this long names its samples in x-sample-ids
_IDS_PER_COMMENT = 256  # sample ids per ": sample_ids" line of a streamed prompt list
_SLICE = 500  # items between checkpoints in the per-item loops of a long prompt list
_THREAD_OVER = 256  # a prompt list longer than this is merged and encoded in a thread

# Most specific first.
ERROR_MAP: list[tuple[type[DispatchError], int, str]] = [
    (UnknownRevision, 404, "NotFoundError"),
    (NotFound, 404, "NotFoundError"),
    (BadRequest, 400, "BadRequestError"),
    (DeadlineExceeded, 504, "GatewayTimeoutError"),
    (StoreFull, 507, "InsufficientStorageError"),
    (StoreError, 503, "ServiceUnavailableError"),
    (ReplicaError, 502, "BadGatewayError"),
]


class _TooLarge(BadRequest):
    pass


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


def error_response(
    exc: DispatchError, extra: dict[str, Any] | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """The JSON error body and status for ``exc``; ``extra`` members are added to the
    error object (e.g. a prompt list's ``sample_ids``)."""
    status, typ = 500, "InternalServerError"
    if isinstance(exc, _TooLarge):
        status, typ = 413, "PayloadTooLargeError"
    else:
        for cls, http_status, name in ERROR_MAP:
            if isinstance(exc, cls):
                status, typ = http_status, name
                break
    code = "too_large" if status == 413 else _snake(type(exc).__name__)
    body = error_body(str(exc), typ, code, param_of(exc))
    body["error"].update(extra or {})
    return JSONResponse(body, status_code=status, headers=headers)


def _route_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route 404, a method the route does not take
    405) as OpenAI error bodies."""
    assert isinstance(exc, HTTPException)
    path = request.url.path[:200]
    if exc.status_code == 404:
        message = f"no route {request.method} {path}"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        message = f"{request.method} is not allowed on {path} (allowed: {allowed})"
    else:
        message = str(exc.detail)
    return Response(
        error_json(exc.status_code, message),
        status_code=exc.status_code,
        headers=exc.headers,
        media_type="application/json",
    )


async def _read_body(request: Request) -> bytes:
    """The whole body, refused (413) as soon as it passes ``MAX_BODY_BYTES``: a declared
    ``Content-Length`` is checked before reading, a chunked body while it streams in, so
    an oversized body never sits in memory."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _TooLarge(f"request body is {declared} bytes, more than {MAX_BODY_BYTES}")
    buf = bytearray()
    try:
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > MAX_BODY_BYTES:
                raise _TooLarge(f"request body is more than {MAX_BODY_BYTES} bytes")
    except ClientDisconnect:
        raise BadRequest("the client went away before its request body was whole") from None
    return bytes(buf)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await _read_body(request)
    try:
        # NaN/Infinity are not JSON: vLLM's client side (httpx) refuses to send them.
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        what = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise BadRequest(f"malformed JSON body: {what}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _failure(result: Result) -> DispatchError:
    """The error class a failed sample answers with, from its stored error text."""
    text = result.error or "failed"
    if text.startswith("deadline exceeded"):
        return DeadlineExceeded(text)
    if text.startswith(LOAD_FAILED):
        return ReplicaError(text)  # the revision's weights could not be loaded: 502
    if text.startswith(SEND_FAILED):
        return DispatchError(text)  # the dispatcher could not send it: 500
    return BadRequest(text)


def _kind_of(body: dict[str, Any]) -> str:
    """The ``kind`` of a ``POST /v1/samples`` body, taken out of it (default: "chat"
    with ``messages``, else "completion")."""
    kind = body.pop("kind", None)
    if kind is None:
        kind = "chat" if "messages" in body else "completion"
    if not isinstance(kind, str):
        raise BadRequest(f"kind must be 'completion' or 'chat', got {quoted(kind)}")
    return kind


def _list_field(body: dict[str, Any], key: str) -> list[Any]:
    """``body[key]``: a list of at most ``MAX_BATCH`` items, else BadRequest."""
    if key not in body:
        raise BadRequest(f"missing field {key!r}")
    items = body[key]
    if not isinstance(items, list):
        raise BadRequest(f"{key} must be a list, got {type(items).__name__}")
    if len(items) > MAX_BATCH:
        raise BadRequest(f"{key} has {len(items)} items, more than the limit of {MAX_BATCH}")
    return items


def _wait(raw: str) -> float:
    """A long-poll's ``wait`` (seconds, >= 0), capped at ``MAX_WAIT_S``."""
    try:
        wait = float(raw)
    except ValueError:
        raise BadRequest(f"wait must be a number of seconds, got {quoted(raw)}") from None
    if not math.isfinite(wait) or wait < 0:
        raise BadRequest(f"wait must be a number of seconds >= 0, got {quoted(raw)}")
    return min(wait, MAX_WAIT_S)


def _sample_json(result: Result) -> bytes:
    """``GET /v1/samples/{id}``'s answer for ``result``: ``{"id", "status", "revision",
    "pool"}`` plus ``"result"`` (vLLM's body, its stored bytes as-is) or ``"error"``."""
    out: dict[str, Any] = {
        "id": result.id,
        "status": result.status,
        "revision": result.revision,
        "pool": result.pool,
    }
    if result.status == "failed":
        out["error"] = result.error
    head = json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if result.status != "done":
        return head
    raw = result.raw if result.raw is not None else b"null"
    return head[:-1] + b',"result":' + raw + b"}"


_REQUESTS_PREFIX = re.compile(r"requests\[(\d+)\]: ")


def _prompt_error(e: DispatchError) -> DispatchError:
    """An error of :meth:`TurnLoop.accept_many` on a fanned-out prompt list, told as the
    request's own: ``requests[i]: prompt ...`` becomes ``prompt[i] ...``; an error of a
    shared field (every prompt has it) loses the prefix."""
    text = str(e)
    m = _REQUESTS_PREFIX.match(text)
    if m is None:
        return e
    rest = text[m.end() :]
    if rest.startswith("prompt"):
        return type(e)(f"prompt[{m[1]}]{rest[len('prompt') :]}", param="prompt")
    return type(e)(rest, param=param_of(type(e)(rest)))


def _sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def _id_comments(ids: list[str]) -> list[bytes]:
    """A streamed prompt list's first lines: SSE comments (which SSE readers, the openai
    client's included, skip) naming every prompt's sample in order, at most
    ``_IDS_PER_COMMENT`` to a line, so a client cut off mid-stream can fetch the rest."""
    return [
        b": sample_ids " + ",".join(ids[at : at + _IDS_PER_COMMENT]).encode() + b"\n\n"
        for at in range(0, len(ids), _IDS_PER_COMMENT)
    ]


def _ids_header(ids: list[str]) -> dict[str, str]:
    """``x-sample-ids`` for a prompt list short enough for any client's header limit."""
    return {"x-sample-ids": ",".join(ids)} if len(ids) <= MAX_ID_HEADER else {}


def _encode(data: Any) -> bytes:
    # As starlette's JSONResponse renders.
    return json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _unfinished(result: Result) -> DispatchError | None:
    """The error a prompt list's ``result`` answers with, None when it is done."""
    if result.status == "failed":
        return _failure(result)
    if result.status != "done" or result.raw is None:
        return DeadlineExceeded(f"sample {result.id} has no result by its deadline")
    return None


def build_app(loop: TurnLoop) -> Starlette:
    """The ASGI app in front of ``loop``."""

    async def wait_whole(id: str, deadline: float) -> Result:
        result = await loop.wait_result(id, deadline - time.time() + 1.0)
        if result.status == "pending":
            raise DeadlineExceeded(f"sample {id} has no result by its deadline")
        return result

    name = loop.cfg.model or loop.store.pool  # NAME of the NAME@REV model ids

    async def generate(request: Request, kind: str) -> Response:
        body = await _json_object(request)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):  # before stream_options, which depend on it
            raise BadRequest(f"stream must be true or false, got {quoted(stream)}")
        usage = include_usage(body, stream)
        prompts = split_prompts(body.get("prompt")) if kind == "completion" else None
        if prompts is None:
            ps = [await loop.accept(kind, body)]
            headers = {"x-sample-id": ps[0].id}
        else:
            ps = await _accept_prompts(body, prompts)
            headers = _ids_header([p.id for p in ps])
        if stream:
            listed = prompts is not None
            return StreamingResponse(
                _events(kind, ps, usage, listed), media_type="text/event-stream", headers=headers
            )
        if prompts is not None:
            return await _answer_list(ps, headers)
        result = await wait_whole(ps[0].id, ps[0].deadline)
        if result.status == "failed":
            raise _failure(result)
        # vLLM's own bytes, as stored: only its "model" is set (oai.with_model).
        raw = result.raw if result.raw is not None else b"null"
        raw = with_model(raw, model_id(name, result.revision))
        return Response(content=raw, media_type="application/json", headers=headers)

    async def _accept_prompts(body: dict[str, Any], prompts: list[Any]) -> list[Pending]:
        """A completions body with a list of prompts, accepted as one sample per prompt
        in one group commit (all or nothing); errors name ``prompt[i]``."""
        if len(prompts) > MAX_BATCH:
            raise BadRequest(
                f"prompt has {len(prompts)} prompts, more than the limit of {MAX_BATCH}",
                param="prompt",
            )
        try:
            return await loop.accept_many([("completion", {**body, "prompt": x}) for x in prompts])
        except (BadRequest, UnknownRevision) as e:
            raise _prompt_error(e) from None

    async def _wait_all(ps: list[Pending]) -> list[Result]:
        """Every result of ``ps``, in order, once all are finished or the latest deadline
        passed; read ``_SLICE`` ids at a time with a checkpoint between, so that a long
        list does not hold the event loop."""
        deadline = max(p.deadline for p in ps) + 1.0
        ids = [p.id for p in ps]
        got: list[Result] = []
        for at in range(0, len(ids), _SLICE):
            got += await loop.wait_results(ids[at : at + _SLICE], deadline - time.time())
            await trio.lowlevel.checkpoint()
        return got

    async def _answer_list(ps: list[Pending], headers: dict[str, str]) -> Response:
        """The one body of a non-streamed prompt list; if a prompt failed, the request
        answers as its first failure would (as vLLM fails the whole request), the message
        naming ``prompt[i]`` and how many failed, the error object holding every
        prompt's ``sample_ids``: the other prompts' results stay fetchable
        (``POST /v1/samples/results``)."""
        done = await _wait_all(ps)
        ids = [p.id for p in ps]
        failed = [(i, e) for i, r in enumerate(done) if (e := _unfinished(r)) is not None]
        if failed:
            i, err = failed[0]
            more = f" (and {len(failed) - 1} more prompts)" if len(failed) > 1 else ""
            text = (
                f"prompt[{i}]{more} failed: {err}; the other prompts' results are kept: "
                "fetch them with POST /v1/samples/results (error.sample_ids, in prompt order)"
            )
            out = type(err)(text, param=param_of(err) or "prompt")
            return error_response(out, {"sample_ids": ids}, headers)
        model = model_id(name, done[0].revision)

        def build() -> bytes:
            return _encode(merge_results([r.body or {} for r in done], model, ids))

        # Parsing 10,000 stored bodies and encoding the merge takes a few hundred ms:
        # in a thread, the loop keeps serving meanwhile.
        if len(done) > _THREAD_OVER:
            content = await trio.to_thread.run_sync(build)
        else:
            content = build()
        return Response(content=content, media_type="application/json", headers=headers)

    async def _events(
        kind: str, ps: list[Pending], usage: bool, listed: bool
    ) -> AsyncIterator[bytes]:
        """The SSE stream of ``ps`` (a prompt list when ``listed``: its sample ids first,
        as comments). Any failure, mid-stream included (a store error), ends it with an
        error event and ``[DONE]``, never a cut connection."""
        if listed:
            for line in _id_comments([p.id for p in ps]):
                yield line
        bodies: list[dict[str, Any]] = []
        index = 0  # choices streamed so far: prompt i's choice j is i * n + j
        model = model_id(name, ps[0].revision)
        stream_id: str | None = None  # one id for the whole stream, as OpenAI's
        for i, p in enumerate(ps):
            try:
                while True:
                    result = await loop.wait_result(
                        p.id, min(SSE_KEEPALIVE_S, p.deadline - time.time())
                    )
                    if result.status != "pending" or time.time() >= p.deadline + 1.0:
                        break
                    yield b": waiting\n\n"
                err = _unfinished(result)
            except DispatchError as e:
                err = e
            except Exception as e:
                log.exception("stream of %s failed", p.id)
                err = DispatchError(f"internal error: {type(e).__name__}: {e}")
            if err is not None or result.body is None:
                if err is None:
                    err = DispatchError(f"sample {p.id} has a result that is not JSON")
                if listed:
                    err = type(err)(f"prompt[{i}] failed: {err}", param=param_of(err))
                yield _sse(json.loads(bytes(error_response(err).body)))
                yield b"data: [DONE]\n\n"
                return
            model = model_id(name, result.revision)
            bodies.append(result.body)
            if stream_id is None and isinstance(result.body.get("id"), str):
                stream_id = result.body["id"]
            part = chunks(kind, result.body, model, first_index=index, usage=usage, id=stream_id)
            for chunk in part:
                yield _sse(chunk)
                index += 1
        if usage:
            yield _sse(usage_chunk(kind, bodies, model))
        yield b"data: [DONE]\n\n"

    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    async def submit(request: Request) -> Response:
        body = await _json_object(request)
        kind = _kind_of(body)
        p = await loop.accept(kind, body)
        return JSONResponse(
            {"id": p.id, "status": "pending", "revision": p.revision}, status_code=202
        )

    async def submit_batch(request: Request) -> Response:
        items = _list_field(await _json_object(request), "requests")
        requests: list[tuple[str, Any]] = []
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                what = type(item).__name__
                raise BadRequest(f"requests[{i}]: request body must be a JSON object, got {what}")
            try:
                requests.append((_kind_of(item), item))
            except BadRequest as e:
                raise BadRequest(f"requests[{i}]: {e}") from None
        accepted = await loop.accept_many(requests)
        out = [{"id": p.id, "status": "pending", "revision": p.revision} for p in accepted]
        return JSONResponse({"samples": out}, status_code=202)

    async def sample(request: Request) -> Response:
        wait = _wait(request.query_params.get("wait", str(DEFAULT_WAIT_S)))
        result = await loop.wait_result(request.path_params["id"], wait)
        return Response(content=_sample_json(result), media_type="application/json")

    async def results(request: Request) -> Response:
        body = await _json_object(request)
        ids = _list_field(body, "ids")
        for i, id in enumerate(ids):
            if not isinstance(id, str):
                raise BadRequest(f"ids[{i}] must be a sample id (a string), got {quoted(id)}")
        wait = body.get("wait", DEFAULT_WAIT_S)
        if isinstance(wait, bool) or not isinstance(wait, int | float | str):
            raise BadRequest(f"wait must be a number of seconds, got {quoted(wait)}")
        got = await loop.wait_results(ids, _wait(str(wait)))
        content = b'{"results":[' + b",".join(_sample_json(r) for r in got) + b"]}"
        return Response(content=content, media_type="application/json")

    async def publish(request: Request) -> Response:
        body = await _json_object(request)
        for key in ("revision", "path"):
            if key not in body:
                raise BadRequest(f"missing field {key!r}")
        rev, created = await loop.publish_async(body["revision"], body["path"])
        return JSONResponse(
            {"revision": rev.name, "path": rev.path, "published_at": rev.published_at},
            status_code=201 if created else 200,
        )

    async def revisions(request: Request) -> Response:
        revs = loop.store.revisions()
        out = [{"revision": r.name, "path": r.path, "published_at": r.published_at} for r in revs]
        return JSONResponse({"revisions": out})

    async def revisions_route(request: Request) -> Response:
        return await (publish if request.method == "POST" else revisions)(request)

    async def models(request: Request) -> Response:
        return JSONResponse(models_body(name, loop.store.revisions()))

    async def one_model(request: Request) -> Response:
        wanted = request.path_params["model"]
        for rev in loop.store.revisions():
            if model_id(name, rev.name) == wanted:
                return JSONResponse(model_object(name, rev))
        raise UnknownRevision(
            f"the model {quoted(wanted, 200)} does not exist; GET /v1/models lists them"
        )

    async def status(request: Request) -> Response:
        return JSONResponse(loop.status())

    async def event_stream(request: Request) -> Response:
        sub = loop.subscribe()

        async def lines() -> AsyncIterator[bytes]:
            with sub:  # a reader that went away (the response is cancelled) unsubscribes
                async for event in sub:
                    yield encode(event)

        headers = {"cache-control": "no-store"}
        return StreamingResponse(lines(), media_type="application/x-ndjson", headers=headers)

    async def metrics(request: Request) -> Response:
        return Response(render_metrics(loop), media_type=CONTENT_TYPE)

    def guard(fn: Any) -> Any:
        async def wrapped(request: Request) -> Response:
            try:
                return await fn(request)  # type: ignore[no-any-return]
            except DispatchError as e:
                return error_response(e)
            except Exception as e:
                # A bug must cost one request its answer, never the front a worker.
                log.exception("%s %s failed", request.method, request.url.path)
                return error_response(DispatchError(f"internal error: {type(e).__name__}: {e}"))

        return wrapped

    routes = [
        Route("/v1/completions", guard(completions), methods=["POST"]),
        Route("/v1/chat/completions", guard(chat), methods=["POST"]),
        Route("/v1/samples", guard(submit), methods=["POST"]),
        Route("/v1/samples/batch", guard(submit_batch), methods=["POST"]),
        Route("/v1/samples/results", guard(results), methods=["POST"]),
        Route("/v1/samples/{id}", guard(sample), methods=["GET"]),
        Route("/v1/revisions", guard(revisions_route), methods=["GET", "POST"]),
        Route("/v1/models", guard(models), methods=["GET"]),
        Route("/v1/models/{model:path}", guard(one_model), methods=["GET"]),
        Route("/v1/events", guard(event_stream), methods=["GET"]),
        Route("/status", guard(status), methods=["GET"]),
        Route("/ready", guard(ready_endpoint(loop)), methods=["GET"]),
        Route("/metrics", guard(metrics), methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _route_error})


async def serve_http(
    app: Starlette,
    bind: str,
    shutdown: trio.Event,
    *,
    grace: float = SHUTDOWN_GRACE_S,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``bind`` ("HOST:PORT" or "unix:PATH") until ``shutdown`` is set;
    ``task_status.started`` gets the bound addresses.

    Once ``shutdown`` is set no new connection is accepted and idle ones close; the
    requests still open (event streams, long-polls) get up to ``grace`` seconds, then
    are cut. A caller with more to tell them first (the dispatcher ends its turn) gives
    a ``grace`` that covers it and cancels this task itself once it is done."""
    await serve_asgi(app, bind, shutdown, grace=grace, task_status=task_status)
