"""OpenAI-compatible /v1/completions and /v1/chat/completions: parse, run, render.

Bodies follow vLLM 0.33's protocol models: unknown fields are ignored (vLLM logs a
warning), bad values are 400 ``BadRequestError``s, a prompt plus ``max_tokens`` past
``--max-model-len`` is a 400 like vLLM's. ``return_token_ids`` adds
``prompt_token_ids`` and ``token_ids``; ``return_weight_versions`` adds
``weight_versions`` (on the last chunk only when streaming).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from stubs.vllm_stub.engine import Engine, EngineError, GenRequest, Seq
from stubs.vllm_stub.textgen import tokenize

__all__ = ["Job", "parse_chat", "parse_completion", "render", "stream"]


def _bad(message: str) -> EngineError:
    return EngineError(message, 400)


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


def _int(body: dict[str, Any], name: str, default: int | None, lo: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"{name} must be an integer, got {value!r}")
    if value < lo:
        raise _bad(f"{name} must be at least {lo}, got {value}.")
    return value


def _prompts(prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenize(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [tokenize(p) for p in prompt]
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and all(isinstance(t, int) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise _bad("prompt must be a str, [str], [int] or [[int]] (non-empty)")


def _chat_prompt(messages: Any) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list")
    parts: list[str] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad("each message needs a string 'role'")
        content = m.get("content", "")
        if isinstance(content, list):
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise _bad("message content must be a string or a list of parts")
        parts.append(f"<|{m['role']}|> {content}")
    parts.append("<|assistant|>")
    return tokenize(" ".join(parts))


def _common(
    body: Any, served: str, max_model_len: int, chat: bool, prompts: list[list[int]] | None
) -> Job:
    model = body.get("model")
    if model is not None and model != served:
        raise EngineError(f"The model `{model}` does not exist.", 404)
    if prompts is None:
        prompts = [_chat_prompt(body.get("messages"))]
    n = _int(body, "n", 1, 1) or 1
    seed = _int(body, "seed", 0, -(2**63)) or 0
    longest = max(len(p) for p in prompts)
    default_max = 16 if not chat else max(1, max_model_len - longest)
    key = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _int(body, key, default_max, 1) or default_max
    if longest + max_tokens > max_model_len:
        raise _bad(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {longest + max_tokens} tokens ({longest} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages "
            "or completion."
        )
    for name, lo, hi in (("temperature", 0.0, 1e9), ("top_p", 1e-9, 1.0)):
        v = body.get(name)
        if v is not None and (not isinstance(v, int | float) or not lo <= v <= hi):
            raise _bad(f"{name} must be in [{lo}, {hi}], got {v!r}.")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("stop must be a string or a list of strings")
    if chat:
        logprobs = _int(body, "top_logprobs", 0, 0) if body.get("logprobs") else None
    else:
        logprobs = _int(body, "logprobs", None, 0)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream must be a boolean")
    opts = body.get("stream_options") or {}
    seqs = [
        Seq(index=p * n + i, prompt_ids=ids, max_tokens=max_tokens, stop=stop, seed=seed)
        for p, ids in enumerate(prompts)
        for i in range(n)
    ]
    rid = body.get("request_id") or uuid.uuid4().hex
    return Job(
        chat=chat,
        model=served,
        req=GenRequest(seqs=seqs),
        stream=stream,
        prompts=prompts,
        n=n,
        return_token_ids=bool(body.get("return_token_ids")),
        return_weight_versions=bool(body.get("return_weight_versions")),
        logprobs=logprobs,
        include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
        request_id=("chatcmpl-" if chat else "cmpl-") + str(rid),
        created=int(time.time()),
    )


def parse_completion(body: Any, served: str, max_model_len: int) -> Job:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    if "prompt" not in body:
        raise _bad("Field required: prompt")
    return _common(body, served, max_model_len, False, _prompts(body["prompt"]))


def parse_chat(body: Any, served: str, max_model_len: int) -> Job:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    return _common(body, served, max_model_len, True, None)


def _usage(job: Job) -> dict[str, Any]:
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(s.token_ids) for s in job.req.seqs)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
    }


def _logprobs(job: Job, seq: Seq, start: int, end: int, offset: int) -> dict[str, Any] | None:
    if job.logprobs is None:
        return None
    from stubs.vllm_stub.textgen import WORDS

    words = [" " + WORDS[t] for t in seq.token_ids[start:end]]
    if job.chat:
        return {
            "content": [
                {
                    "token": w,
                    "logprob": -0.5,
                    "bytes": list(w.encode()),
                    "top_logprobs": [{"token": w, "logprob": -0.5, "bytes": list(w.encode())}]
                    * min(job.logprobs, 1),
                }
                for w in words
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
        "top_logprobs": [{w: -0.5} for w in words] if job.logprobs else None,
    }


def _choice(job: Job, seq: Seq, *, text: str, start: int, end: int, final: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": seq.index}
    if job.chat:
        key = "delta" if job.stream else "message"
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if not job.stream:
            msg.update(reasoning_content=None, tool_calls=[])
        choice[key] = msg
    else:
        choice["text"] = text
    choice["logprobs"] = _logprobs(job, seq, start, end, seq.sent_chars)
    choice["finish_reason"] = seq.finish_reason if final else None
    choice["stop_reason"] = seq.stop_reason if final else None
    if job.return_token_ids:
        choice["token_ids"] = seq.token_ids[start:end]
        if not job.chat and (start == 0 or not job.stream):
            choice["prompt_token_ids"] = job.prompts[seq.index // job.n]
    if job.return_weight_versions and final:
        choice["weight_versions"] = [dict(v) for v in seq.versions]
    return choice


def render(job: Job) -> dict[str, Any]:
    """The non-streaming response body of a finished job."""
    out: dict[str, Any] = {
        "id": job.request_id,
        "object": "chat.completion" if job.chat else "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": [
            _choice(job, s, text=s.text, start=0, end=len(s.token_ids), final=True)
            for s in job.req.seqs
        ],
        "usage": _usage(job),
    }
    if job.chat and job.return_token_ids:
        out["prompt_token_ids"] = job.prompts[0]
    return out


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def stream(job: Job, engine: Engine) -> AsyncIterator[bytes]:
    """The SSE body of a streaming job: chunks, optional usage, then ``[DONE]``."""
    kind = "chat.completion.chunk" if job.chat else "text_completion"

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": job.request_id,
            "object": kind,
            "created": job.created,
            "model": job.model,
            "choices": choices,
        }

    if job.chat:
        first = []
        for s in job.req.seqs:
            c: dict[str, Any] = {
                "index": s.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            if job.return_token_ids:
                c["token_ids"] = []
            first.append(c)
        head = chunk(first)
        if job.return_token_ids:
            head["prompt_token_ids"] = job.prompts[0]
        yield _sse(head)
    try:
        async with engine.steps(job.req) as steps:
            async for _ in steps:
                choices = []
                for s in job.req.seqs:
                    final = s.finish_reason is not None and not s.final_sent
                    upto = s.visible()
                    if upto == s.sent_chars and len(s.token_ids) == s.sent_tokens and not final:
                        continue
                    choices.append(
                        _choice(
                            job,
                            s,
                            text=s.text[s.sent_chars : upto],
                            start=s.sent_tokens,
                            end=len(s.token_ids),
                            final=final,
                        )
                    )
                    s.sent_chars, s.sent_tokens = upto, len(s.token_ids)
                    s.final_sent = s.final_sent or final
                if choices:
                    yield _sse(chunk(choices))
    except Exception as e:  # the engine core died mid-stream
        status = e.status if isinstance(e, EngineError) else 500
        error = {"message": str(e), "type": "InternalServerError", "param": None, "code": status}
        yield _sse({"error": error})
    else:
        if job.include_usage:
            yield _sse({**chunk([]), "usage": _usage(job)})
    yield b"data: [DONE]\n\n"
