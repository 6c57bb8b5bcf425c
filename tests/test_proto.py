"""Table-driven tests of the sans-IO wire protocol (proto/)."""

from __future__ import annotations

import pytest

from gpu_slicer.proto import (
    MAX_LINE,
    MAX_SERVER_LINE,
    NAME_RE,
    PARKED_MAX_LIMIT,
    PROTO_VERSION,
    Acquire,
    Early,
    Err,
    ErrorCode,
    Event,
    Fault,
    Hello,
    LineBuffer,
    LineTooLong,
    Ok,
    ParkAsk,
    Parked,
    ParkFallback,
    ParkMode,
    Ping,
    ProtocolError,
    Register,
    Release,
    ReleasePark,
    Status,
    Unregister,
    Waiting,
    Watch,
    encode,
    format_size,
    parse_request,
    parse_server_line,
    parse_size,
    validate_name,
)

GIB = 1024**3

GOOD_REQUESTS: list[tuple[bytes, object]] = [
    (b"HELLO proto=1", Hello()),
    (b"HELLO", Hello()),
    (b"HELLO proto=1 client=slicerctl/0.1", Hello(client="slicerctl/0.1")),
    (b"PING", Ping()),
    (b"PING\n", Ping()),
    (b"PING\r\n", Ping()),
    (b"  PING  ", Ping()),
    (b"REGISTER sampler", Register("sampler")),
    (b"REGISTER a gpu=0", Register("a", gpu="0")),
    (b"REGISTER a gpu=GPU-8f3c2d1e-aaaa", Register("a", gpu="GPU-8f3c2d1e-aaaa")),
    (b"REGISTER a pid=1234 tree=0", Register("a", pid=1234, tree=False)),
    # pid=self names the sender, as no pid does (a pod's client need not know its number).
    (b"REGISTER a pid=self", Register("a")),
    (b"REGISTER a tree=1 park=checkpoint parked_max=0", Register("a")),
    (
        b"REGISTER vllm-0 park=cooperative parked_max=3GiB",
        Register("vllm-0", park=ParkMode.COOPERATIVE, parked_max=3 * GIB),
    ),
    (b"REGISTER a parked_max=10GiB", Register("a", parked_max=PARKED_MAX_LIMIT)),
    (b"REGISTER a parked_max=512MiB", Register("a", parked_max=512 * 1024**2)),
    (b"REGISTER a parked_max=1536", Register("a", parked_max=1536)),
    (b"REGISTER a parked_max=7B", Register("a", parked_max=7)),
    (b"REGISTER a    gpu=1     pid=7", Register("a", gpu="1", pid=7)),
    (
        b"REGISTER v park=cooperative fallback=checkpoint ask=1",
        Register("v", park=ParkMode.COOPERATIVE, fallback=ParkFallback.CHECKPOINT, ask=True),
    ),
    (b"REGISTER v fallback=none ask=0", Register("v")),
    (b"PARKED v turn=7", Parked("v", 7)),
    (b"PARKED v turn=0 ok=0", Parked("v", 0, ok=False)),
    (b"ACQUIRE sampler", Acquire("sampler")),
    (b"ACQUIRE sampler wait=0", Acquire("sampler", wait=0.0)),
    (b"ACQUIRE sampler wait=2.5", Acquire("sampler", wait=2.5)),
    (b"ACQUIRE sampler wait=1e-05", Acquire("sampler", wait=1e-05)),
    (b"ACQUIRE sampler early=16GiB", Acquire("sampler", early=16 * GIB)),
    (b"ACQUIRE sampler early=0 wait=1", Acquire("sampler", wait=1.0)),
    (b"ACQUIRE sampler early=1024GiB", Acquire("sampler", early=1024 * GIB)),
    (b"RELEASE sampler turn=7", Release("sampler", turn=7)),
    (b"RELEASE sampler turn=7 park=lazy", Release("sampler", turn=7)),
    (b"RELEASE sampler park=now turn=7", Release("sampler", 7, ReleasePark.NOW)),
    (b"RELEASE sampler turn=7 used=0", Release("sampler", 7, used=False)),
    (b"RELEASE sampler turn=7 used=1", Release("sampler", 7)),
    (b"UNREGISTER sampler", Unregister("sampler")),
    (b"STATUS", Status()),
    (b"WATCH", Watch()),
    (b"REGISTER " + b"a" * 128, Register("a" * 128)),
    (b"REGISTER A0_.:-z", Register("A0_.:-z")),
]


