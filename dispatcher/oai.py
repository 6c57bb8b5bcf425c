"""The OpenAI shapes of the HTTP front's answers: errors, models, stream chunks, batches.

Pure functions over plain JSON values (no I/O, no trio): :mod:`dispatcher.http` calls
them. Apart from it because they are what an OpenAI client parses, each shape tested by
a table.

* Errors: ``{"error": {"message", "type", "param", "code"}}`` (:func:`error_body`), as
  vLLM answers them; ``param`` names the request field at fault where the error knows it
  (:func:`param_of`).
* The ``model`` of every answer is ``NAME@REV``: the served name and the revision whose
  weights produced it (:func:`model_id`, :func:`with_model` for vLLM's stored bytes).
* ``GET /v1/models``: every published revision as a model, newest first
  (:func:`models_body`).
* A list of prompts in one completions request is fanned out into one sample per prompt
  (:func:`split_prompts`) and answered as one body (:func:`merge_results`) whose choice
  ``index`` is ``prompt * n + j``, as OpenAI numbers them, with the usage summed.
* ``stream: true``: one chunk per choice holding its whole text (:func:`chunks`), then,
  with ``stream_options.include_usage``, one chunk with ``choices: []`` and the usage
  (:func:`usage_chunk`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from typing import Any

from gpu_slicer.dispatcher.errors import BadRequest, DispatchError, quoted
from gpu_slicer.dispatcher.model import Revision

__all__ = [
    "OWNED_BY",
    "chunks",
    "error_body",
    "include_usage",
    "merge_results",
    "model_id",
    "model_object",
    "models_body",
    "param_of",
    "split_prompts",
    "sum_usage",
    "usage_chunk",
    "with_model",
]

OWNED_BY = "gpu-slicer"
_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")
# The start of a compact JSON object: scalar members (strings without escapes, numbers,
# literals), then "model" with a string value (group 1): so that key is a top-level one.
_VLLM_HEAD = re.compile(
    rb'\{(?:"[^"\\]*":(?:"[^"\\]*"|[-+.0-9eE]+|true|false|null),)*"model":("[^"\\]*")'
)
# "prompt[3] must ...", "max_tokens must ...", "missing field 'prompt'", "requests[2]: n must"
_PARAM = re.compile(
    r"(?:requests\[\d+\]: )?(?:missing field '([a-z_]+)'|([a-z_]+)(?:\[\d+\])?(?:\.[a-z_]+)?"
    r" (?:must|is|has|holds|are)\b)"
)


def param_of(exc: DispatchError) -> str | None:
    """The request field ``exc`` is about (OpenAI's ``param``): its own ``param``, else
    the field its message starts with (``"max_tokens must be ..."`` -> ``max_tokens``)."""
    if exc.param is not None:
        return exc.param
    if not isinstance(exc, BadRequest):
        return None
    m = _PARAM.match(str(exc))
    return (m[1] or m[2]) if m else None


def error_body(message: str, typ: str, code: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": typ, "param": param, "code": code}}


def model_id(name: str, revision: str) -> str:
    """The model id of ``revision`` served as ``name``: ``NAME@REV``."""
    return f"{name}@{revision}"


def model_object(name: str, rev: Revision) -> dict[str, Any]:
    """One entry of ``GET /v1/models``."""
    return {
        "id": model_id(name, rev.name),
        "object": "model",
        "created": int(rev.published_at),
        "owned_by": OWNED_BY,
        "root": name,
        "revision": rev.name,
    }


def models_body(name: str, revisions: Sequence[Revision]) -> dict[str, Any]:
    """``GET /v1/models``: ``revisions`` (oldest first, as the store lists them) as an
    OpenAI list, newest first."""
    return {"object": "list", "data": [model_object(name, r) for r in reversed(revisions)]}


def with_model(raw: bytes, model: str) -> bytes:
    """vLLM's response bytes ``raw`` with its top-level ``model`` replaced by ``model``
    (a body without one is returned as it is).

    vLLM writes ``"model":"..."`` after a few scalar fields (``id``, ``object``,
    ``created``): that string is replaced in place, found by one match of the head (no
    parse, no re-encoding of a long body). Any other layout is parsed and encoded again."""
    m = _VLLM_HEAD.match(raw)
    if m is not None:
        return raw[: m.start(1)] + _encoded(model) + raw[m.end(1) :]
    body = json.loads(raw)
    if not isinstance(body, dict) or "model" not in body:
        return raw
    body["model"] = model
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


@functools.lru_cache(maxsize=256)
def _encoded(model: str) -> bytes:
    return json.dumps(model, ensure_ascii=False).encode()


def include_usage(body: dict[str, Any], stream: bool) -> bool:
    """Whether ``body`` asks for the usage chunk (``stream_options.include_usage``);
    BadRequest for stream options that are no object, or that ask for something without
    ``stream`` (an empty ``{}`` is accepted either way, as vLLM does)."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise BadRequest(
            f"stream_options must be an object, got {type(opts).__name__}", param="stream_options"
        )
    if not stream and opts:
        raise BadRequest(
            "stream_options can only be given with stream: true", param="stream_options"
        )
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise BadRequest(
            f"stream_options.include_usage must be true or false, got {quoted(usage)}",
            param="stream_options",
        )
    return usage


