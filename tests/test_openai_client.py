"""The dispatcher's front as the official `openai` client sees it (issue 15, item 3).

Shapes (no I/O): `dispatcher.oai`'s bodies, by table. In process: the real front (its lean
HTTP/1.1 server) over a turn loop that is never run, for what is answered before any
turn: `GET /v1/models`, every error (validation, unknown revision, unknown route, wrong
method, requests the server itself refuses) in OpenAI's JSON error format. End to end: a
real dispatcher in a real stack (slicerd on the fake GPU, the vLLM stub under the
launcher) serves completions, chat, streams with `include_usage` and prompt lists to
`openai.OpenAI`, every answer naming the revision that served it.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
import trio

from gpu_slicer.dispatcher.core import parse_body
from gpu_slicer.dispatcher.errors import BadRequest, NotFound, StoreError, UnknownRevision, quoted
from gpu_slicer.dispatcher.http import (
    MAX_BODY_BYTES,
    _id_comments,
    error_response,
)
from gpu_slicer.dispatcher.httphead import error_json
from gpu_slicer.dispatcher.model import Revision
from gpu_slicer.dispatcher.oai import (
    chunks,
    include_usage,
    merge_results,
    models_body,
    param_of,
    split_prompts,
    sum_usage,
    usage_chunk,
    with_model,
)
from gpu_slicer.dispatcher.turns import TurnLoop
from tests.harness import running_stack
from tests.test_dispatcher import dispatcher, publish, replica
from tests.test_dispatcher_events import loop_front
from tests.test_dispatcher_journal import journal_loop
from tests.test_dispatcher_vllm import FakeVllm

T = TypeVar("T")

# The client's platform headers run `uname -p` (a child process) once per process, and
# only integration tests may start one: it runs here, at collection, instead.
platform.processor()

# -- shapes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "spliced"),
    [
        (b'{"id":"cmpl-1","object":"text_completion","created":5,"model":"m","choices":[]}',
         True),
        (b'{"id":"a\\"b","model":"m","choices":[]}', False),  # an escape before the key
        (b'{"x":{"model":"inner"},"model":"m"}', False),  # a nested value before it
        (b'{"choices":[{"model":"m"}],"model":"m"}', False),
        (b'{"id": "x", "model": "m"}', False),  # not vLLM's compact layout
        (b'{"id":"x","model":"a\\u00e9"}', False),  # an escape inside the name
    ],
    ids=["vllm", "escape-before", "nested-before", "in-choices", "spaced", "escaped-name"],
)  # fmt: skip
def test_the_model_is_set_in_vllms_bytes_in_place_or_by_parsing(raw: bytes, spliced: bool) -> None:
    assert with_model(b'{"id":"x","choices":[]}', "a@b") == b'{"id":"x","choices":[]}'  # none
    out = with_model(raw, "llama@step-1")
    body = json.loads(out)
    assert body["model"] == "llama@step-1"
    original = json.loads(raw)
    original["model"] = "llama@step-1"
    assert body == original  # nothing else changed, the nested "model" keys included
    if spliced:
        assert out == raw.replace(b'"model":"m"', b'"model":"llama@step-1"')


def _refused(kind: str, body: dict[str, Any]) -> BadRequest:
    """The error the store's validation raises for ``body``."""
    try:
        parse_body(kind, body, 1000, 1000)
    except BadRequest as e:
        return e
    raise AssertionError(f"{body} was accepted")


def test_a_long_value_in_a_message_keeps_its_quotes() -> None:
    assert quoted("a" * 300, 200) == repr("a" * 200) + "..."
    assert quoted("short") == "'short'" and quoted(7) == "7"
    assert quoted(list(range(100)), 10) == "[0, 1, 2, ..."
    e = _refused("completion", {"prompt": "x", "model": "m" * 300 + "@"})
    assert str(e).startswith("model '" + "m" * 200 + "'... ends with '@'")


@pytest.mark.parametrize(
    ("prompt", "wanted"),
    [
        ([["a"], ["b"]], r"^prompt\[0\] must be a string or a list of token ids, got \['a'\]"),
        ([["a", "b"], ["c"]], r"^prompt\[0\] must be a string or a list of token ids"),
        ([[1, 2], [3, "x"]], r"^prompt\[1\] must be a string or a list of token ids"),
    ],
)
def test_a_prompt_list_holds_strings_or_token_lists_only(prompt: Any, wanted: str) -> None:
    with pytest.raises(BadRequest, match=wanted) as e:
        split_prompts(prompt)
    assert param_of(e.value) == "prompt"