@pytest.mark.parametrize(("line", "expected"), GOOD_REQUESTS)
def test_parse_good_request(line: bytes, expected: object) -> None:
    assert parse_request(line) == expected


@pytest.mark.parametrize(("line", "expected"), GOOD_REQUESTS)
def test_good_request_round_trips(line: bytes, expected: object) -> None:
    msg = parse_request(line)
    data = encode(msg)
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert len(data) <= MAX_LINE
    assert parse_request(data) == expected


def test_register_encodes_only_non_default_keys() -> None:
    assert encode(Register("a")) == b"REGISTER a\n"
    assert encode(Register("a", tree=True, park=ParkMode.CHECKPOINT)) == b"REGISTER a\n"
    full = Register("a", gpu="1", pid=9, tree=False, park=ParkMode.COOPERATIVE, parked_max=GIB)
    assert encode(full) == b"REGISTER a gpu=1 pid=9 tree=0 park=cooperative parked_max=1GiB\n"
    assert encode(Hello()) == b"HELLO proto=1\n"
    assert encode(Release("a", 3)) == b"RELEASE a turn=3\n"
    assert encode(Acquire("a", wait=0.1)) == b"ACQUIRE a wait=0.1\n"
    assert encode(Acquire("a", early=GIB)) == b"ACQUIRE a early=1073741824\n"
    assert encode(Acquire("a", early=0)) == b"ACQUIRE a\n"  # the default is not written