def split_prompts(prompt: object) -> list[Any] | None:
    """The prompts of a completions ``prompt`` that is a batch (a list of at least two
    strings, or of at least two token-id lists), else None (one prompt: the store
    validates it). BadRequest for a list that mixes prompts and token ids, and for an
    item that is a list but no token ids (``[["a"], ["b"]]`` is no list of prompts)."""
    if not isinstance(prompt, list) or len(prompt) < 2:
        return None
    types = set(map(type, prompt))
    if not types & {str, list}:
        return None  # token ids of one prompt
    if types == {str}:
        return prompt
    if types == {list}:
        for i, x in enumerate(prompt):
            if not set(map(type, x)) <= {int}:
                raise BadRequest(
                    f"prompt[{i}] must be a string or a list of token ids, got {quoted(x)}",
                    param="prompt",
                )
        return prompt
    raise BadRequest(
        "prompt must be a string, a list of token ids, a list of strings or a list of "
        "token-id lists; this list mixes them",
        param="prompt",
    )


def sum_usage(bodies: Sequence[dict[str, Any]]) -> dict[str, int] | None:
    """The usage of ``bodies`` added up; a vLLM send shared by several of them
    (``--batch-prompts``: same ``id``, a ``batch`` field) counts once. None when no body
    has any usage."""
    total = dict.fromkeys(_USAGE_FIELDS, 0)
    seen: set[Any] = set()
    found = False
    for body in bodies:
        usage = body.get("usage")
        if not isinstance(usage, dict):
            continue
        if "batch" in body:
            if body.get("id") in seen:
                continue
            seen.add(body.get("id"))
        found = True
        for k in _USAGE_FIELDS:
            v = usage.get(k)
            if type(v) is int:
                total[k] += v
    return total if found else None


def merge_results(
    bodies: Sequence[dict[str, Any]], model: str, sample_ids: Sequence[str]
) -> dict[str, Any]:
    """One completions body for the results of a fanned-out prompt list, in prompt
    order: prompt ``i``'s choice ``j`` (of ``n``) becomes choice ``i * n + j``; the
    usage is summed (:func:`sum_usage`); ``sample_ids`` names each prompt's sample."""
    base = {k: v for k, v in bodies[0].items() if k not in ("choices", "usage", "batch")}
    choices: list[dict[str, Any]] = []
    for body in bodies:
        own = sorted(body.get("choices") or [], key=lambda c: c.get("index", 0))
        at = len(choices)
        choices += [{**c, "index": at + j} for j, c in enumerate(own)]
    base.update(
        object="text_completion",
        created=max(int(b.get("created") or 0) for b in bodies),
        model=model,
        choices=choices,
        usage=sum_usage(bodies),
        sample_ids=list(sample_ids),
    )
    return base


def chunks(
    kind: str,
    body: dict[str, Any],
    model: str,
    *,
    first_index: int = 0,
    usage: bool = False,
    id: str | None = None,
) -> list[dict[str, Any]]:
    """A whole result as stream chunks: one per choice, its whole text in it (``delta``
    for chat), numbered from ``first_index``; ``usage`` adds ``"usage": null`` to each,
    as OpenAI does when the usage chunk follows. ``id`` (default: the body's) is the
    stream's: OpenAI gives every chunk of one stream the same id, so a stream of a
    prompt list passes its first result's id for every prompt's chunks."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    base: dict[str, Any] = {k: body[k] for k in ("id", "created") if k in body}
    if id is not None:
        base["id"] = id
    base.update(object=obj, model=model)
    out: list[dict[str, Any]] = []
    for j, choice in enumerate(sorted(body.get("choices") or [], key=lambda c: c.get("index", 0))):
        c: dict[str, Any] = dict(choice)
        c["index"] = first_index + j
        if kind == "chat":
            c["delta"] = c.pop("message", {})
        chunk = {**base, "choices": [c]}
        if usage:
            chunk["usage"] = None
        out.append(chunk)
    return out


def usage_chunk(kind: str, bodies: Sequence[dict[str, Any]], model: str) -> dict[str, Any]:
    """The stream's last chunk under ``stream_options.include_usage``: no choices, the
    usage of ``bodies`` (:func:`sum_usage`), the id of the first (the stream's id)."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    first = bodies[0] if bodies else {}
    chunk: dict[str, Any] = {k: first[k] for k in ("id", "created") if k in first}
    chunk.update(object=obj, model=model, choices=[], usage=sum_usage(bodies))
    return chunk
