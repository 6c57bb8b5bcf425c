"""Property tests of proto/: encode/parse round trips, and that no input makes the
parsers raise anything but ProtocolError."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_slicer.proto import (
    MAX_LINE,
    NAME_RE,
    PARKED_MAX_LIMIT,
    Acquire,
    Early,
    Err,
    ErrorCode,
    Event,
    Fault,
    Hello,
    LineBuffer,
    Ok,
    ParkMode,
    Ping,
    ProtocolError,
    Register,
    Release,
    ReleasePark,
    Request,
    ServerMessage,
    Status,
    Unregister,
    Waiting,
    Watch,
    encode,
    format_size,
    parse_request,
    parse_server_line,
    parse_size,
)

FUZZ = settings(max_examples=300, deadline=None)

names = st.from_regex(NAME_RE, fullmatch=True)
gpus = st.from_regex(r"[A-Za-z0-9_.:-]{1,128}", fullmatch=True)
clients = st.from_regex(r"[\x21-\x7e]{1,128}", fullmatch=True)
turns = st.integers(1, 2**63 - 1)
waits = st.none() | st.floats(min_value=0, allow_nan=False, allow_infinity=False)

requests: st.SearchStrategy[Request] = st.one_of(
    st.builds(Hello, client=st.none() | clients),
    st.just(Ping()),
    st.builds(
        Register,
        workload=names,
        gpu=st.none() | gpus,
        pid=st.none() | st.integers(1, 2**31 - 1),
        tree=st.booleans(),
        park=st.sampled_from(ParkMode),
        parked_max=st.integers(0, PARKED_MAX_LIMIT),
    ),
    st.builds(Acquire, workload=names, wait=waits, early=st.integers(0, 2**40)),
    st.builds(Release, workload=names, turn=turns, park=st.sampled_from(ReleasePark)),
    st.builds(Unregister, workload=names),
    st.just(Status()),
    st.just(Watch()),
)

keys = st.from_regex(r"[a-z_]{1,16}", fullmatch=True)
values = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters=" \n\r"), max_size=24
)
fields = st.dictionaries(keys, values, max_size=6)
texts = st.text(
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r"), max_size=200
)
codes = st.sampled_from(ErrorCode) | st.from_regex(r"[a-z][a-z0-9-]{0,63}", fullmatch=True)
json_values: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
json_objects = st.dictionaries(st.text(max_size=10), json_values, max_size=6)

server_messages: st.SearchStrategy[ServerMessage] = st.one_of(
    st.builds(Ok, fields=fields),
    st.builds(Ok, body=json_objects | st.lists(json_values, max_size=5)),
    st.builds(Err, code=codes, fields=fields, text=texts),
    st.builds(Fault, workload=names, turn=st.integers(0, 2**63 - 1), reason=codes, text=texts),
    st.builds(Waiting, workload=names, turn=turns, waiters=st.integers(0, 2**63 - 1)),
    st.builds(Early, workload=names, nbytes=st.integers(1, 2**40)),
    st.builds(Event, body=json_objects),
)


@FUZZ
@given(requests)
def test_request_round_trip(msg: Request) -> None:
    data = encode(msg)
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert len(data) <= MAX_LINE
    assert parse_request(data) == msg
    assert parse_request(data[:-1] + b"\r\n") == msg


@FUZZ
@given(server_messages)
def test_server_message_round_trip(msg: ServerMessage) -> None:
    data = encode(msg)
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    if not (isinstance(msg, Event) or (isinstance(msg, Ok) and msg.body is not None)):
        assert len(data) <= MAX_LINE
    assert parse_server_line(data) == msg


@FUZZ
@given(st.integers(0, 2**70))
def test_size_round_trip(n: int) -> None:
    assert parse_size(format_size(n)) == n


# --- hostile input --------------------------------------------------------------------

fragments = st.sampled_from(
    [
        "HELLO", "PING", "REGISTER", "ACQUIRE", "RELEASE", "UNREGISTER", "STATUS", "WATCH",
        "OK", "ERR", "FAULT", "WAITING", "EVENT", "a", "-a", "--", "=", "turn=", "turn=1",
        "wait=1e9", "wait=-0", "park=now", "parked_max=10GiB", "proto=1", "gpu=0", "pid=1",
        "tree=0", "{", "}", '{"a":1}', "[", "]", "busy", "reason=x", "waiters=2", " ", "\r",
        "\t", "é", "\x00", "x" * 200,
    ]
)  # fmt: skip
structured_lines = st.lists(fragments, max_size=12).map(lambda parts: " ".join(parts).encode())
hostile = st.binary(max_size=400) | structured_lines


@FUZZ
@given(hostile)
def test_parse_request_only_raises_protocol_error(data: bytes) -> None:
    try:
        msg = parse_request(data)
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)
        assert "\n" not in exc.message
        return
    assert parse_request(encode(msg)) == msg


@FUZZ
@given(hostile)
def test_parse_server_line_only_raises_protocol_error(data: bytes) -> None:
    try:
        msg = parse_server_line(data)
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode)
        return
    assert parse_server_line(encode(msg)) == msg


@FUZZ
@given(st.lists(st.binary(max_size=3000), max_size=8), st.integers(1, MAX_LINE))
def test_linebuffer_only_raises_protocol_error(chunks: list[bytes], limit: int) -> None:
    buf = LineBuffer(limit)
    received: list[bytes] = []
    try:
        for chunk in chunks:
            received += buf.feed(chunk)
            assert buf.pending < limit
    except ProtocolError as exc:
        assert exc.code is ErrorCode.LINE_TOO_LONG
        return
    stream = b"".join(chunks)
    assert b"\n".join([*received, b""]) == stream[: len(stream) - buf.pending]
    assert all(len(line) + 1 <= limit and b"\n" not in line for line in received)