E = ErrorCode
BAD_REQUESTS: list[tuple[bytes, ErrorCode]] = [
    (b"", E.EMPTY),
    (b"\n", E.EMPTY),
    (b"\r", E.EMPTY),
    (b"\r\n", E.EMPTY),
    (b"   \t ", E.EMPTY),
    (b"\xff\xfe", E.BAD_ENCODING),
    (b"PING \xc3", E.BAD_ENCODING),
    (b"garbage", E.UNKNOWN_VERB),
    (b"\x00\x01", E.UNKNOWN_VERB),
    (b"ping", E.UNKNOWN_VERB),
    (b"Acquire a", E.UNKNOWN_VERB),
    (b"OK", E.UNKNOWN_VERB),
    (b"PING\tx", E.UNKNOWN_VERB),
    (b"REGISTER -a", E.BAD_NAME),
    (b"REGISTER " + b"a" * 129, E.BAD_NAME),
    (b"REGISTER a/b", E.BAD_NAME),
    (b"ACQUIRE a\tb", E.BAD_NAME),
    (b"ACQUIRE _a", E.BAD_NAME),
    (b"ACQUIRE \xc3\xa9t\xc3\xa9", E.BAD_NAME),
    (b"ACQUIRE a b", E.BAD_ARGUMENT),  # a space ends the name: extra positional
    (b"REGISTER", E.MISSING_ARGUMENT),
    (b"ACQUIRE", E.MISSING_ARGUMENT),
    (b"ACQUIRE wait=5", E.MISSING_ARGUMENT),
    (b"UNREGISTER ", E.MISSING_ARGUMENT),
    (b"RELEASE a", E.MISSING_ARGUMENT),
    (b"RELEASE a park=now", E.MISSING_ARGUMENT),
    (b"RELEASE turn=3", E.MISSING_ARGUMENT),
    (b"RELEASE a turn=0", E.BAD_ARGUMENT),
    (b"RELEASE a turn=abc", E.BAD_ARGUMENT),
    (b"RELEASE a turn=3 used=yes", E.BAD_ARGUMENT),
    (b"RELEASE a turn=-1", E.BAD_ARGUMENT),
    (b"RELEASE a turn=", E.BAD_ARGUMENT),
    (b"RELEASE a turn=1 park=soon", E.BAD_ARGUMENT),
    (b"ACQUIRE a wait=-1", E.BAD_ARGUMENT),
    (b"ACQUIRE a wait=nan", E.BAD_ARGUMENT),
    (b"ACQUIRE a wait=inf", E.BAD_ARGUMENT),
    (b"ACQUIRE a wait=1e999", E.BAD_ARGUMENT),
    (b"ACQUIRE a wait=1_0", E.BAD_ARGUMENT),
    (b"ACQUIRE a wait=", E.BAD_ARGUMENT),
    (b"REGISTER a parked_max=11GiB", E.BAD_ARGUMENT),
    (b"ACQUIRE a early=1025GiB", E.BAD_ARGUMENT),
    (b"ACQUIRE a early=-1", E.BAD_ARGUMENT),
    (b"ACQUIRE a early=16GB", E.BAD_ARGUMENT),
    (b"ACQUIRE a early=", E.BAD_ARGUMENT),
    (b"REGISTER a parked_max=10737418241", E.BAD_ARGUMENT),
    (b"REGISTER a parked_max=5XiB", E.BAD_ARGUMENT),
    (b"REGISTER a parked_max=5gib", E.BAD_ARGUMENT),
    (b"REGISTER a parked_max=-1", E.BAD_ARGUMENT),
    (b"REGISTER a park=bogus", E.BAD_ARGUMENT),
    (b"REGISTER a park=CHECKPOINT", E.BAD_ARGUMENT),
    (b"REGISTER a tree=2", E.BAD_ARGUMENT),
    (b"REGISTER a tree=true", E.BAD_ARGUMENT),
    (b"REGISTER a pid=0", E.BAD_ARGUMENT),
    (b"REGISTER a pid=SELF", E.BAD_ARGUMENT),
    (b"REGISTER a pid=", E.BAD_ARGUMENT),
    (b"REGISTER a pid=-3", E.BAD_ARGUMENT),
    (b"REGISTER a pid=99999999999", E.BAD_ARGUMENT),
    (b"REGISTER a gpu=", E.BAD_ARGUMENT),
    (b"REGISTER a gpu=a/b", E.BAD_ARGUMENT),
    (b"REGISTER a gpu=0 gpu=1", E.BAD_ARGUMENT),
    (b"RELEASE a turn=1 turn=1", E.BAD_ARGUMENT),
    (b"REGISTER a color=red", E.BAD_ARGUMENT),
    (b"ACQUIRE a turn=3", E.BAD_ARGUMENT),
    (b"PING x=1", E.BAD_ARGUMENT),
    (b"REGISTER a b", E.BAD_ARGUMENT),
    (b"REGISTER a gpu=0 extra", E.BAD_ARGUMENT),
    (b"PING now", E.BAD_ARGUMENT),
    (b"STATUS all", E.BAD_ARGUMENT),
    (b"ACQUIRE a -- please", E.BAD_ARGUMENT),
    (b"PING --", E.BAD_ARGUMENT),
    (b"REGISTER a GPU=0", E.BAD_ARGUMENT),
    (b"REGISTER a =0", E.BAD_ARGUMENT),
    (b"PING\nPING", E.BAD_ARGUMENT),
    (b"HELLO proto=2", E.UNSUPPORTED_PROTO),
    (b"HELLO proto=0", E.UNSUPPORTED_PROTO),
    (b"HELLO proto=one", E.BAD_ARGUMENT),
    (b"HELLO client=", E.BAD_ARGUMENT),
    (b"HELLO proto=1 client=\xc3\xa9", E.BAD_ARGUMENT),
    (b"P" * MAX_LINE, E.LINE_TOO_LONG),
    (b"P" * MAX_LINE + b"\n", E.LINE_TOO_LONG),
]


