"""Server lines: parsing what a client reads (`Ok`, `Err`, `Fault`, `Waiting`, `Early`,
`Preempted`, `ParkAsk`, `Event`), and encoding them on the server.

Lines with a JSON body (``OK {...}`` from STATUS, ``EVENT {...}``) may be up to
`MAX_SERVER_LINE` bytes; every other server line fits in `MAX_LINE`, human text being
shortened on encode to fit. JSON is compact (``separators=(",", ":")``), ASCII-only and
never contains NaN or Infinity.
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

from gpu_slicer.proto.errors import ErrorCode, LineTooLong, ProtocolError
from gpu_slicer.proto.framing import decode_line, split_args, split_tail
from gpu_slicer.proto.messages import (
    Early,
    Err,
    Event,
    Fault,
    Ok,
    ParkAsk,
    Preempted,
    ServerMessage,
    Waiting,
)
from gpu_slicer.proto.values import (
    CODE_RE,
    EARLY_LIMIT,
    INT_MAX,
    MAX_LINE,
    MAX_SERVER_LINE,
    check_int,
    check_token,
    parse_int,
    validate_name,
)

__all__ = ["encode_server_message", "parse_server_line"]

_SERVER_VERBS = ("OK", "ERR", "FAULT", "WAITING", "EARLY", "PREEMPTED", "PARK", "EVENT")


def parse_server_line(line: bytes) -> ServerMessage:
    """Parse one line sent by the server (with or without its ``\\n``).

    Raises `ProtocolError` with the same codes as `parse_request`: line-too-long (over
    `MAX_SERVER_LINE`), bad-encoding, empty, unknown-verb, missing-argument, bad-name,
    bad-argument.
    """
    text = decode_line(line, MAX_SERVER_LINE)
    verb, _, rest = text.partition(" ")
    if verb not in _SERVER_VERBS:
        raise ProtocolError(ErrorCode.UNKNOWN_VERB, f"unknown server verb {verb[:40]!r}")
    if verb == "OK":
        return _parse_ok(rest)
    if verb == "EVENT":
        body = _load_json("EVENT", rest)
        if not isinstance(body, dict):
            _bad("EVENT: body must be a JSON object")
        return Event(body)
    head, tail = split_tail(rest)
    if verb in ("WAITING", "EARLY", "PREEMPTED", "PARK") and tail is not None:
        _bad(f"{verb}: takes no ' -- ' text")
    positionals, pairs = split_args(verb, head)
    if verb == "ERR":
        return _parse_err(positionals, pairs, tail)
    if verb == "FAULT":
        workload = _one_name(verb, positionals)
        _known_keys(verb, pairs, ("turn", "reason"))
        turn = parse_int(verb, "turn", _required(verb, pairs, "turn"), 0)
        reason = check_token(verb, "reason", _required(verb, pairs, "reason"), CODE_RE)
        return Fault(workload, turn=turn, reason=reason, text=tail or "")
    workload = _one_name(verb, positionals)
    if verb == "PARK":
        _known_keys(verb, pairs, ("turn", "timeout_ms"))
        turn = parse_int(verb, "turn", _required(verb, pairs, "turn"), 0)
        ms = (
            parse_int(verb, "timeout_ms", pairs["timeout_ms"], 0) if "timeout_ms" in pairs else None
        )
        return ParkAsk(workload, turn=turn, timeout_ms=ms)
    if verb == "EARLY":
        _known_keys(verb, pairs, ("bytes",))
        nbytes = parse_int(verb, "bytes", _required(verb, pairs, "bytes"), 1, EARLY_LIMIT)
        return Early(workload, nbytes=nbytes)
    if verb == "PREEMPTED":
        _known_keys(verb, pairs, ("turn",))
        return Preempted(workload, turn=parse_int(verb, "turn", _required(verb, pairs, "turn"), 1))
    _known_keys(verb, pairs, ("turn", "waiters"))
    turn = parse_int(verb, "turn", _required(verb, pairs, "turn"), 1)
    waiters = parse_int(verb, "waiters", _required(verb, pairs, "waiters"), 0)
    return Waiting(workload, turn=turn, waiters=waiters)


def _parse_ok(rest: str) -> Ok:
    body_text = rest.lstrip(" ")
    if body_text.startswith(("{", "[")):
        return Ok(body=_load_json("OK", body_text))
    positionals, pairs = split_args("OK", rest)
    if positionals:
        _bad(f"OK: unexpected positional argument {positionals[0][:40]!r}")
    return Ok(fields=pairs)


def _parse_err(positionals: list[str], pairs: dict[str, str], tail: str | None) -> Err:
    if not positionals:
        raise ProtocolError(ErrorCode.MISSING_ARGUMENT, "ERR: missing error code")
    if len(positionals) > 1:
        _bad(f"ERR: unexpected positional argument {positionals[1][:40]!r}")
    code = check_token("ERR", "code", positionals[0], CODE_RE)
    return Err(code, fields=pairs, text=tail or "")


def _one_name(verb: str, positionals: list[str]) -> str:
    if not positionals:
        raise ProtocolError(ErrorCode.MISSING_ARGUMENT, f"{verb}: missing workload name")
    if len(positionals) > 1:
        _bad(f"{verb}: unexpected positional argument {positionals[1][:40]!r}")
    try:
        return validate_name(positionals[0])
    except ProtocolError as exc:
        raise ProtocolError(exc.code, f"{verb}: {exc.message}") from None


def _known_keys(verb: str, pairs: dict[str, str], keys: tuple[str, ...]) -> None:
    for key in pairs:
        if key not in keys:
            _bad(f"{verb}: unknown key {key}=")


def _required(verb: str, pairs: dict[str, str], key: str) -> str:
    if key not in pairs:
        raise ProtocolError(ErrorCode.MISSING_ARGUMENT, f"{verb}: missing {key}=")
    return pairs[key]


def _reject_constant(name: str) -> NoReturn:
    _bad(f"JSON constant {name} is not allowed")


def _load_json(verb: str, text: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ProtocolError as exc:
        raise ProtocolError(exc.code, f"{verb}: {exc.message}") from None
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"{verb}: bad JSON body: {exc}") from None


def _bad(message: str) -> NoReturn:
    raise ProtocolError(ErrorCode.BAD_ARGUMENT, message)


# --- encoding -------------------------------------------------------------------------


def encode_server_message(msg: ServerMessage) -> bytes:
    """Encode a server message as one line ending in ``\\n``.

    Raises `ProtocolError` for a message that could not be parsed back (bad key or
    value, bad name, an `Ok` with both fields and body, a body that is not JSON) and
    `LineTooLong` when a line would exceed its limit. `Err` and `Fault` text has its
    newlines replaced by spaces and is shortened to keep the line within `MAX_LINE`.
    """
    match msg:
        case Ok(fields=fields, body=body):
            if body is None:
                return _finish("OK", ["OK", *_fields("OK", fields)], MAX_LINE)
            if fields:
                _bad("OK: fields and body are never both set")
            if not isinstance(body, dict | list):
                _bad(f"OK: body must be a JSON object or array, got {type(body).__name__}")
            return _finish("OK", ["OK", _dump_json("OK", body)], MAX_SERVER_LINE)
        case Err(code=code, fields=fields, text=text):
            words = ["ERR", check_token("ERR", "code", str(code), CODE_RE), *_fields("ERR", fields)]
            return _with_text("ERR", words, text)
        case Fault(workload=workload, turn=turn, reason=reason, text=text):
            words = [
                "FAULT",
                _one_name("FAULT", [workload]),
                f"turn={check_int('FAULT', 'turn', turn, 0)}",
                f"reason={check_token('FAULT', 'reason', reason, CODE_RE)}",
            ]
            return _with_text("FAULT", words, text)
        case Waiting(workload=workload, turn=turn, waiters=waiters):
            words = [
                "WAITING",
                _one_name("WAITING", [workload]),
                f"turn={check_int('WAITING', 'turn', turn, 1)}",
                f"waiters={check_int('WAITING', 'waiters', waiters, 0, INT_MAX)}",
            ]
            return _finish("WAITING", words, MAX_LINE)
        case Early(workload=workload, nbytes=nbytes):
            words = [
                "EARLY",
                _one_name("EARLY", [workload]),
                f"bytes={check_int('EARLY', 'bytes', nbytes, 1, EARLY_LIMIT)}",
            ]
            return _finish("EARLY", words, MAX_LINE)
        case Preempted(workload=workload, turn=turn):
            words = [
                "PREEMPTED",
                _one_name("PREEMPTED", [workload]),
                f"turn={check_int('PREEMPTED', 'turn', turn, 1)}",
            ]
            return _finish("PREEMPTED", words, MAX_LINE)
        case ParkAsk(workload=workload, turn=turn, timeout_ms=ms):
            words = [
                "PARK",
                _one_name("PARK", [workload]),
                f"turn={check_int('PARK', 'turn', turn, 0)}",
            ]
            if ms is not None:
                words.append(f"timeout_ms={check_int('PARK', 'timeout_ms', ms, 0, INT_MAX)}")
            return _finish("PARK", words, MAX_LINE)
        case Event(body=body):
            if not isinstance(body, dict):
                _bad(f"EVENT: body must be a dict, got {type(body).__name__}")
            return _finish("EVENT", ["EVENT", _dump_json("EVENT", body)], MAX_SERVER_LINE)
        case _:
            raise ProtocolError(ErrorCode.INTERNAL, f"not a server message: {type(msg).__name__}")


def _fields(verb: str, fields: dict[str, str]) -> list[str]:
    if not isinstance(fields, dict):
        _bad(f"{verb}: fields must be a dict, got {type(fields).__name__}")
    words = []
    for key, value in fields.items():
        if not isinstance(key, str) or not key or not key.isascii() or not _is_key(key):
            _bad(f"{verb}: bad field key {key!r} (keys match [a-z_]+)")
        if not isinstance(value, str) or any(c in value for c in " \n\r"):
            _bad(f"{verb}: field {key}= must be a str without spaces or newlines, got {value!r}")
        words.append(f"{key}={value}")
    return words


def _is_key(key: str) -> bool:
    return all("a" <= c <= "z" or c == "_" for c in key)


def _with_text(verb: str, words: list[str], text: str) -> bytes:
    if not isinstance(text, str):
        _bad(f"{verb}: text must be a str, got {type(text).__name__}")
    head = _finish(verb, words, MAX_LINE)
    if not text:
        return head
    room = MAX_LINE - len(head) - len(" -- ")
    cleaned = text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")
    tail = cleaned.encode("utf-8", "replace")
    if len(tail) > room:
        tail = tail[: max(room, 0)].decode("utf-8", "ignore").encode("utf-8")
    return head[:-1] + b" -- " + tail + b"\n"


def _finish(verb: str, words: list[str], limit: int) -> bytes:
    try:
        data = (" ".join(words) + "\n").encode("utf-8")
    except UnicodeEncodeError:
        _bad(f"{verb}: line cannot be encoded as UTF-8")
    if len(data) > limit:
        raise LineTooLong(f"{verb} line of {len(data)} bytes exceeds the limit of {limit} bytes")
    return data


def _dump_json(verb: str, body: object) -> str:
    try:
        return json.dumps(body, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.BAD_ARGUMENT, f"{verb}: body is not JSON: {exc}") from None
