"""The dispatcher's pure rules, table-driven: commit rule, request body, next revision,
turn end, model parsing."""

from __future__ import annotations

import array
import json
from typing import Any

import click
import pytest

from gpu_slicer.dispatcher.core import (
    WEIGHT_CHECKS,
    TurnPlan,
    commit_ok,
    load_retry_delay,
    lone_surrogate,
    next_revision,
    parse_body,
    parse_model,
    request_body,
    result_ok,
    weight_versions,
)
from gpu_slicer.dispatcher.errors import BadRequest
from gpu_slicer.dispatcher.startup import check_base_revision
from gpu_slicer.dispatcher.store import Pending


def _pending(revision: str = "r2", n: int | None = None, kind: str = "completion") -> Pending:
    params: dict[str, Any] = {"max_tokens": 4, "temperature": 0.5}
    if n is not None:
        params["n"] = n
    return Pending(
        id="smp-000000000000000000000001",
        pool="pool-a",
        revision=revision,
        kind=kind,
        params=params,
        prompt=array.array("i", [1, 2, 3]) if kind == "completion" else None,
        messages=b'[{"role":"user","content":"hi"}]' if kind == "chat" else None,
        accepted_at=0.0,
        deadline=3600.0,
        attempts=0,
    )


def _span(version: str, start: int = 0, end: int = 4) -> dict[str, Any]:
    return {"version": version, "start": start, "end": end}


# (case, weight versions per choice, loaded revision, epoch at send, epoch now, ok)
_COMMIT: list[tuple[str, list[list[dict[str, Any]]], str, int, int, bool]] = [
    ("ok", [[_span("r2")]], "r2", 3, 3, True),
    ("ok two choices", [[_span("r2")], [_span("r2")]], "r2", 3, 3, True),
    ("ok split spans same version", [[_span("r2", 0, 2), _span("r2", 2, 4)]], "r2", 1, 1, True),
    ("wrong version", [[_span("r1")]], "r2", 3, 3, False),
    ("mixed versions in a choice", [[_span("r1", 0, 2), _span("r2", 2, 4)]], "r2", 3, 3, False),
    ("mixed across choices", [[_span("r2")], [_span("r1")]], "r2", 3, 3, False),
    ("epoch changed (slept)", [[_span("r2")]], "r2", 3, 4, False),
    ("loaded is another revision", [[_span("r2")]], "r3", 3, 3, False),
    ("no choices", [], "r2", 3, 3, False),
    ("a choice without versions", [[_span("r2")], []], "r2", 3, 3, False),
    ("default label", [[_span("default")]], "r2", 0, 0, False),
    ("span without version", [[{"start": 0, "end": 4}]], "r2", 0, 0, False),
]


@pytest.mark.parametrize(
    ("case", "versions", "loaded", "sent", "now", "ok"), _COMMIT, ids=[c[0] for c in _COMMIT]
)
def test_commit_rule(
    case: str,
    versions: list[list[dict[str, Any]]],
    loaded: str,
    sent: int,
    now: int,
    ok: bool,
) -> None:
    assert commit_ok(_pending(), versions, loaded, sent, now) is ok


def _response(*choices: dict[str, Any]) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion", "choices": list(choices)}


def _choice(version: str = "r2", finish: str = "length") -> dict[str, Any]:
    return {
        "index": 0,
        "text": "abcd",
        "finish_reason": finish,
        "weight_versions": [_span(version)],
    }


_RESULT: list[tuple[str, dict[str, Any], int | None, bool]] = [
    ("ok", _response(_choice()), None, True),
    ("aborted by a sleep", _response(_choice(finish="abort")), None, False),
    ("n=2 but one choice", _response(_choice()), 2, False),
    ("n=2 ok", _response(_choice(), _choice()), 2, True),
    ("no choices key", {"error": "x"}, None, False),
    ("choice not an object", _response("x"), None, False),  # type: ignore[arg-type]
    ("no weight_versions", _response({"index": 0, "finish_reason": "stop"}), None, False),
]