@pytest.mark.parametrize(("line", "code"), BAD_REQUESTS)
def test_bad_request_code(line: bytes, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request(line)
    assert info.value.code is code
    assert info.value.message
    assert "\n" not in info.value.message


def test_error_messages_say_what_was_wrong() -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request(b"REGISTER a parked_max=11GiB")
    assert info.value.message == "REGISTER: parked_max must be <= 10GiB, got 11GiB"
    assert str(info.value) == "bad-argument: REGISTER: parked_max must be <= 10GiB, got 11GiB"
    with pytest.raises(ProtocolError, match="RELEASE: missing turn="):
        parse_request(b"RELEASE a")
    with pytest.raises(ProtocolError, match="duplicate key gpu="):
        parse_request(b"REGISTER a gpu=0 gpu=1")
    with pytest.raises(ProtocolError, match="unknown key color="):
        parse_request(b"REGISTER a color=red")


def test_line_length_boundary() -> None:
    name = b"a" * 128
    pad = b" " * (MAX_LINE - len(b"ACQUIRE ") - len(name) - 1)
    line = b"ACQUIRE " + name + pad + b"\n"
    assert len(line) == MAX_LINE
    assert parse_request(line) == Acquire("a" * 128)
    assert parse_request(line[:-1]) == Acquire("a" * 128)
    with pytest.raises(LineTooLong):
        parse_request(line[:-1] + b" \n")


def test_line_too_long_is_a_protocol_error() -> None:
    err = LineTooLong("x")
    assert isinstance(err, ProtocolError)
    assert err.code is ErrorCode.LINE_TOO_LONG


@pytest.mark.parametrize("name", ["-a", "a" * 129, "a b", "a/b", "", ".a", "a\n", "é", "a=b", " a"])
def test_validate_name_rejects(name: str) -> None:
    with pytest.raises(ProtocolError) as info:
        validate_name(name)
    assert info.value.code is ErrorCode.BAD_NAME


@pytest.mark.parametrize("name", ["a", "A", "0", "a" * 128, "vllm-0.replica:1_x", "9-"])
def test_validate_name_accepts(name: str) -> None:
    assert validate_name(name) == name
    assert NAME_RE.fullmatch(name)


# --- encode refuses invalid requests --------------------------------------------------

BAD_ENCODES: list[tuple[object, ErrorCode]] = [
    (Register("bad name"), E.BAD_NAME),
    (Acquire("/x"), E.BAD_NAME),
    (Register("a", pid=0), E.BAD_ARGUMENT),
    (Register("a", gpu="a b"), E.BAD_ARGUMENT),
    (Register("a", parked_max=PARKED_MAX_LIMIT + 1), E.BAD_ARGUMENT),
    (Register("a", parked_max=-1), E.BAD_ARGUMENT),
    (Acquire("a", early=-1), E.BAD_ARGUMENT),
    (Acquire("a", early=2**41), E.BAD_ARGUMENT),
    (Acquire("a", wait=float("nan")), E.BAD_ARGUMENT),
    (Acquire("a", wait=-0.5), E.BAD_ARGUMENT),
    (Release("a", turn=0), E.BAD_ARGUMENT),
    (Hello(client="a b"), E.BAD_ARGUMENT),
    (Ok({"Key": "v"}), E.BAD_ARGUMENT),
    (Ok({"k": "a b"}), E.BAD_ARGUMENT),
    (Ok({"k": "v"}, body={}), E.BAD_ARGUMENT),
    (Ok(body={"x": float("nan")}), E.BAD_ARGUMENT),
    (Ok(body=5), E.BAD_ARGUMENT),
    (Err("Not A Code"), E.BAD_ARGUMENT),
    (Fault("a", -1, "x"), E.BAD_ARGUMENT),
    (Waiting("a", 0, 1), E.BAD_ARGUMENT),
    (Event({"x": object()}), E.BAD_ARGUMENT),
    (Ok({"k": "v" * MAX_LINE}), E.LINE_TOO_LONG),
    ("PING", E.INTERNAL),
]


@pytest.mark.parametrize(("msg", "code"), BAD_ENCODES)
def test_encode_refuses_invalid(msg: object, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as info:
        encode(msg)  # type: ignore[arg-type]
    assert info.value.code is code


# --- LineBuffer -----------------------------------------------------------------------


def test_linebuffer_split_across_feeds() -> None:
    buf = LineBuffer()
    assert buf.feed(b"PI") == []
    assert buf.pending == 2
    assert buf.feed(b"NG\nSTA") == [b"PING"]
    assert buf.pending == 3
    assert buf.feed(b"TUS\nWATCH\nACQ") == [b"STATUS", b"WATCH"]
    assert buf.feed(b"") == []
    assert buf.feed(b"UIRE a\n") == [b"ACQUIRE a"]
    assert buf.pending == 0


def test_linebuffer_byte_at_a_time() -> None:
    buf = LineBuffer()
    out: list[bytes] = []
    for byte in b"PING\r\nSTATUS\n\n":
        out += buf.feed(bytes([byte]))
    assert out == [b"PING\r", b"STATUS", b""]
    assert [parse_request(line) for line in out[:2]] == [Ping(), Status()]


def test_linebuffer_crlf() -> None:
    assert LineBuffer().feed(b"PING\r\nWATCH\r\n") == [b"PING\r", b"WATCH\r"]


def test_linebuffer_exact_limit_ok() -> None:
    buf = LineBuffer()
    line = b"x" * (MAX_LINE - 1) + b"\n"
    assert buf.feed(line) == [line[:-1]]
    assert buf.feed(line[:-1]) == []  # tail of 4095 bytes: still fine
    assert buf.feed(b"\n") == [line[:-1]]


def test_linebuffer_complete_line_too_long() -> None:
    buf = LineBuffer()
    with pytest.raises(LineTooLong):
        buf.feed(b"x" * MAX_LINE + b"\n")
    with pytest.raises(LineTooLong):
        buf.feed(b"PING\n")  # the stream cannot be resynchronised


def test_linebuffer_partial_tail_too_long() -> None:
    buf = LineBuffer()
    assert buf.feed(b"x" * (MAX_LINE - 1)) == []
    with pytest.raises(LineTooLong) as info:
        buf.feed(b"x")
    assert info.value.code is ErrorCode.LINE_TOO_LONG


def test_linebuffer_tail_after_good_lines_too_long() -> None:
    with pytest.raises(LineTooLong):
        LineBuffer().feed(b"PING\n" + b"y" * MAX_LINE)


def test_linebuffer_custom_limit() -> None:
    buf = LineBuffer(MAX_SERVER_LINE)
    body = b"OK " + b"x" * 10_000
    assert buf.feed(body + b"\n") == [body]


# --- sizes ----------------------------------------------------------------------------

SIZES = [
    ("0", 0),
    ("1", 1),
    ("7B", 7),
    ("1KiB", 1024),
    ("1.5KiB", 1536),
    ("512MiB", 512 * 1024**2),
    ("10GiB", 10737418240),
    ("0GiB", 0),
    ("2.5GiB", 5 * GIB // 2),
]


@pytest.mark.parametrize(("text", "value"), SIZES)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize(
    "text", ["", "5XiB", "5K", "5G", "5gib", "-1", "1.5", "0.1KiB", "1e3", " 1", "1 GiB", "GiB"]
)
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_size(text)
    assert info.value.code is ErrorCode.BAD_ARGUMENT


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0, "0"),
        (1, "1"),
        (1023, "1023"),
        (1024, "1KiB"),
        (1536, "1536"),
        (3 * GIB, "3GiB"),
        (5 * 1024**2, "5MiB"),
        (PARKED_MAX_LIMIT, "10GiB"),
        (GIB + 1024, "1048577KiB"),
    ],
)
def test_format_size(value: int, text: str) -> None:
    assert format_size(value) == text
    assert parse_size(text) == value


