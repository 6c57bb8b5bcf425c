"""Requests: parsing a client line into a `Request`, and encoding one back.

Each verb has a table entry: how many positionals it takes (0 or the workload name),
which keys it knows and which of them are required. Checks run in a fixed order so
that one bad line always gets the same code: line-too-long, bad-encoding, empty,
unknown-verb, bad-argument (``--`` token, bad or duplicate key, misplaced or extra
positional), missing-argument (workload), bad-name, bad-argument (unknown key),
missing-argument (required key), then each value (bad-argument / unsupported-proto).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpu_slicer.proto.errors import ErrorCode, ProtocolError
from gpu_slicer.proto.framing import decode_line, split_args
from gpu_slicer.proto.messages import (
    Acquire,
    Hello,
    Parked,
    ParkFallback,
    ParkMode,
    Ping,
    Register,
    Release,
    ReleasePark,
    Request,
    Status,
    Unregister,
    Watch,
)
from gpu_slicer.proto.values import (
    CLIENT_RE,
    EARLY_LIMIT,
    GPU_RE,
    MAX_LINE,
    MAX_TURN_LIMIT,
    PARKED_MAX_LIMIT,
    PID_MAX,
    PROTO_VERSION,
    check_int,
    check_seconds,
    check_token,
    format_size,
    parse_choice,
    parse_int,
    parse_seconds,
    parse_size,
    validate_name,
)

__all__ = ["encode_request", "parse_request"]


@dataclass(frozen=True, slots=True)
class _Verb:
    takes_workload: bool
    keys: tuple[str, ...] = ()
    required: tuple[str, ...] = ()


_VERBS: dict[str, _Verb] = {
    "HELLO": _Verb(False, ("proto", "client")),
    "PING": _Verb(False),
    "REGISTER": _Verb(
        True, ("gpu", "pid", "tree", "park", "parked_max", "fallback", "ask", "max_turn")
    ),
    "ACQUIRE": _Verb(True, ("wait", "early")),
    "RELEASE": _Verb(True, ("turn", "park", "used"), required=("turn",)),
    "PARKED": _Verb(True, ("turn", "ok"), required=("turn",)),
    "UNREGISTER": _Verb(True),
    "STATUS": _Verb(False),
    "WATCH": _Verb(False),
}


def parse_request(line: bytes) -> Request:
    """Parse one request line (with or without its ``\\n``) into a request message.

    Raises `ProtocolError` with the precise code (see the module docstring) and a
    message that names the verb and the offending argument.
    """
    text = decode_line(line, MAX_LINE)
    verb, _, rest = text.lstrip(" ").partition(" ")
    spec = _VERBS.get(verb)
    if spec is None:
        shown = verb if len(verb) <= 40 else verb[:37] + "..."
        raise ProtocolError(ErrorCode.UNKNOWN_VERB, f"unknown verb {shown!r}")
    positionals, pairs = split_args(verb, rest)
    if len(positionals) > int(spec.takes_workload):
        what = "a workload name" if spec.takes_workload else "no positional arguments"
        raise ProtocolError(
            ErrorCode.BAD_ARGUMENT,
            f"{verb}: takes {what}, got extra argument {positionals[-1][:40]!r}",
        )
    workload = ""
    if spec.takes_workload:
        if not positionals:
            raise ProtocolError(ErrorCode.MISSING_ARGUMENT, f"{verb}: missing workload name")
        workload = _name(verb, positionals[0])
    for key in pairs:
        if key not in spec.keys:
            known = ", ".join(f"{k}=" for k in spec.keys) or "none"
            raise ProtocolError(
                ErrorCode.BAD_ARGUMENT, f"{verb}: unknown key {key}= (known keys: {known})"
            )
    for key in spec.required:
        if key not in pairs:
            raise ProtocolError(ErrorCode.MISSING_ARGUMENT, f"{verb}: missing {key}=")
    return _BUILDERS[verb](workload, pairs)


def _name(verb: str, name: str) -> str:
    try:
        return validate_name(name)
    except ProtocolError as exc:
        raise ProtocolError(exc.code, f"{verb}: {exc.message}") from None


def _hello(_: str, pairs: dict[str, str]) -> Hello:
    proto = PROTO_VERSION
    if "proto" in pairs:
        proto = parse_int("HELLO", "proto", pairs["proto"], 0)
        if proto != PROTO_VERSION:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED_PROTO,
                f"HELLO: unsupported proto={proto}, this server speaks proto={PROTO_VERSION}",
            )
    client = None
    if "client" in pairs:
        client = check_token("HELLO", "client", pairs["client"], CLIENT_RE)
    return Hello(proto=proto, client=client)


def _register(workload: str, pairs: dict[str, str]) -> Register:
    gpu = pid = None
    if "gpu" in pairs:
        gpu = check_token("REGISTER", "gpu", pairs["gpu"], GPU_RE)
    if "pid" in pairs and pairs["pid"] != "self":  # self: the sender, as with no pid
        pid = parse_int("REGISTER", "pid", pairs["pid"], 1, PID_MAX)
    tree = parse_choice("REGISTER", "tree", pairs.get("tree", "1"), ("1", "0")) == "1"
    park = ParkMode(
        parse_choice("REGISTER", "park", pairs.get("park", "checkpoint"), tuple(ParkMode))
    )
    parked_max = _bytes("REGISTER", "parked_max", pairs, PARKED_MAX_LIMIT)
    fallback = ParkFallback(
        parse_choice("REGISTER", "fallback", pairs.get("fallback", "none"), tuple(ParkFallback))
    )
    ask = parse_choice("REGISTER", "ask", pairs.get("ask", "0"), ("1", "0")) == "1"
    max_turn = None
    if "max_turn" in pairs:
        max_turn = _max_turn(parse_seconds("REGISTER", "max_turn", pairs["max_turn"]), park)
    return Register(
        workload,
        gpu=gpu,
        pid=pid,
        tree=tree,
        park=park,
        parked_max=parked_max,
        fallback=fallback,
        ask=ask,
        max_turn=max_turn,
    )


def _max_turn(value: float, park: str) -> float:
    if not 0 < value <= MAX_TURN_LIMIT:
        raise ProtocolError(
            ErrorCode.BAD_ARGUMENT,
            f"REGISTER: max_turn must be in (0, {MAX_TURN_LIMIT:g}] seconds, got {value:g}",
        )
    if park != ParkMode.CHECKPOINT:
        # Only the slicer's own park can take a turn back; a cooperative workload parks
        # itself, so it gets WAITING hints only.
        raise ProtocolError(
            ErrorCode.BAD_ARGUMENT,
            f"REGISTER: max_turn needs park=checkpoint (park={park} gets WAITING hints only)",
        )
    return value


def _bytes(verb: str, key: str, pairs: dict[str, str], limit: int) -> int:
    """The size `key` of `pairs` (0 when absent), at most `limit` bytes."""
    if key not in pairs:
        return 0
    raw = pairs[key]
    try:
        value = parse_size(raw)
    except ProtocolError as exc:
        raise ProtocolError(exc.code, f"{verb}: {key}: {exc.message}") from None
    if value > limit:
        raise ProtocolError(
            ErrorCode.BAD_ARGUMENT, f"{verb}: {key} must be <= {format_size(limit)}, got {raw}"
        )
    return value


def _acquire(workload: str, pairs: dict[str, str]) -> Acquire:
    wait = parse_seconds("ACQUIRE", "wait", pairs["wait"]) if "wait" in pairs else None
    return Acquire(workload, wait=wait, early=_bytes("ACQUIRE", "early", pairs, EARLY_LIMIT))


def _release(workload: str, pairs: dict[str, str]) -> Release:
    turn = parse_int("RELEASE", "turn", pairs["turn"], 1)
    park = ReleasePark(
        parse_choice("RELEASE", "park", pairs.get("park", "lazy"), tuple(ReleasePark))
    )
    used = parse_choice("RELEASE", "used", pairs.get("used", "1"), ("1", "0")) == "1"
    return Release(workload, turn=turn, park=park, used=used)


def _parked(workload: str, pairs: dict[str, str]) -> Parked:
    # turn=0 answers a PARK that named no turn (a workload never granted).
    turn = parse_int("PARKED", "turn", pairs["turn"], 0)
    ok = parse_choice("PARKED", "ok", pairs.get("ok", "1"), ("1", "0")) == "1"
    return Parked(workload, turn=turn, ok=ok)


_BUILDERS: dict[str, Callable[[str, dict[str, str]], Request]] = {
    "HELLO": _hello,
    "PING": lambda _w, _p: Ping(),
    "REGISTER": _register,
    "ACQUIRE": _acquire,
    "RELEASE": _release,
    "PARKED": _parked,
    "UNREGISTER": lambda w, _p: Unregister(w),
    "STATUS": lambda _w, _p: Status(),
    "WATCH": lambda _w, _p: Watch(),
}


def encode_request(msg: Request) -> bytes:
    """Encode a request as one line ending in ``\\n``.

    Validates every field first (raising `ProtocolError` with the code a server would
    give); optional REGISTER and RELEASE keys are written only when not default.
    ``Hello(proto=N)`` encodes for any N >= 1 so that clients can probe servers.
    """
    words: list[str]
    match msg:
        case Hello(proto=proto, client=client):
            words = ["HELLO", f"proto={check_int('HELLO', 'proto', proto, 1)}"]
            if client is not None:
                words.append(f"client={check_token('HELLO', 'client', client, CLIENT_RE)}")
        case Ping():
            words = ["PING"]
        case Register():
            words = _encode_register(msg)
        case Acquire(workload=workload, wait=wait, early=early):
            words = ["ACQUIRE", _name("ACQUIRE", workload)]
            if wait is not None:
                words.append(f"wait={check_seconds('ACQUIRE', 'wait', wait)}")
            if check_int("ACQUIRE", "early", early, 0, EARLY_LIMIT):
                words.append(f"early={early}")
        case Release(workload=workload, turn=turn, park=park, used=used):
            words = [
                "RELEASE",
                _name("RELEASE", workload),
                f"turn={check_int('RELEASE', 'turn', turn, 1)}",
            ]
            if park != ReleasePark.LAZY:
                words.append(f"park={parse_choice('RELEASE', 'park', park, tuple(ReleasePark))}")
            if not used:
                words.append("used=0")
        case Parked(workload=workload, turn=turn, ok=ok):
            words = [
                "PARKED",
                _name("PARKED", workload),
                f"turn={check_int('PARKED', 'turn', turn, 0)}",
            ]
            if not ok:
                words.append("ok=0")
        case Unregister(workload=workload):
            words = ["UNREGISTER", _name("UNREGISTER", workload)]
        case Status():
            words = ["STATUS"]
        case Watch():
            words = ["WATCH"]
        case _:
            raise ProtocolError(ErrorCode.INTERNAL, f"not a request: {type(msg).__name__}")
    data = (" ".join(words) + "\n").encode("ascii")
    if len(data) > MAX_LINE:  # pragma: no cover - valid fields stay far below the limit
        raise ProtocolError(ErrorCode.LINE_TOO_LONG, f"request of {len(data)} bytes")
    return data


def _encode_register(msg: Register) -> list[str]:
    words = ["REGISTER", _name("REGISTER", msg.workload)]
    if msg.gpu is not None:
        words.append(f"gpu={check_token('REGISTER', 'gpu', msg.gpu, GPU_RE)}")
    if msg.pid is not None:
        words.append(f"pid={check_int('REGISTER', 'pid', msg.pid, 1, PID_MAX)}")
    if not isinstance(msg.tree, bool):
        raise ProtocolError(
            ErrorCode.BAD_ARGUMENT, f"REGISTER: tree must be a bool, got {msg.tree!r}"
        )
    if not msg.tree:
        words.append("tree=0")
    park = parse_choice("REGISTER", "park", msg.park, tuple(ParkMode))
    if park != ParkMode.CHECKPOINT:
        words.append(f"park={park}")
    parked_max = check_int("REGISTER", "parked_max", msg.parked_max, 0, PARKED_MAX_LIMIT)
    if parked_max:
        words.append(f"parked_max={format_size(parked_max)}")
    fallback = parse_choice("REGISTER", "fallback", msg.fallback, tuple(ParkFallback))
    if fallback != ParkFallback.NONE:
        words.append(f"fallback={fallback}")
    if not isinstance(msg.ask, bool):
        raise ProtocolError(
            ErrorCode.BAD_ARGUMENT, f"REGISTER: ask must be a bool, got {msg.ask!r}"
        )
    if msg.ask:
        words.append("ask=1")
    if msg.max_turn is not None:
        value = _max_turn(float(check_seconds("REGISTER", "max_turn", msg.max_turn)), park)
        words.append(f"max_turn={value!r}")
    return words