@pytest.mark.parametrize(("case", "body", "n", "ok"), _RESULT, ids=[c[0] for c in _RESULT])
def test_result_ok(case: str, body: dict[str, Any], n: int | None, ok: bool) -> None:
    assert result_ok(_pending(n=n), body, "r2", 1, 1) is ok


def _bare(finish: str = "length") -> dict[str, Any]:
    """A choice as vLLM 0.32 returns it: no ``weight_versions``."""
    return {"index": 0, "text": "abcd", "finish_reason": finish}


# --weight-check label: (case, body, n, label from /weight_info, loaded, epoch at send,
# epoch now, ok). Spans are ignored in this mode, whatever they say.
_LABEL: list[tuple[str, dict[str, Any], int | None, str, str, int, int, bool]] = [
    ("ok without spans", _response(_bare()), None, "r2", "r2", 3, 3, True),
    ("ok n=2 without spans", _response(_bare(), _bare()), 2, "r2", "r2", 3, 3, True),
    ("spans ignored: wrong spans", _response(_choice("r1")), None, "r2", "r2", 3, 3, True),
    ("spans ignored: right spans", _response(_choice("r2")), None, "r1", "r2", 3, 3, False),
    ("label differs", _response(_bare()), None, "r1", "r2", 3, 3, False),
    ("default label", _response(_bare()), None, "default", "r2", 0, 0, False),
    ("epoch changed (slept)", _response(_bare()), None, "r2", "r2", 3, 4, False),
    ("loaded is another revision", _response(_bare()), None, "r2", "r3", 3, 3, False),
    ("aborted by a sleep", _response(_bare("abort")), None, "r2", "r2", 3, 3, False),
    ("one of two aborted", _response(_bare(), _bare("abort")), 2, "r2", "r2", 3, 3, False),
    ("n=2 but one choice", _response(_bare()), 2, "r2", "r2", 3, 3, False),
    ("n=1 but two choices", _response(_bare(), _bare()), None, "r2", "r2", 3, 3, False),
    ("no choices", _response(), None, "r2", "r2", 3, 3, False),
    ("no choices key", {"error": "x"}, None, "r2", "r2", 3, 3, False),
]


@pytest.mark.parametrize(
    ("case", "body", "n", "label", "loaded", "sent", "now", "ok"),
    _LABEL,
    ids=[c[0] for c in _LABEL],
)
def test_result_ok_label_mode(
    case: str,
    body: dict[str, Any],
    n: int | None,
    label: str,
    loaded: str,
    sent: int,
    now: int,
    ok: bool,
) -> None:
    assert result_ok(_pending(n=n), body, loaded, sent, now, label=label) is ok


# (case, weight versions per choice, label, ok): commit_ok itself in label mode.
_COMMIT_LABEL: list[tuple[str, list[list[dict[str, Any]]], str, bool]] = [
    ("no spans, label right", [[]], "r2", True),
    ("wrong spans, label right", [[_span("r1")], []], "r2", True),
    ("right spans, label wrong", [[_span("r2")]], "r1", False),
    ("no choices", [], "r2", False),
]


@pytest.mark.parametrize(
    ("case", "versions", "label", "ok"), _COMMIT_LABEL, ids=[c[0] for c in _COMMIT_LABEL]
)
def test_commit_rule_label_mode(
    case: str, versions: list[list[dict[str, Any]]], label: str, ok: bool
) -> None:
    assert commit_ok(_pending(), versions, "r2", 1, 1, label=label) is ok
    assert commit_ok(_pending(), versions, "r2", 1, 2, label=label) is False  # epoch
    assert commit_ok(_pending(), versions, "r3", 1, 1, label=label) is False  # loaded


def test_spans_mode_refuses_a_vllm_without_weight_versions() -> None:
    """vLLM 0.32 ignores return_weight_versions: the default rule commits none of it."""
    body = _response(_bare())
    assert result_ok(_pending(), body, "r2", 1, 1) is False
    assert result_ok(_pending(), body, "r2", 1, 1, label=None) is False
    assert result_ok(_pending(), body, "r2", 1, 1, label="r2") is True


def test_weight_checks() -> None:
    assert WEIGHT_CHECKS == ("spans", "label")


