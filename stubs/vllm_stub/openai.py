"""OpenAI-compatible /v1/completions and /v1/chat/completions: parse, run, render.

Bodies follow vLLM 0.32's protocol models (read from the 0.32.0 wheel and probed on a
real server). Parsing runs in vLLM's order:

1. field types as pydantic's lax mode takes them (``"16"`` is an int, ``1`` a bool):
   a wrong type or a missing required field is a FastAPI validation error (400
   ``"Bad Request"``, ``param`` ``body.<field>``); a missing or empty ``prompt`` is
   vLLM's own (400 ``"BadRequestError"``, ``param`` ``"prompt"``);
2. ``model`` must be a served name (404 ``NotFoundError``, ``param`` ``"model"``);
3. ``max_tokens`` past ``--max-model-len`` and a prompt longer than it are 400s
   (``param`` ``max_tokens`` / ``input_tokens``); otherwise ``max_tokens`` is clamped
   to what is left of the context (a completion's default is 16, a chat's the rest);
4. sampling values (``n``, ``temperature``, ``top_p``, ``max_tokens >= 1``).

Responses carry every key vLLM's response models have (nulls included); streamed
chunks carry the keys vLLM sets (``model_dump_json(exclude_unset=True)``), one choice
per chunk, ``system_fingerprint`` on each choice's last chunk (or on the usage chunk
when ``stream_options.include_usage``). ``return_token_ids`` fills ``token_ids`` and
``prompt_token_ids``; ``return_weight_versions`` (vLLM 0.33, see VLLM_API.md) adds each
choice's ``weight_versions`` (streaming: on its last chunk). Unknown fields, and known
ones the stub does not implement (``echo``, penalties, ``top_k``, ...), are ignored.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from stubs.vllm_stub.engine import HOLD_XARG, Engine, GenRequest, Seq
from stubs.vllm_stub.errors import EngineError, error_body, invalid, validation
from stubs.vllm_stub.textgen import VOCAB_SIZE, WORDS, tokenize

__all__ = ["SYSTEM_FINGERPRINT", "Job", "parse_chat", "parse_completion", "render", "stream"]

MAX_LOGPROBS = 20  # vLLM's --max-logprobs default

SYSTEM_FINGERPRINT = "vllm-0.33.0-stub"
_INT64 = 2**63
_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}
_MISSING = object()


@dataclass
class Job:
    """A validated generation request and how to render it."""

    chat: bool
    model: str
    req: GenRequest
    stream: bool
    prompts: list[list[int]]
    n: int
    return_token_ids: bool
    return_weight_versions: bool
    logprobs: int | None
    include_usage: bool
    request_id: str
    created: int


# -- pydantic's lax mode, one field at a time -------------------------------------------


def _int(body: dict[str, Any], name: str, default: int | None, nullable: bool = True) -> Any:
    v = body.get(name, _MISSING)
    if v is _MISSING or (v is None and nullable):
        return default
    loc = ("body", name)
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float):
        if v.is_integer():
            return int(v)
        raise invalid(
            loc,
            "int_from_float",
            "Input should be a valid integer, got a number with a fractional part",
            v,
        )
    if isinstance(v, str) and re.fullmatch(r"\s*[+-]?\d+\s*", v):
        return int(v)
    if isinstance(v, str):
        raise invalid(
            loc,
            "int_parsing",
            "Input should be a valid integer, unable to parse string as an integer",
            v,
        )
    raise invalid(loc, "int_type", "Input should be a valid integer", v)


def _float(body: dict[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            pass
        raise invalid(
            ("body", name),
            "float_parsing",
            "Input should be a valid number, unable to parse string as a number",
            v,
        )
    raise invalid(("body", name), "float_type", "Input should be a valid number", v)


def _bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if isinstance(v, bool):
        return v
    if isinstance(v, int | float) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE | _FALSE:
        return v.strip().lower() in _TRUE
    if isinstance(v, str | int | float):
        raise invalid(
            ("body", name),
            "bool_parsing",
            "Input should be a valid boolean, unable to interpret input",
            v,
        )
    raise invalid(("body", name), "bool_type", "Input should be a valid boolean", v)


def _str(body: dict[str, Any], name: str, nullable: bool = True) -> str | None:
    v = body.get(name)
    if v is None and (nullable or name not in body):
        return None
    if not isinstance(v, str):
        raise invalid(("body", name), "string_type", "Input should be a valid string", v)
    return v


def _token_ids(value: Sequence[Any]) -> list[int] | None:
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return None
    return list(value)


def _prompts(prompt: Any) -> list[list[int]]:
    """``str | [str] | [int] | [[int]]``, ids >= 0 (pydantic: 400 ``body.prompt``)."""
    if isinstance(prompt, str):
        return [tokenize(prompt)]
    if isinstance(prompt, list):
        if (ids := _token_ids(prompt)) is not None:
            bad = [i for i, t in enumerate(ids) if t < 0]
            if bad:
                raise invalid(
                    ("body", "prompt", bad[0]),
                    "greater_than_equal",
                    "Input should be greater than or equal to 0",
                    ids[bad[0]],
                    ge=0,
                )
            return [ids]
        if all(isinstance(p, str) for p in prompt):
            return [tokenize(p) for p in prompt]
        if all(isinstance(p, list) and _token_ids(p) is not None for p in prompt):
            nested = [list(p) for p in prompt]
            if all(t >= 0 for p in nested for t in p):
                return nested
    raise invalid(("body", "prompt"), "list_type", "Input should be a valid list", prompt)


def _chat_prompt(body: dict[str, Any]) -> list[int]:
    if "messages" not in body:
        raise invalid(("body", "messages"), "missing", "Field required")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise invalid(("body", "messages"), "list_type", "Input should be a valid list", messages)
    if not messages:
        raise validation("messages must be a non-empty list", "messages")
    parts: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(("body", "messages", i, "role"), "missing", "Field required", m)
        content = m.get("content", "")
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise invalid(
                ("body", "messages", i, "content"),
                "string_type",
                "Input should be a valid string",
                content,
            )
        parts.append(f"<|{m['role']}|> {content}")
    parts.append("<|assistant|>")
    return tokenize(" ".join(parts))


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise invalid(("body", "stop"), "string_type", "Input should be a valid string", stop)


def _hold_after(body: dict[str, Any]) -> int | None:
    # vllm_xargs reach vLLM's scheduler as SamplingParams.extra_args; the only one any
    # scheduler here reads is the tier's hold (see Engine.hold_scheduler).
    xargs = body.get("vllm_xargs")
    if xargs is None:
        return None
    if not isinstance(xargs, dict):
        why = "Input should be a valid dictionary"
        raise invalid(("body", "vllm_xargs"), "dict_type", why, xargs)
    k = xargs.get(HOLD_XARG)
    return k if isinstance(k, int) and not isinstance(k, bool) else None


def _parse(
    body: Any, names: Sequence[str], max_model_len: int, chat: bool, request_id: str | None
) -> Job:
    if not isinstance(body, dict):
        raise invalid(
            ("body",),
            "model_attributes_type",
            "Input should be a valid dictionary or object to extract fields from",
            body,
        )
    # 1. vLLM's before-validators, then the fields' types
    if not chat:
        prompt = body.get("prompt")
        if prompt is None or prompt == "":
            raise validation(
                "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
            )
    if body.get("stream_options") and not body.get("stream"):
        raise validation("Stream options can only be defined when `stream=True`.", "stream_options")
    lp_name = "top_logprobs" if chat else "logprobs"
    lp = body.get(lp_name)
    if isinstance(lp, int | float) and not isinstance(lp, bool) and lp < 0 and lp != -1:
        raise validation(f"`{lp_name}` must be a positive value or -1.", lp_name, lp)
    model = _str(body, "model")
    prompts = [_chat_prompt(body)] if chat else _prompts(body["prompt"])
    if chat:
        logprobs = (_int(body, "top_logprobs", 0) or 0) if _bool(body, "logprobs") else None
    else:
        logprobs = _int(body, "logprobs", None)
    if logprobs:  # vLLM's --max-logprobs (default 20); -1 asks for the whole vocabulary
        wanted = VOCAB_SIZE if logprobs == -1 else logprobs
        if wanted > MAX_LOGPROBS:
            raise validation(
                f"Requested sample logprobs of {wanted}, which is greater than max allowed: "
                f"{MAX_LOGPROBS}",
                "logprobs",
                wanted,
            )
    key = (
        "max_completion_tokens"
        if chat and body.get("max_completion_tokens") is not None
        else ("max_tokens")
    )
    requested: int | None = _int(body, key, None if chat else 16)
    if not chat and "max_tokens" in body and body["max_tokens"] is None:
        requested = None
    n = _int(body, "n", 1, nullable=chat)
    seed = _int(body, "seed", None)
    if seed is not None and not -_INT64 <= seed < _INT64:
        raise invalid(
            ("body", "seed"),
            "less_than_equal",
            f"Input should be less than or equal to {_INT64 - 1}",
            seed,
        )
    stop = _stop(body)
    stream = _bool(body, "stream")
    temperature, top_p = _float(body, "temperature"), _float(body, "top_p")
    opts = body.get("stream_options") or {}
    include_usage = isinstance(opts, dict) and _bool(opts, "include_usage")
    return_token_ids = _bool(body, "return_token_ids")
    return_weight_versions = _bool(body, "return_weight_versions")
    rid = request_id or _str(body, "request_id", nullable=False) or uuid.uuid4().hex[:16]
    hold_after = _hold_after(body)
    # 2. the model
    if model and model not in names:
        raise EngineError(
            f"The model `{model}` does not exist. Valid aliases: {', '.join(names)}.",
            404,
            param="model",
        )
    # 3. lengths
    if requested is not None and requested > max_model_len:
        raise validation(
            f"{key}={requested} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            key,
            requested,
        )
    longest = max((len(p) for p in prompts), default=0)
    if longest > max_model_len:
        raise validation(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {longest} input tokens, which exceeds this limit even without "
            "any output tokens. Please reduce the length of the input prompt.",
            "input_tokens",
            longest,
        )
    left = max_model_len - longest
    max_tokens = left if requested is None else min(requested, left)
    # 4. sampling parameters
    if n < 1:
        raise validation(f"n must be at least 1, got {n}.")
    if temperature is not None:
        if not math.isfinite(temperature):
            raise validation(
                f"temperature must be a finite number, got {temperature}.",
                "temperature",
                temperature,
            )
        if temperature < 0:
            raise validation(
                f"temperature must be non-negative, got {temperature}.", "temperature", temperature
            )
        if temperature > 2:
            raise validation(
                f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature
            )
    if temperature is not None and temperature < 1e-5 and n > 1:  # vLLM's greedy check
        raise validation(f"n must be 1 when using greedy sampling, got {n}.")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise validation(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    if max_tokens < 1:
        raise validation(
            f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens
        )
    # 5. the engine's input checks
    if min(len(p) for p in prompts) == 0:
        raise validation("The decoder prompt cannot be empty")
    seqs = [
        Seq(index=p * n + i, prompt_ids=ids, max_tokens=max_tokens, stop=stop, seed=seed or 0)
        for p, ids in enumerate(prompts)
        for i in range(n)
    ]
    return Job(
        chat=chat,
        model=names[0],
        req=GenRequest(seqs=seqs, hold_after=hold_after),
        stream=stream,
        prompts=prompts,
        n=n,
        return_token_ids=return_token_ids,
        return_weight_versions=return_weight_versions,
        logprobs=logprobs,
        include_usage=include_usage,
        request_id=("chatcmpl-" if chat else "cmpl-") + rid,
        created=int(time.time()),
    )


def parse_completion(
    body: Any, names: Sequence[str], max_model_len: int, request_id: str | None = None
) -> Job:
    """A ``/v1/completions`` body (``request_id``: the ``X-Request-Id`` header)."""
    return _parse(body, names, max_model_len, False, request_id)


def parse_chat(
    body: Any, names: Sequence[str], max_model_len: int, request_id: str | None = None
) -> Job:
    """A ``/v1/chat/completions`` body (``request_id``: the ``X-Request-Id`` header)."""
    return _parse(body, names, max_model_len, True, request_id)


# -- rendering ----------------------------------------------------------------------


def _usage(job: Job, details: bool = True) -> dict[str, Any]:
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(s.token_ids) for s in job.req.seqs)
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if details:
        usage.update(prompt_tokens_details=None, completion_tokens_details=None)
    return usage


def _top(token_id: int, k: int) -> list[tuple[str, float]]:
    """The ``k`` most likely words at a position: the sampled one first (greedy, so it
    is the top one), then fixed alternatives with lower logprobs."""
    ids = [token_id] + [(token_id + j) % len(WORDS) for j in range(1, k)]
    return [(" " + WORDS[t], -0.5 - j) for j, t in enumerate(ids)]


def _logprobs(job: Job, seq: Seq, start: int, end: int, offset: int) -> dict[str, Any] | None:
    if job.logprobs is None:
        return None
    ids = seq.token_ids[start:end]
    words = [" " + WORDS[t] for t in ids]
    if job.chat:
        return {
            "content": [
                {
                    "token": w,
                    "logprob": -0.5,
                    "bytes": list(w.encode()),
                    "top_logprobs": [
                        {"token": a, "logprob": lp, "bytes": list(a.encode())}
                        for a, lp in _top(t, job.logprobs)
                    ],
                }
                for t, w in zip(ids, words, strict=True)
            ]
        }
    offsets, pos = [], offset
    for w in words:
        offsets.append(pos)
        pos += len(w)
    return {
        "text_offset": offsets,
        "token_logprobs": [-0.5] * len(words),
        "tokens": words,
        "top_logprobs": [dict(_top(t, max(job.logprobs, 1))) for t in ids],
    }


def _prompt_ids(job: Job, seq: Seq) -> list[int]:
    return job.prompts[seq.index // job.n]


def _versions(job: Job, seq: Seq, choice: dict[str, Any]) -> dict[str, Any]:
    if job.return_weight_versions:
        choice["weight_versions"] = [dict(v) for v in seq.versions]
    return choice


def _final_choice(job: Job, seq: Seq) -> dict[str, Any]:
    """A choice of a non-streaming response (every key of vLLM's response model)."""
    ids = seq.token_ids if job.return_token_ids else None
    lp = _logprobs(job, seq, 0, len(seq.token_ids), 0)
    if job.chat:
        message = {
            "role": "assistant",
            "content": seq.text,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        choice = {
            "index": seq.index,
            "message": message,
            "logprobs": lp,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "token_ids": ids,
            "routed_experts": None,
        }
    else:
        choice = {
            "index": seq.index,
            "text": seq.text,
            "logprobs": lp,
            "finish_reason": seq.finish_reason,
            "stop_reason": seq.stop_reason,
            "token_ids": ids,
            "prompt_logprobs": None,
            "prompt_token_ids": _prompt_ids(job, seq) if job.return_token_ids else None,
            "routed_experts": None,
        }
    return _versions(job, seq, choice)


def render(job: Job) -> dict[str, Any]:
    """The non-streaming response body of a finished job."""
    out: dict[str, Any] = {
        "id": job.request_id,
        "object": "chat.completion" if job.chat else "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": [_final_choice(job, s) for s in job.req.seqs],
        "service_tier": None,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "usage": _usage(job),
    }
    if job.chat:
        out["prompt_logprobs"] = None
        out["prompt_token_ids"] = job.prompts[0] if job.return_token_ids else None
        out["prompt_text"] = None
    out.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
    return out


def _sse(obj: Any) -> bytes:
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))  # as pydantic writes
    return f"data: {text}\n\n".encode()


