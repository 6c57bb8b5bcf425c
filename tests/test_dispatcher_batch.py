"""Batched prompts (``slicer-dispatch --batch-prompts N``): completion samples with the
same params go to vLLM as ONE request with a list of prompts, and each sample gets its
own part of the answer, judged and committed on its own.

The split is table-tested (``core.split_batch``); the serving half runs against a fake
replica that answers prompt lists as vLLM does (choice ``index = position * n + j``);
one test runs the real stack (the vLLM stub refuses a prompt past ``--max-model-len``).
"""

from __future__ import annotations

import array
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from gpu_slicer.dispatcher.core import batch_key, batch_request_body, split_batch
from gpu_slicer.dispatcher.model import Pending, TurnConfig
from gpu_slicer.dispatcher.store import Store
from gpu_slicer.dispatcher.turns import TurnLoop
from tests.harness import running_stack
from tests.test_dispatcher import dispatcher, publish, replica, status, stop
from tests.test_dispatcher_vllm import FakeVllm, _err, held_loop

# -- the split, by table -----------------------------------------------------------------

TOP = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m"}
USAGE = {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}


def _answer(indexes: list[Any]) -> dict[str, Any]:
    choices = [{"index": i, "text": f"t{i}", "finish_reason": "length"} for i in indexes]
    return {**TOP, "choices": choices, "usage": USAGE}


def _part(texts: list[str], k: int, pos: int) -> dict[str, Any]:
    choices = [{"index": j, "text": t, "finish_reason": "length"} for j, t in enumerate(texts)]
    return {**TOP, "choices": choices, "usage": USAGE, "batch": {"size": k, "position": pos}}


SPLITS = [
    # (choices' indexes as vLLM sent them, k, n, each sample's texts; None: refused)
    ([0, 1, 2], 3, 1, [["t0"], ["t1"], ["t2"]]),
    ([2, 0, 1], 3, 1, [["t0"], ["t1"], ["t2"]]),  # any order: by index
    ([0, 1, 2, 3, 4, 5], 3, 2, [["t0", "t1"], ["t2", "t3"], ["t4", "t5"]]),
    ([5, 3, 4, 1, 2, 0], 3, 2, [["t0", "t1"], ["t2", "t3"], ["t4", "t5"]]),
    ([1, 0], 1, 2, [["t0", "t1"]]),
    ([0, 1], 3, 1, None),  # a choice missing: the count is not k*n
    ([0, 1, 2, 3], 3, 1, None),  # one too many
    ([0, 1, 1], 3, 1, None),  # a duplicate
    ([0, 1, 3], 3, 1, None),  # out of range
    ([0, 1, -1], 3, 1, None),
    ([0, 1, "2"], 3, 1, None),  # not an int
    ([0, 1, True], 3, 1, None),  # JSON true is no index
    ([0, 1, None], 3, 1, None),
    ([0, 1, 2, 3, 4], 3, 2, None),  # 5 is not 3*2
]


@pytest.mark.parametrize("indexes,k,n,texts", SPLITS)
def test_split_batch(indexes: list[Any], k: int, n: int, texts: list[list[str]] | None) -> None:
    got = split_batch(_answer(indexes), k, n)
    if texts is None:
        assert got is None
    else:
        assert got == [_part(t, k, pos) for pos, t in enumerate(texts)]


@pytest.mark.parametrize(
    "answer", [{}, {"choices": None}, {"choices": {"0": {}}}, {"choices": [1, 2]}]
)
def test_split_batch_refuses_what_has_no_choice_list(answer: dict[str, Any]) -> None:
    assert split_batch(answer, 2, 1) is None


def _pending(
    prompt: array.array[int] | bytes, params: dict[str, Any], kind: str = "completion"
) -> Pending:
    return Pending("smp-1", "p", "r1", kind, params, prompt, None, 0.0, 1.0, 0)