def test_format_size_rejects_negative() -> None:
    with pytest.raises(ProtocolError):
        format_size(-1)


# --- server lines ---------------------------------------------------------------------

STATUS_BODY = {
    "version": "0.1.0",
    "uptime_s": 12.5,
    "gpus": [{"index": 0, "uuid": "GPU-x", "resident": None, "holder": None, "queue": []}],
    "workloads": [],
    "totals": {"grants": 0},
}

SERVER_LINES: list[tuple[bytes, object]] = [
    (b"OK", Ok()),
    (b"OK proto=1 server=slicer/0.1.0", Ok({"proto": "1", "server": "slicer/0.1.0"})),
    (b"OK turn=7 restored=0 waited_ms=12", Ok({"turn": "7", "restored": "0", "waited_ms": "12"})),
    (b"OK empty=", Ok({"empty": ""})),
    (
        b'OK {"version":"0.1.0","uptime_s":12.5,"gpus":[{"index":0,"uuid":"GPU-x",'
        b'"resident":null,"holder":null,"queue":[]}],"workloads":[],"totals":{"grants":0}}',
        Ok(body=STATUS_BODY),
    ),
    (b"ERR busy", Err(ErrorCode.BUSY)),
    (b"ERR timeout waited_ms=5000", Err(ErrorCode.TIMEOUT, {"waited_ms": "5000"})),
    (
        b"ERR not-holder turn=3 -- turn 3 is not current -- holder=other, a=b",
        Err(ErrorCode.NOT_HOLDER, {"turn": "3"}, "turn 3 is not current -- holder=other, a=b"),
    ),
    (b"ERR some-future-code -- hi", Err("some-future-code", text="hi")),
    (
        b"FAULT sampler turn=7 reason=park-failed -- cuda-checkpoint exited 1",
        Fault("sampler", 7, "park-failed", "cuda-checkpoint exited 1"),
    ),
    (b"FAULT sampler turn=0 reason=restore-failed", Fault("sampler", 0, "restore-failed")),
    (b"WAITING sampler turn=7 waiters=1", Waiting("sampler", 7, 1)),
    (b"PARK sampler turn=7 timeout_ms=60000", ParkAsk("sampler", 7, 60000)),
    (b"PARK sampler turn=0", ParkAsk("sampler", 0)),
    (b"EARLY sampler bytes=17179869184", Early("sampler", 16 * GIB)),
    (
        b'EVENT {"event":"granted","t":12.25,"workload":"a","turn":7}',
        Event({"event": "granted", "t": 12.25, "workload": "a", "turn": 7}),
    ),
]