def test_one_sample_with_many_prompts_points_to_the_list_routes() -> None:
    e = _refused("completion", {"prompt": ["a", "b"]})  # POST /v1/samples takes one prompt
    assert "send them as one POST /v1/completions (a prompt list) or POST /v1/samples/batch" in (
        str(e)
    )
    e = _refused("completion", {"prompt": [["a"]]})  # no batch of one: no prompt at all
    assert str(e).startswith("prompt[0] must be a string or a list of token ids")
    assert parse_body("completion", {"prompt": [[5, 6]]}, 10, 10).prompt.tolist() == [5, 6]  # type: ignore[union-attr]


def test_a_streamed_lists_ids_come_in_bounded_comment_lines() -> None:
    ids = [f"smp-{i:04d}" for i in range(600)]
    lines = _id_comments(ids)
    assert len(lines) == 3 and all(x.startswith(b": sample_ids ") for x in lines)
    assert all(x.endswith(b"\n\n") for x in lines)
    got = [i for x in lines for i in x[len(b": sample_ids ") :].decode().split()[0].split(",")]
    assert got == ids


@pytest.mark.parametrize(
    ("exc", "param"),
    [
        (BadRequest("max_tokens must be a positive integer, got 0"), "max_tokens"),
        (BadRequest("missing field 'prompt'"), "prompt"),
        (BadRequest("prompt[3] must not be empty"), "prompt"),
        (BadRequest("messages[0].role must be a string"), "messages"),
        (BadRequest("requests[2]: n must be an integer from 1 to 16, got 0"), "n"),
        (BadRequest("malformed JSON body: Expecting value"), None),
        (BadRequest("whatever", param="stop"), "stop"),
        (UnknownRevision("no revision 'x' in pool 'p'"), "model"),
        (NotFound("no sample 'smp-x'"), None),
        (_refused("completion", {"prompt": "x", "model": "sampler@"}), "model"),
        (_refused("completion", {"prompt": "x", "messages": []}), "messages"),
        (_refused("chat", {"messages": [{"role": "u"}], "prompt": "x"}), "prompt"),
    ],
)  # fmt: skip
def test_an_errors_param_names_the_field_at_fault(exc: Any, param: str | None) -> None:
    assert param_of(exc) == param
    body = json.loads(bytes(error_response(exc).body))
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and body["error"]["message"] == str(exc)


def test_an_answer_by_status_alone_is_an_openai_error() -> None:
    assert json.loads(error_json(431, "request head too large")) == {"error": {
        "message": "request head too large", "type": "RequestHeaderFieldsTooLargeError",
        "param": None, "code": "request_header_fields_too_large"}}  # fmt: skip
    assert json.loads(error_json(404, "no route GET /x"))["error"]["type"] == "NotFoundError"
    assert json.loads(error_json(405, "m"))["error"]["code"] == "method_not_allowed"


def test_models_are_newest_first_as_name_at_revision() -> None:
    revs = [Revision("r1", "/c/1", 100.5), Revision("r2", "/c/2", 200.0)]
    body = models_body("llama", revs)
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["created"]) for m in body["data"]] == [
        ("llama@r2", "model", 200), ("llama@r1", "model", 100)]  # fmt: skip
    assert all(m["owned_by"] for m in body["data"])
    assert models_body("llama", []) == {"object": "list", "data": []}


def test_a_prompt_list_is_split_only_when_it_is_a_batch() -> None:
    assert split_prompts("one") is None
    assert split_prompts([1, 2, 3]) is None  # the token ids of one prompt
    assert split_prompts(["one"]) is None  # a batch of one: the store unwraps it
    assert split_prompts(["a", "b"]) == ["a", "b"]
    assert split_prompts([[1], [2, 3]]) == [[1], [2, 3]]
    with pytest.raises(BadRequest, match="mixes") as e:
        split_prompts(["a", [1]])
    assert param_of(e.value) == "prompt"