def test_batch_key_needs_the_same_params_and_prompt_form() -> None:
    ids, text = array.array("i", [1, 2]), b"hi"
    same = batch_key(_pending(ids, {"max_tokens": 2, "n": 1}))
    assert batch_key(_pending(array.array("i", [3]), {"n": 1, "max_tokens": 2})) == same
    assert batch_key(_pending(text, {"max_tokens": 2, "n": 1})) != same  # never mixed
    assert batch_key(_pending(ids, {"max_tokens": 3, "n": 1})) != same
    assert batch_key(_pending(ids, {"max_tokens": 2})) != same
    p = _pending(ids, {"max_tokens": 2})
    assert batch_key(p) == p.batch_key  # computed once, cached on the sample


def test_batch_request_body_lists_every_prompt_in_order() -> None:
    ps = [_pending(b"caf\xc3\xa9", {"max_tokens": 2}), _pending(b"b", {"max_tokens": 2})]
    body = batch_request_body(ps, "m")
    assert body["prompt"] == ["café", "b"] and body["max_tokens"] == 2
    assert body["stream"] is False and body["return_weight_versions"] is True
    toks = [_pending(array.array("i", [1, 2]), {}), _pending(array.array("i", [3]), {})]
    assert batch_request_body(toks, "m")["prompt"] == [[1, 2], [3]]


# -- serving against a fake replica --------------------------------------------------