def test_weight_versions_extraction() -> None:
    body = _response(_choice("r1"), {"index": 1})
    assert weight_versions(body) == [[_span("r1")], []]
    assert weight_versions({}) == []


def test_request_body_completion_and_chat() -> None:
    p = _pending()
    body = request_body(p, "served-model")
    assert body == {
        "max_tokens": 4,
        "temperature": 0.5,
        "prompt": [1, 2, 3],
        "model": "served-model",
        "return_weight_versions": True,
        "stream": False,
    }
    json.dumps(body)  # plain JSON types only
    body["max_tokens"] = 99
    assert p.params["max_tokens"] == 4  # the pending params are not aliased
    text = _pending()
    text.prompt = "héllo".encode()
    assert request_body(text, "m")["prompt"] == "héllo"
    chat = request_body(_pending(kind="chat"), "m")
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in chat


def test_parse_body_roundtrip_through_request_body() -> None:
    parsed = parse_body(
        "completion",
        {"prompt": [7, 8], "model": "m@r5", "stream": True, "return_weight_versions": False,
         "stop": ["\n"], "logprobs": 2},
        32768,
        1 << 20,
    )  # fmt: skip
    assert parsed.revision == "r5"
    assert parsed.params == {"stop": ["\n"], "logprobs": 2}
    assert isinstance(parsed.prompt, array.array) and parsed.prompt.itemsize == 4


@pytest.mark.parametrize(
    ("model", "name", "rev"),
    [
        ("llama", "llama", None),
        ("llama@r1", "llama", "r1"),
        ("org/m@x@step-3", "org/m@x", "step-3"),
    ],
)
def test_parse_model(model: str, name: str, rev: str | None) -> None:
    assert parse_model(model) == (name, rev)


def test_parse_model_empty_revision() -> None:
    with pytest.raises(BadRequest, match="names no revision"):
        parse_model("llama@")


@pytest.mark.parametrize(
    ("pending", "loaded", "want"),
    [
        ([], None, None),
        ([], "r1", None),
        (["r1", "r2"], None, "r1"),
        (["r1", "r2"], "r2", "r2"),  # no reload while the loaded one has work
        (["r1", "r2"], "r3", "r1"),
    ],
)
def test_next_revision(pending: list[str], loaded: str | None, want: str | None) -> None:
    assert next_revision(pending, loaded) == want


# (now, turn started, waiting seen at, pending for replica, turn_seconds, end)
_TURN: list[tuple[float, float, float | None, int, float, bool]] = [
    (5, 0, None, 0, 30, True),  # nothing to do
    (500, 0, None, 3, 30, False),  # nobody waits: keep serving
    (10, 0, 1, 3, 30, False),  # a waiter, but within turn_seconds
    (30, 0, 1, 3, 30, True),
    (40, 0, 39, 3, 30, True),  # a late waiter does not get a fresh window
    (40, 0, 39, 0, 30, True),
]


@pytest.mark.parametrize(("now", "started", "waiting", "pending", "secs", "end"), _TURN)
def test_turn_plan(
    now: float, started: float, waiting: float | None, pending: int, secs: float, end: bool
) -> None:
    assert TurnPlan.should_end(now, started, waiting, pending, secs) is end


def test_turn_plan_ends_at() -> None:
    plan = TurnPlan(turn_seconds=30)
    assert plan.ends_at(100, None) is None
    assert plan.ends_at(100, 120) == 130


# (case, raw JSON body, the field named, or None: valid text)
_SURROGATES: list[tuple[str, str, str | None]] = [
    ("lone high in prompt", r'{"prompt": "\ud800"}', "prompt (offset 0)"),
    ("lone low in user", r'{"prompt": "x", "user": "ab\udfff"}', "user (offset 2)"),
    ("in a chat part", r'{"messages": [{"role": "user", "content": "hi"}, {"role": "user",'
     r' "content": [{"type": "text", "text": "\ud83d"}]}]}', "messages[1].content[0].text"),
    ("in a key", r'{"prompt": "x", "logit_bias": {"\ud800": 1}}', "a key of logit_bias"),
    ("a top-level key", r'{"\udc00": 1}', "a key of the body"),
    ("the first in document order", r'{"a": ["ok", "\udfff"], "b": "\ud800"}', "a[1]"),
    ("a pair is fine", r'{"prompt": "\ud83d\ude00 and \u00e9"}', None),
    ("ints and nulls", r'{"prompt": [1, 2, 3], "stop": null, "n": 1}', None),
]  # fmt: skip