def _delta_choice(job: Job, seq: Seq, text: str, start: int, final: bool) -> dict[str, Any]:
    """One streamed choice, with the keys vLLM sets on it."""
    end = len(seq.token_ids)
    ids = seq.token_ids[start:end] if job.return_token_ids else None
    lp = _logprobs(job, seq, start, end, seq.sent_chars)
    if job.chat:
        choice: dict[str, Any] = {
            "index": seq.index,
            "delta": {"content": text},
            "logprobs": lp,
            "finish_reason": seq.finish_reason if final else None,
        }
        if final:
            choice["stop_reason"] = seq.stop_reason
        choice["token_ids"] = ids
    else:
        first = job.return_token_ids and start == 0
        choice = {
            "index": seq.index,
            "text": text,
            "logprobs": lp,
            "finish_reason": seq.finish_reason if final else None,
            "stop_reason": seq.stop_reason if final else None,
            "prompt_token_ids": _prompt_ids(job, seq) if first else None,
            "token_ids": ids,
        }
    return _versions(job, seq, choice) if final else choice


async def stream(job: Job, engine: Engine) -> AsyncIterator[bytes]:
    """The SSE body of a streaming job: chunks, optional usage, then ``[DONE]``."""
    kind = "chat.completion.chunk" if job.chat else "text_completion"

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": job.request_id,
            "object": kind,
            "created": job.created,
            "model": job.model,
            "choices": choices,
            **extra,
        }

    if job.chat:  # the role chunk of every choice
        for s in job.req.seqs:
            first = {
                "index": s.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            ids = job.prompts[0] if job.return_token_ids else None
            yield _sse(chunk([first], prompt_token_ids=ids, prompt_text=None))
    try:
        async with engine.steps(job.req) as steps:
            async for _ in steps:
                for s in job.req.seqs:
                    final = s.finish_reason is not None and not s.final_sent
                    upto = s.visible()
                    if upto == s.sent_chars and len(s.token_ids) == s.sent_tokens and not final:
                        continue
                    text = s.text[s.sent_chars : upto]
                    choice = _delta_choice(job, s, text, s.sent_tokens, final)
                    s.sent_chars, s.sent_tokens = upto, len(s.token_ids)
                    s.final_sent = s.final_sent or final
                    extra = {}
                    if final and not job.include_usage:
                        extra["system_fingerprint"] = SYSTEM_FINGERPRINT
                    yield _sse(chunk([choice], **extra))
    except Exception as e:  # the engine core died mid-stream
        status = e.status if isinstance(e, EngineError) else 500
        yield _sse(error_body(str(e), status))
    else:
        if job.include_usage:
            usage = _usage(job, details=False)
            yield _sse(chunk([], usage=usage, system_fingerprint=SYSTEM_FINGERPRINT))
    yield b"data: [DONE]\n\n"