@pytest.mark.parametrize(("line", "expected"), SERVER_LINES)
def test_server_line_round_trip(line: bytes, expected: object) -> None:
    assert parse_server_line(line) == expected
    assert parse_server_line(line + b"\r\n") == expected
    assert encode(expected) == line + b"\n"  # type: ignore[arg-type]


def test_server_line_non_canonical_forms() -> None:
    assert parse_server_line(b"ERR busy --") == Err("busy")
    assert parse_server_line(b"ERR busy --  two  spaces ") == Err("busy", text=" two  spaces ")
    assert parse_server_line(b"OK  a=1   b=2\n") == Ok({"a": "1", "b": "2"})
    assert parse_server_line(b"OK   {}") == Ok(body={})


def test_err_code_normalised() -> None:
    assert Err("busy").code is ErrorCode.BUSY
    assert Err("busy") == Err(ErrorCode.BUSY)
    assert Err.from_error(ProtocolError(ErrorCode.EMPTY, "empty line")) == Err(
        ErrorCode.EMPTY, text="empty line"
    )


def test_err_text_newlines_become_spaces() -> None:
    data = encode(Err(ErrorCode.INTERNAL, text="line one\nline two\r\nthree\r"))
    assert data == b"ERR internal -- line one line two three \n"


def test_err_long_text_is_shortened() -> None:
    data = encode(Err(ErrorCode.INTERNAL, text="é" * 5000))
    assert len(data) <= MAX_LINE
    msg = parse_server_line(data)
    assert isinstance(msg, Err) and msg.text and set(msg.text) == {"é"}