def test_merged_choices_are_numbered_prompt_times_n_plus_j_and_usage_is_summed() -> None:
    def body(id: str, texts: list[str], tokens: int, **extra: Any) -> dict[str, Any]:
        choices = [{"index": j, "text": t, "finish_reason": "length"} for j, t in enumerate(texts)]
        choices.reverse()  # the order vLLM lists them in does not matter, the index does
        usage = {"prompt_tokens": tokens, "completion_tokens": 2, "total_tokens": tokens + 2}
        return {"id": id, "object": "text_completion", "created": 7, "model": "m",
                "choices": choices, "usage": usage, **extra}  # fmt: skip

    out = merge_results(
        [body("c1", ["a0", "a1"], 3), body("c2", ["b0", "b1"], 4)], "llama@r1", ["s1", "s2"]
    )
    assert [(c["index"], c["text"]) for c in out["choices"]] == [
        (0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")]  # fmt: skip
    assert out["model"] == "llama@r1" and out["sample_ids"] == ["s1", "s2"]
    assert out["usage"] == {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}
    # Two parts of one --batch-prompts send share its usage: it counts once.
    shared = [body("c9", ["x"], 5, batch={"size": 2, "position": i}) for i in range(2)]
    assert sum_usage(shared) == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert sum_usage([{"choices": []}]) is None


def test_stream_chunks_and_the_usage_chunk() -> None:
    result = {"id": "chatcmpl-1", "created": 3, "model": "m", "usage": {"prompt_tokens": 1,
              "completion_tokens": 2, "total_tokens": 3},
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                           "finish_reason": "stop"}]}  # fmt: skip
    (chunk,) = chunks("chat", result, "llama@r1", first_index=4, usage=True)
    assert chunk["object"] == "chat.completion.chunk" and chunk["model"] == "llama@r1"
    assert chunk["choices"] == [{"index": 4, "delta": {"role": "assistant", "content": "hi"},
                                 "finish_reason": "stop"}]  # fmt: skip
    assert chunk["usage"] is None
    last = usage_chunk("chat", [result], "llama@r1")
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 3
    assert "usage" not in chunks("completion", result, "m")[0]


@pytest.mark.parametrize(
    ("body", "stream", "wanted"),
    [
        ({}, False, False),
        ({"stream_options": None}, False, False),
        ({"stream_options": {"include_usage": True}}, True, True),
        ({"stream_options": {}}, True, False),
        ({"stream_options": {}}, False, False),  # as vLLM: only options that ask refuse
        ({"stream_options": {"include_usage": True}}, False, "only be given with stream"),
        ({"stream_options": []}, True, "must be an object"),
        ({"stream_options": {"include_usage": 1}}, True, "true or false"),
    ],
)
def test_stream_options(body: dict[str, Any], stream: bool, wanted: bool | str) -> None:
    if isinstance(wanted, bool):
        assert include_usage(body, stream) is wanted
    else:
        with pytest.raises(BadRequest, match=wanted) as e:
            include_usage(body, stream)
        assert param_of(e.value) == "stream_options"


# -- in process: what is answered before any turn ------------------------------------


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)


async def _call(fn: Callable[[], T]) -> T:
    return await trio.to_thread.run_sync(fn)


def _refusal(fn: Callable[[], object]) -> Callable[[], openai.APIStatusError]:
    """``fn`` run for the error it must raise (the error, or AssertionError)."""

    def run() -> openai.APIStatusError:
        try:
            fn()
        except openai.APIStatusError as e:
            return e
        raise AssertionError("no error")

    return run


def _publish(loop: TurnLoop, tmp_path: Path, rev: str) -> None:
    path = tmp_path / "ckpt" / rev
    path.mkdir(parents=True)
    (path / "revision.txt").write_text(rev)
    loop.publish(rev, str(path))