@pytest.mark.parametrize(("case", "raw", "where"), _SURROGATES, ids=[c[0] for c in _SURROGATES])
def test_lone_surrogates_are_found_and_named(case: str, raw: str, where: str | None) -> None:
    body = json.loads(raw)
    found = lone_surrogate(body)
    if where is None:
        assert found is None
        return
    assert found is not None and found.startswith(where), found
    kind = "chat" if "messages" in body else "completion"
    with pytest.raises(BadRequest, match="lone UTF-16 surrogate") as e:
        parse_body(kind, body, 32768, 1 << 20)
    assert str(e.value).startswith(where)


def test_lone_surrogate_deep_nesting_is_iterative() -> None:
    depth = 900  # near what json.loads itself accepts
    body = json.loads('{"a": ' * depth + r'"\ud800"' + "}" * depth)
    found = lone_surrogate(body)
    assert found is not None and found.startswith(".".join(["a"] * depth))


@pytest.mark.parametrize(("text", "value"), [("base", "base"), ("step-0", "step-0"), ("", None)])
def test_the_base_revision_flag_takes_a_revision_name_or_nothing(
    text: str, value: str | None
) -> None:
    assert check_base_revision(None, None, text) == value  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["has space", "a/b", "x" * 300, "pool@"])
def test_a_base_revision_that_is_no_revision_name_is_a_usage_error(text: str) -> None:
    with pytest.raises(click.BadParameter):
        check_base_revision(None, None, text)  # type: ignore[arg-type]


def _tries(hours: float, pooled: bool, refused: bool, cap: float = 900.0) -> list[float]:
    """When a revision no replica can load is tried (each try: one trainer park)."""
    at, n, out = 0.0, 0, []
    while at < hours * 3600:
        out.append(at)
        n += 1
        at += load_retry_delay(n, n if refused else 0, pooled, cap)
    return out


def test_a_pool_revision_no_replica_can_load_costs_a_few_parks_an_hour() -> None:
    """Refused loads in pool mode wait 1, 4, 16, ... s up to the cap (900 s by default):
    4 tries in the first minute, 5 in the rest of the first hour, 4 an hour after. The
    old schedule (doubling to 30 s, still what a replica's own faults get) tried 124
    times in the first hour."""
    tries = _tries(3, pooled=True, refused=True)
    assert tries[:6] == [0, 1, 5, 21, 85, 341]
    first_hour = [t for t in tries if t < 3600]
    assert len([t for t in first_hour if t < 60]) == 4
    assert len([t for t in first_hour if t >= 60]) == 5
    assert len([t for t in tries if 3600 <= t < 7200]) == 4
    assert len(_tries(1, pooled=True, refused=False)) == 124  # the replica's fault
    assert len(_tries(1, pooled=False, refused=True)) == 124  # single node: fails at 3
    assert len([t for t in _tries(3, True, True, cap=3600) if 3600 <= t < 7200]) == 1


@pytest.mark.parametrize(
    ("failures", "refused", "pooled", "cap", "want"),
    [
        (1, 1, True, 900, 1.0),
        (3, 3, True, 900, 16.0),
        (7, 7, True, 900, 900.0),
        (10**6, 10**6, True, 900, 900.0),  # no overflow however long it failed
        (3, 0, True, 900, 4.0),  # no answer: the replica's fault, doubling
        (9, 0, True, 900, 30.0),
        (9, 9, False, 900, 30.0),  # single node
        (10**6, 0, False, 900, 30.0),
        (2, 2, True, 0.5, 0.5),  # a cap below the first step
    ],
)
def test_load_retry_delay(failures: int, refused: int, pooled: bool, cap: float,
                          want: float) -> None:  # fmt: skip
    assert load_retry_delay(failures, refused, pooled, cap) == want