def test_status_line_may_exceed_max_line() -> None:
    body = {"workloads": [{"name": f"w{i}", "pids": list(range(20))} for i in range(100)]}
    data = encode(Ok(body=body))
    assert MAX_LINE < len(data) <= MAX_SERVER_LINE
    assert parse_server_line(data) == Ok(body=body)


BAD_SERVER_LINES: list[tuple[bytes, ErrorCode]] = [
    (b"", E.EMPTY),
    (b"\r", E.EMPTY),
    (b"\xff", E.BAD_ENCODING),
    (b"ok", E.UNKNOWN_VERB),
    (b"PING", E.UNKNOWN_VERB),
    (b"ERR", E.MISSING_ARGUMENT),
    (b"ERR Busy", E.BAD_ARGUMENT),
    (b"ERR busy extra", E.BAD_ARGUMENT),
    (b"OK turn", E.BAD_ARGUMENT),
    (b"OK a=1 a=2", E.BAD_ARGUMENT),
    (b"OK -- text", E.BAD_ARGUMENT),
    (b"OK {bad json", E.BAD_ARGUMENT),
    (b'OK {"x":NaN}', E.BAD_ARGUMENT),
    (b"OK " + b"[" * 100_000, E.BAD_ARGUMENT),
    (b"EVENT [1]", E.BAD_ARGUMENT),
    (b"EVENT", E.BAD_ARGUMENT),
    (b"FAULT", E.MISSING_ARGUMENT),
    (b"FAULT a turn=1", E.MISSING_ARGUMENT),
    (b"FAULT -a turn=1 reason=x", E.BAD_NAME),
    (b"FAULT a turn=-1 reason=x", E.BAD_ARGUMENT),
    (b"FAULT a turn=1 reason=x color=red", E.BAD_ARGUMENT),
    (b"WAITING a turn=1", E.MISSING_ARGUMENT),
    (b"WAITING a turn=0 waiters=1", E.BAD_ARGUMENT),
    (b"WAITING a turn=1 waiters=1 -- hi", E.BAD_ARGUMENT),
    (b"EARLY a", E.MISSING_ARGUMENT),
    (b"EARLY a bytes=0", E.BAD_ARGUMENT),
    (b"EARLY a bytes=1GiB", E.BAD_ARGUMENT),
    (b"EARLY a bytes=1 turn=2", E.BAD_ARGUMENT),
    (b"EARLY a bytes=1 -- hi", E.BAD_ARGUMENT),
    (b"EARLY bytes=1", E.MISSING_ARGUMENT),
    (b"OK " + b"x" * MAX_SERVER_LINE, E.LINE_TOO_LONG),
]


@pytest.mark.parametrize(("line", "code"), BAD_SERVER_LINES)
def test_bad_server_line_code(line: bytes, code: ErrorCode) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_server_line(line)
    assert info.value.code is code


def test_constants() -> None:
    assert MAX_LINE == 4096
    assert PROTO_VERSION == 1
    assert PARKED_MAX_LIMIT == 10 * GIB
    assert {c.value for c in ErrorCode} >= {
        "unsupported-proto", "exists", "forbidden", "no-such-process", "unknown-gpu",
        "bad-request", "unknown-workload", "busy", "timeout", "faulted", "gone",
        "restore-failed", "not-holder", "park-failed", "line-too-long",
    }  # fmt: skip