async def test_models_list_every_published_revision_newest_first(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with loop_front(tmp_path, model="llama") as (loop, url):
            client = _client(url)
            assert (await _call(client.models.list)).data == []
            for rev in ("step-1", "step-2", "step-3"):
                _publish(loop, tmp_path, rev)
            models = (await _call(client.models.list)).data
            assert [m.id for m in models] == ["llama@step-3", "llama@step-2", "llama@step-1"]
            assert all(m.object == "model" and m.owned_by and m.created > 0 for m in models)
            one = await _call(lambda: client.models.retrieve("llama@step-2"))
            assert one.id == "llama@step-2"
            e = await _call(_refusal(lambda: client.models.retrieve("llama@step-9")))
            assert isinstance(e, openai.NotFoundError) and "llama@step-9" in e.message


async def test_every_error_is_an_openai_error(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with loop_front(tmp_path, model="llama") as (loop, url):
            _publish(loop, tmp_path, "r1")
            client = _client(url)

            def refused(fn: Callable[[], object]) -> Any:
                return _call(_refusal(fn))

            # An unknown route, a method the route does not take.
            e = await refused(client.files.list)
            assert isinstance(e, openai.NotFoundError)
            assert "no route GET /v1/files" in e.message and e.code == "not_found"
            e = await refused(lambda: client.models.delete("llama@r1"))
            assert e.status_code == 405 and "DELETE is not allowed" in e.message
            assert set(e.response.headers["allow"].split(", ")) == {"GET", "HEAD"}
            # Validation: the field at fault is the param.
            e = await refused(
                lambda: client.completions.create(model="llama", prompt="x", max_tokens=0)
            )
            assert isinstance(e, openai.BadRequestError) and e.param == "max_tokens"
            assert "max_tokens must be a positive integer" in e.message
            e = await refused(
                lambda: client.completions.create(model="llama", prompt=["a", "", "c"])
            )
            assert isinstance(e, openai.BadRequestError) and e.param == "prompt"
            assert e.body["message"].startswith("prompt[1] must not be empty"), e.body
            msgs: Any = [{"role": "user", "content": "hi"}]
            e = await refused(
                lambda: client.chat.completions.create(
                    model="llama", messages=msgs, stream_options={"include_usage": True}
                )
            )
            assert isinstance(e, openai.BadRequestError) and e.param == "stream_options"
            # An unknown revision, alone or in a prompt list: like vLLM's unknown model.
            for prompt in ("x", ["a", "b"]):
                e = await refused(
                    lambda p=prompt: client.completions.create(model="llama@nope", prompt=p)
                )
                assert isinstance(e, openai.NotFoundError) and e.param == "model"
                assert "nope" in e.message and not e.body["message"].startswith("requests[")
            assert loop.store.counts().get("pending", 0) == 0  # nothing refused was journaled

            # What the lean server refuses itself, and a body over the limit.
            async with httpx.AsyncClient(base_url=url) as http:
                r = await http.post(
                    "/v1/completions", content=b"{", headers={"content-type": "application/json"}
                )
                assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"
            for head, status, message in [
                (b"GARBAGE\r\n\r\n", 400, "malformed request line"),
                (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * (65 << 10) + b"\r\n\r\n", 431,
                 "request head too large"),
                (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501,
                 None),
                (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"Content-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1), 413, None),
            ]:  # fmt: skip
                got_status, body = await _raw(url, head)
                assert got_status == status, body
                err = json.loads(body)["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert err["type"].endswith("Error") and err["code"]
                assert message is None or err["message"] == message


async def _raw(url: str, request: bytes) -> tuple[int, bytes]:
    """Send ``request`` as bytes; the status and body of the answer (the server closes)."""
    host, port = url.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(request)
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return int(head.split(b" ", 2)[1]), body


# -- end to end --------------------------------------------------------------------------


@pytest.mark.integration
async def test_the_openai_client_against_a_running_dispatcher() -> None:
    """Completions, chat, both streamed with `include_usage`, and prompt lists (with n=2,
    plain and streamed) through the official client; every answer's `model` is the
    revision that served it, NAME@REV (NAME: the pool, no `--model` given)."""
    with trio.fail_after(120):
        async with running_stack() as stack, replica(stack) as (_, url):
            async with dispatcher(stack, url) as (_d, http):
                await publish(stack, http, "r1")
                client = _client(str(http.base_url).rstrip("/"))
                chat_msgs: Any = [{"role": "user", "content": "hi there"}]
                prompts = ["one two", "three four five", "six"]
                calls: dict[str, Callable[[], Any]] = {
                    "completion": lambda: client.completions.create(
                        model="v@r1", prompt="2 + 2 =", max_tokens=8, seed=1),
                    "chat": lambda: client.chat.completions.create(
                        model="v@r1", messages=chat_msgs, max_tokens=8),
                    "batch": lambda: client.completions.create(
                        model="v@r1", prompt=prompts, n=2, max_tokens=4, seed=3),
                    "stream": lambda: list(client.completions.create(
                        model="v@r1", prompt="2 + 2 =", max_tokens=8, seed=1, stream=True,
                        stream_options={"include_usage": True})),
                    "chat_stream": lambda: list(client.chat.completions.create(
                        model="v@r1", messages=chat_msgs, max_tokens=8, stream=True,
                        stream_options={"include_usage": True})),
                    "batch_stream": lambda: list(client.completions.create(
                        model="v", prompt=[[1, 2, 3], [4, 5]], max_tokens=4, seed=2,
                        stream=True, stream_options={"include_usage": True})),
                    "batch_ids": lambda: client.completions.create(
                        model="v", prompt=[[1, 2, 3], [4, 5]], max_tokens=4, seed=2),
                    **{f"single{i}": (lambda p=p: client.completions.create(
                        model="v@r1", prompt=p, n=2, max_tokens=4, seed=3))
                       for i, p in enumerate(prompts)},
                }  # fmt: skip
                got: dict[str, Any] = {}

                async def run(key: str, fn: Callable[[], Any]) -> None:
                    got[key] = await _call(fn)

                async with trio.open_nursery() as nursery:  # concurrent: one turn serves all
                    for key, fn in calls.items():
                        nursery.start_soon(run, key, fn)

                comp, chat = got["completion"], got["chat"]
                assert comp.model == "v@r1" and comp.choices[0].text
                assert chat.model == "v@r1" and chat.choices[0].message.content

                # A prompt list: prompt i's choice j is choice i*n + j, as if sent alone.
                batch = got["batch"]
                assert batch.model == "v@r1"
                assert [c.index for c in batch.choices] == list(range(6))
                singles = [got[f"single{i}"] for i in range(3)]
                assert [c.text for c in batch.choices] == [
                    c.text for s in singles for c in s.choices]  # fmt: skip
                assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
                assert batch.usage.total_tokens == sum(s.usage.total_tokens for s in singles)
                assert len(batch.model_extra["sample_ids"]) == 3

                # Streams: the choices, then one chunk with no choices and the usage.
                for key, whole in (("stream", comp), ("chat_stream", chat)):
                    stream = got[key]
                    assert all(c.model == "v@r1" for c in stream)
                    *parts, last = stream
                    assert last.choices == [] and last.usage == whole.usage
                    assert all(c.choices and c.usage is None for c in parts)
                texts = [c.choices[0].text for c in got["stream"][:-1]]
                assert "".join(texts) == comp.choices[0].text
                deltas = [c.choices[0].delta.content or "" for c in got["chat_stream"][:-1]]
                assert "".join(deltas) == chat.choices[0].message.content
                *parts, last = got["batch_stream"]
                plain = got["batch_ids"]
                assert sorted(c.choices[0].index for c in parts) == [0, 1]
                assert {c.choices[0].index: c.choices[0].text for c in parts} == {
                    c.index: c.text for c in plain.choices}  # fmt: skip
                assert last.usage == plain.usage and last.model == "v@r1"

                # A request that names no revision gets the newest; its answer says which.
                await publish(stack, http, "r2")
                models = await _call(client.models.list)
                assert [m.id for m in models.data] == ["v@r2", "v@r1"]
                newest = await _call(
                    lambda: client.completions.create(model="v", prompt="hi", max_tokens=2)
                )
                assert newest.model == "v@r2"
                e = await _call(_refusal(
                    lambda: client.completions.create(model="v@r9", prompt="hi")))  # fmt: skip
                assert isinstance(e, openai.NotFoundError) and "r9" in e.message
            assert stack.overlaps() == 0


# -- in process, served: prompt lists a client can get back to ------------------------


def _ids_and_refusals(fake: FakeVllm) -> Callable[[httpx.Request], httpx.Response]:
    """The fake vLLM giving each answer its own ``id`` (as vLLM does) and refusing, 400,
    a prompt holding token 666."""
    sent = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal sent
        if request.url.path != "/v1/completions":
            return fake(request)
        if 666 in json.loads(request.content)["prompt"]:
            cursed = {"message": "token 666 is cursed", "type": "BadRequestError", "param": None}
            return httpx.Response(400, json={"error": {**cursed, "code": 400}})
        out = fake(request)
        sent += 1
        return httpx.Response(200, json={**out.json(), "id": f"cmpl-{sent}", "created": 1})

    return handler


def _events_of(text: str) -> list[str]:
    return [line for line in text.split("\n\n") if line]


async def test_a_prompt_list_names_its_samples_before_and_after_a_failure(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with journal_loop(tmp_path, turns=True, wrap=_ids_and_refusals) as (_, http):
            body: dict[str, Any] = {"prompt": [[1], [2], [3]], "max_tokens": 2}
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-sample-ids"].split(",") == r.json()["sample_ids"]

            # Streamed: the ids first (a comment line), then chunks that share one id.
            r = await http.post("/v1/completions", json={**body, "stream": True})
            events = _events_of(r.text)
            ids = r.headers["x-sample-ids"].split(",")
            assert events[0] == ": sample_ids " + ",".join(ids) and len(ids) == 3
            data = [json.loads(e[6:]) for e in events[1:-1]]
            assert len(data) == 3 and len({d["id"] for d in data}) == 1, data
            assert events[-1] == "data: [DONE]"

            # One refused prompt: the request fails, naming it and every prompt's sample;
            # the other prompts' results are kept and fetched by those ids.
            r = await http.post("/v1/completions", json={**body, "prompt": [[1], [666], [3]]})
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["message"].startswith("prompt[1] failed: "), err
            assert "token 666 is cursed" in err["message"] and err["param"] == "prompt"
            assert "POST /v1/samples/results" in err["message"]
            assert r.headers["x-sample-ids"].split(",") == err["sample_ids"]
            r = await http.post("/v1/samples/results", json={"ids": err["sample_ids"]})
            got = r.json()["results"]
            assert [x["status"] for x in got] == ["done", "failed", "done"]
            assert got[0]["result"]["choices"][0]["text"] == "ab"


async def test_a_store_error_mid_stream_ends_it_with_an_error_and_done(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with journal_loop(tmp_path, turns=True, wrap=_ids_and_refusals) as (loop, http):
            real = loop.wait_result
            seen: list[str] = []

            async def flaky(id: str, timeout: float) -> Any:
                if id not in seen:
                    seen.append(id)
                if id != seen[0]:
                    raise StoreError("cannot read the dispatch store: disk I/O error")
                return await real(id, timeout)

            loop.wait_result = flaky  # type: ignore[method-assign]
            body = {"prompt": [[1], [2]], "max_tokens": 2, "stream": True}
            r = await http.post("/v1/completions", json=body)
            events = _events_of(r.text)
            assert events[0].startswith(": sample_ids ")
            assert json.loads(events[1][6:])["choices"][0]["text"] == "ab"  # prompt 0's
            err = json.loads(events[2][6:])["error"]
            assert err["code"] == "store_error" and err["message"].startswith("prompt[1] failed: ")
            assert events[3:] == ["data: [DONE]"]


async def test_stream_is_checked_before_its_options_and_errors_name_their_field(
    tmp_path: Path,
) -> None:
    with trio.fail_after(30):
        async with loop_front(tmp_path, model="llama") as (loop, url):
            _publish(loop, tmp_path, "r1")
            async with httpx.AsyncClient(base_url=url) as http:

                async def error(body: dict[str, Any], path: str = "/v1/completions") -> Any:
                    r = await http.post(path, json=body)
                    assert r.status_code == 400, r.text
                    return r.json()["error"]

                opts = {"include_usage": True}
                e = await error({"prompt": "x", "stream": "true", "stream_options": opts})
                assert e["message"] == "stream must be true or false, got 'true'"
                assert e["param"] == "stream"
                e = await error({"prompt": "x", "model": "llama@"})
                assert e["param"] == "model" and "ends with '@'" in e["message"]
                e = await error({"prompt": "x", "messages": []})
                assert e["param"] == "messages"
                e = await error({"prompt": [["a"], ["b"]]})
                assert e["param"] == "prompt" and e["message"].startswith("prompt[0] must be")
            client = _client(url)
            # stream_options {} without stream is accepted, as vLLM does: it waits for a
            # turn (none runs here), so only its journaling is checked.
            p = await loop.accept("completion", {"prompt": "x", "stream_options": {}})
            assert p.id
            long = "llama@" + "x" * 300
            e = await _call(_refusal(lambda: client.models.retrieve(long)))
            assert f"the model {quoted(long, 200)} does not exist" in e.message