def _prompts(prompt: Any) -> list[Any]:
    """vLLM's reading of ``prompt``: one (``str`` or ``[int]``) or a list of them."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return prompt
    return [prompt]


class BatchVllm(FakeVllm):
    """:class:`FakeVllm` whose ``/v1/completions`` answers a list of prompts as vLLM does
    (choices ``index = position * n + j``, sent in reverse order; each text names its
    prompt), refuses a prompt longer than ``max_model_len`` with vLLM's 400, and records
    every completion body and the bytes it answered. ``hold``: the next completion waits
    (``held`` is set when it arrived) until cancelled; ``drop_choice``: each answer
    lacks one choice."""

    def __init__(self) -> None:
        super().__init__()
        self.max_model_len = 8
        self.posts: list[dict[str, Any]] = []
        self.answers: list[bytes] = []
        self.hold = False
        self.held = trio.Event()
        self.drop_choice = False  # answer one choice short (no part can be told apart)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/completions":
            return self(request)
        self.calls.append("POST /v1/completions")
        body = json.loads(request.content)
        self.posts.append(body)
        if self.hold:
            self.hold = False
            self.held.set()
            await trio.sleep_forever()
        prompts, n = _prompts(body["prompt"]), body.get("n") or 1
        longest = max(len(p) for p in prompts)
        if longest > self.max_model_len:
            return _err(
                400,
                f"This model's maximum context length is {self.max_model_len} "
                f"tokens. However, your prompt contains {longest} input tokens",
            )
        choices = []
        for pos, p in enumerate(prompts):
            for j in range(n):
                c: dict[str, Any] = {
                    "index": pos * n + j,
                    "text": f"{p}/{j}",
                    "finish_reason": "length",
                }
                if self.weight_versions:
                    c["weight_versions"] = [{"version": self.version, "start": 0, "end": 1}]
                choices.append(c)
        if self.drop_choice:
            del choices[0]
        answer = {**TOP, "choices": choices[::-1], "usage": {"prompt_tokens": len(prompts)}}
        raw = json.dumps(answer).encode()
        self.answers.append(raw)
        return httpx.Response(200, content=raw, headers={"content-type": "application/json"})


@asynccontextmanager
async def _loop(tmp_path: Path, fake: BatchVllm, **cfg: Any) -> AsyncIterator[TurnLoop]:
    """A turn loop (never run: the tests drive its Serving) over ``fake``, holding a
    woken turn, with revision r1 published."""
    async with held_loop(tmp_path, fake.handle, **cfg) as loop:
        yield loop


async def _serve(loop: TurnLoop) -> None:
    assert loop._current is not None
    with trio.fail_after(20):
        assert await loop.serving.serve(loop._current) == "idle"


async def _accept(loop: TurnLoop, bodies: list[dict[str, Any]]) -> list[str]:
    return [p.id for p in await loop.accept_many([("completion", b) for b in bodies])]


def _expected(answer: bytes, k: int, n: int, pos: int) -> bytes:
    """Sample ``pos``'s own body cut from vLLM's ``answer`` to a batch of ``k``, as bytes."""
    whole = json.loads(answer)
    mine = sorted((c for c in whole["choices"] if c["index"] // n == pos), key=lambda c: c["index"])
    own = {**whole, "choices": [{**c, "index": j} for j, c in enumerate(mine)],
           "batch": {"size": k, "position": pos}}  # fmt: skip
    return json.dumps(own, ensure_ascii=False, separators=(",", ":")).encode()


@pytest.mark.parametrize("n", [1, 2])
async def test_a_batch_is_one_send_and_each_sample_gets_its_own_choices(
    tmp_path: Path, n: int
) -> None:
    fake = BatchVllm()
    async with _loop(tmp_path, fake, batch_prompts=8) as loop:
        bodies = [{"prompt": f"q{i}", "max_tokens": 2, "n": n, "temperature": 1} for i in range(5)]
        ids = await _accept(loop, bodies)
        await _serve(loop)
        assert [p["prompt"] for p in fake.posts] == [[f"q{i}" for i in range(5)]]
        for pos, id in enumerate(ids):
            result = loop.store.get(id)
            assert result.status == "done" and result.raw is not None
            assert result.raw == _expected(fake.answers[0], 5, n, pos)
            assert result.body is not None
            assert [c["text"] for c in result.body["choices"]] == [f"q{pos}/{j}" for j in range(n)]
            assert result.body["usage"] == {"prompt_tokens": 5}  # the whole batch's
        c = loop.counters
        assert (c.sends, c.batched_samples, c.commits) == (1, 5, 5) and not c.rejects
        assert loop.status()["counters"]["batched_samples"] == 5


async def test_batches_group_by_params_and_prompt_form_and_chat_goes_alone(
    tmp_path: Path,
) -> None:
    fake = BatchVllm()
    async with _loop(tmp_path, fake, batch_prompts=3) as loop:
        bodies = [
            {"prompt": "a", "max_tokens": 2}, {"prompt": [1], "max_tokens": 2},
            {"prompt": "b", "max_tokens": 3}, {"prompt": "c", "max_tokens": 2},
            {"prompt": [2], "max_tokens": 2}, {"prompt": "d", "max_tokens": 2},
            {"prompt": "e", "max_tokens": 2},
        ]  # fmt: skip
        ids = await _accept(loop, bodies)
        chat = await loop.accept("chat", {"messages": [{"role": "user", "content": "hi"}]})
        await _serve(loop)
        sent = sorted(json.dumps(p["prompt"]) for p in fake.posts)
        assert sent == sorted(
            json.dumps(x) for x in (["a", "c", "d"], [[1], [2]], "b", "e")
        )  # full batches first, then the partial ones; one prompt alone is no batch
        assert fake.calls.count("POST /v1/chat/completions") == 1
        assert all(loop.store.get(i).status == "done" for i in [*ids, chat.id])
        assert loop.counters.sends == 5 and loop.counters.batched_samples == 5


async def test_one_request_per_sample_by_default(tmp_path: Path) -> None:
    """``--batch-prompts 1`` (the default): one send per sample, its body as vLLM
    returned it, byte for byte."""
    fake = BatchVllm()
    async with _loop(tmp_path, fake) as loop:
        ids = await _accept(loop, [{"prompt": f"q{i}", "max_tokens": 2} for i in range(4)])
        await _serve(loop)
        assert sorted(p["prompt"] for p in fake.posts) == [f"q{i}" for i in range(4)]
        for i, id in enumerate(ids):
            (raw,) = [a for a in fake.answers if f'"q{i}/0"' in a.decode()]
            assert loop.store.get(id).raw == raw
        assert (loop.counters.sends, loop.counters.batched_samples) == (4, 0)


async def test_a_refused_batch_is_sent_alone_and_only_the_bad_prompt_fails(
    tmp_path: Path,
) -> None:
    fake = BatchVllm()
    async with _loop(tmp_path, fake, batch_prompts=8) as loop:
        prompts = [[1, 2], [3] * 20, [4], [5, 6]]  # the second is past max_model_len 8
        ids = await _accept(loop, [{"prompt": p, "max_tokens": 1} for p in prompts])
        await _serve(loop)
        assert fake.posts[0]["prompt"] == prompts  # the batch: refused as a whole
        assert sorted(json.dumps(p["prompt"]) for p in fake.posts[1:]) == sorted(
            json.dumps(p) for p in prompts
        )  # then each alone, at once
        got = [loop.store.get(i) for i in ids]
        assert [r.status for r in got] == ["done", "failed", "done", "done"]
        assert got[1].error == (
            "refused by the replica (HTTP 400): POST http://vllm/v1/completions: HTTP 400: "
            "This model's maximum context length is 8 "
            "tokens. However, your prompt contains 20 input tokens"
        )
        c = loop.counters
        assert (c.sends, c.batched_samples, c.refused_by_replica) == (5, 4, 1)
        assert c.rejects == {"batch_refused": 4}


async def test_expiring_one_member_cancels_the_send_and_the_others_go_again(
    tmp_path: Path,
) -> None:
    fake = BatchVllm()
    fake.hold = True
    async with _loop(tmp_path, fake, batch_prompts=8) as loop:
        early = loop.store.prepare("completion", {"prompt": "a", "max_tokens": 1}, None, 60)
        await loop.journal.accept([early])
        ids = await _accept(loop, [{"prompt": p, "max_tokens": 1} for p in ("b", "c")])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve, loop)
            with trio.fail_after(20):
                await fake.held.wait()
            assert loop.serving.in_flight == 3
            loop.serving.expire(early.pending.deadline + 1)  # "a" only: the others have 3600 s
        assert [p["prompt"] for p in fake.posts] == [["a", "b", "c"], ["b", "c"]]
        assert loop.store.get(early.pending.id).error.startswith("deadline exceeded")  # type: ignore[union-attr]
        assert all(loop.store.get(i).status == "done" for i in ids)
        assert [json.loads(loop.store.get(i).raw or b"")["batch"] for i in ids] == [
            {"size": 2, "position": 0}, {"size": 2, "position": 1}
        ]  # fmt: skip
        assert loop.counters.expired == 1 and loop.counters.sends == 2


async def test_label_mode_reads_the_label_once_per_batch(tmp_path: Path) -> None:
    fake = BatchVllm()
    fake.weight_versions = False
    async with _loop(tmp_path, fake, batch_prompts=8, weight_check="label") as loop:
        ids = await _accept(loop, [{"prompt": f"q{i}", "max_tokens": 2} for i in range(3)])
        await _serve(loop)
        at = fake.calls.index("POST /v1/completions")
        assert fake.calls[at:] == ["POST /v1/completions", "GET /weight_info"]
        assert all(loop.store.get(i).status == "done" for i in ids)


async def test_an_answer_that_cannot_be_split_commits_nothing(
    tmp_path: Path, autojump_clock: Any
) -> None:
    fake = BatchVllm()
    async with _loop(tmp_path, fake, batch_prompts=8) as loop:
        fake.drop_choice = True
        ids = await _accept(loop, [{"prompt": f"q{i}", "max_tokens": 2} for i in range(3)])
        assert loop._current is not None
        loop._current.waiting_seen_at = trio.current_time()  # the turn ends after 5 s
        with trio.fail_after(20):
            assert await loop.serving.serve(loop._current) == "waiting"
        assert all(loop.store.is_pending(i) for i in ids)
        assert loop.counters.rejects["choices"] >= 3 and loop.counters.commits == 0


# -- the real stack ------------------------------------------------------------------


@pytest.mark.integration
async def test_a_batch_with_a_prompt_too_long_for_the_stub() -> None:
    """The vLLM stub under the real launcher refuses a prompt past --max-model-len (400):
    the others of its batch are committed, the bad one fails with vLLM's message."""
    with trio.fail_after(90):
        async with running_stack() as stack:
            async with (
                replica(stack, "cooperative", "--max-model-len", "64") as (_, url),
                dispatcher(stack, url, "--batch-prompts", "8") as (d, http),
            ):
                await publish(stack, http, "r1")
                prompts = [[1, 2, 3], list(range(100)), [4], [5, 6]]
                body = {"requests": [{"prompt": p, "max_tokens": 2} for p in prompts]}
                r = await http.post("/v1/samples/batch", json=body)
                assert r.status_code == 202, r.text
                ids = [s["id"] for s in r.json()["samples"]]
                r = await http.post("/v1/samples/results", json={"ids": ids, "wait": 60})
                got = r.json()["results"]
                assert [x["status"] for x in got] == ["done", "failed", "done", "done"], got
                assert "maximum context length is 64 tokens" in got[1]["error"]
                assert "refused by the replica (HTTP 400)" in got[1]["error"]
                for x in (got[0], got[2], got[3]):
                    assert {
                        s["version"] for c in x["result"]["choices"] for s in c["weight_versions"]
                    } == {"r1"}
                counters = (await status(http))["counters"]
                assert counters["batched_samples"] == 4 and counters["refused_by_replica"] == 1
                # Good prompts only: one send, each sample its own choices (and prompt).
                good = [[7], [8, 9], [10, 11, 12]]
                body = {"requests": [{"prompt": p, "max_tokens": 2, "n": 2,
                                      "return_token_ids": True} for p in good]}  # fmt: skip
                r = await http.post("/v1/samples/batch", json=body)
                ids = [s["id"] for s in r.json()["samples"]]
                r = await http.post("/v1/samples/results", json={"ids": ids, "wait": 60})
                for pos, (x, p) in enumerate(zip(r.json()["results"], good, strict=True)):
                    assert x["status"] == "done", x
                    assert x["result"]["batch"] == {"size": 3, "position": pos}
                    assert [c["index"] for c in x["result"]["choices"]] == [0, 1]
                    assert all(c["prompt_token_ids"] == p for c in x["result"]["choices"])
                after = (await status(http))["counters"]
                assert after["sends"] - counters["sends"] == 1
                await stop(d)
            assert stack.overlaps() == 0


def test_batch_prompts_is_validated_and_offered_by_the_cli() -> None:
    with pytest.raises(ValueError, match="batch_prompts must be at least 1"):
        TurnConfig(workload="v", batch_prompts=0)
    assert TurnConfig(workload="v").batch_prompts == 1  # one request per sample
    from click.testing import CliRunner

    from gpu_slicer.dispatcher.main import main

    out = CliRunner().invoke(main, ["--help"]).output
    assert "--batch-prompts" in out and "[default: 1;" in out.split("--batch-prompts")[1]


def test_pending_count_per_revision(tmp_path: Path) -> None:
    with Store(tmp_path, "p") as s:
        s.publish("r1", "/ckpt/r1")
        s.publish("r2", "/ckpt/r2")
        ids = [s.accept("completion", {"prompt": "a"}, rev, 60).id for rev in ("r1", "r2", "r1")]
        assert (s.pending_count("r1"), s.pending_count("r2"), s.pending_count("r9")) == (2, 1, 0)
        s.complete(ids[0], b"{}")
        assert s.pending_count("r1") == 1 == len(s.pending("r1"))
