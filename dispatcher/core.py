"""The dispatcher's pure decisions: validating a request, building the body sent to
vLLM, the commit rule, which revision to serve next and when a turn ends.

No I/O, no trio, no clock: every function takes what it needs and returns a value, so
each rule is tested by a table.

The commit rule (invariant 4: a result comes only from the weights it asked for):
a result counts only if

* every choice carries ``weight_versions`` (vLLM's ``return_weight_versions``) and
  every span in them has ``version == p.revision`` (a span with another version means
  the weights changed under the request, even for part of it);
* the replica still has ``p.revision`` loaded;
* the replica's epoch is unchanged since the send: the turn loop bumps the epoch on
  every sleep, load and recovery, so a request that straddled one (say a sleep with
  ``mode=abort`` that cut it short with HTTP 200) is not committed;
* no choice ended with ``finish_reason: "abort"`` and there are as many choices as
  the request's ``n`` (:func:`result_ok`).

Otherwise the request stays pending and is sent again later.

Two ways to check the weights (``slicer-dispatch --weight-check``):

``spans`` (the default; vLLM 0.33 and later)
    The per-choice ``weight_versions`` spans above: vLLM itself vouches, token range by
    token range, for the weights each choice was generated with.
``label`` (vLLM releases that ignore ``return_weight_versions``, such as 0.32)
    Such a vLLM returns no ``weight_versions`` at all, so the spans rule would refuse
    every result. Instead, after the response arrives the sender reads the served
    label once (``GET /weight_info``) and passes it as ``label``: the result counts only
    if that label is ``p.revision``, along with the loaded-revision, epoch, abort and
    ``n`` conditions; spans, if any, are ignored. This is weaker than the spans:

    - it samples the label once, *after* the request: a weight change that happened
      during the request and was undone before the check (A -> B -> A) is invisible;
    - it trusts that nobody but this dispatcher loads weights into the replica while it
      holds the turn: the epoch counts only this dispatcher's own sleeps, loads and
      recoveries, and the label only says which label was last set, not which weights
      served the tokens;
    - it relies on loads never running under a send, which :mod:`dispatcher.serve`
      guarantees (a load starts only with no send in flight, and a send is in flight
      until its ``/weight_info`` check is done).

    A failed ``/weight_info`` call is no evidence either way: the request stays pending
    like after a failed send.

Batched prompts (``slicer-dispatch --batch-prompts N``): vLLM's ``/v1/completions``
takes a list of prompts and answers choice ``index = position * n + j``.
:func:`batch_key` says which completion samples may share one send (identical params,
same prompt form), :func:`batch_request_body` builds the send, and :func:`split_batch`
turns the answer into one body per sample; each is then judged by :func:`result_ok` on
its own, exactly like the answer of a send of its own.

The sleep level of a turn's end (``slicer-dispatch --sleep-level``) is
:func:`sleep_level`'s: level 2 when the next wake loads other weights anyway.
"""

from __future__ import annotations

import array
import json
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from gpu_slicer.dispatcher.errors import BadRequest, quoted
from gpu_slicer.dispatcher.model import WEIGHT_CHECKS, Pending

__all__ = [
    "KINDS",
    "LOAD_BACKOFF_MAX_S",
    "LOAD_BACKOFF_MIN_S",
    "MAX_N",
    "MAX_PARAMS_BYTES",
    "WEIGHT_CHECKS",
    "ParsedBody",
    "TurnPlan",
    "batch_key",
    "batch_request_body",
    "commit_ok",
    "load_retry_delay",
    "lone_surrogate",
    "next_revision",
    "parse_body",
    "parse_model",
    "request_body",
    "result_ok",
    "sleep_level",
    "split_batch",
    "weight_versions",
]

KINDS = ("completion", "chat")
LOAD_BACKOFF_MIN_S, LOAD_BACKOFF_MAX_S = 1.0, 30.0  # a failed load's first and usual bound
MAX_N = 16
MAX_PARAMS_BYTES = 1 << 20
_MAX_TOKEN_ID = (1 << 31) - 1
# Fields the dispatcher owns: the prompt is held apart, the revision picks the weights,
# and the send is always non-streaming with weight versions (the front re-streams).
_STRIPPED = frozenset(
    {"prompt", "messages", "stream", "stream_options", "model", "revision",
     "return_weight_versions"}
)  # fmt: skip


@dataclass(frozen=True)
class ParsedBody:
    """A validated request: what the store journals and holds."""

    params: dict[str, Any]
    prompt: array.array[int] | bytes | None
    messages: bytes | None
    revision: str | None  # from body["revision"] or the model's "@REV" suffix


def _is_int(v: object) -> bool:
    return type(v) is int  # bool is an int subclass, and JSON true is no count


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def parse_model(model: str) -> tuple[str, str | None]:
    """Split ``"NAME@REV"`` into (NAME, REV); a model without ``@`` has no revision."""
    name, at, rev = model.rpartition("@")
    if not at:
        return model, None
    if not rev:
        raise BadRequest(
            f"model {quoted(model, 200)} ends with '@' but names no revision after it",
            param="model",
        )
    return name, rev


def _parse_prompt(prompt: object, max_tokens: int, max_bytes: int) -> array.array[int] | bytes:
    # A batch of one ([str] or [[int, ...]]) is unwrapped; a real batch would need one
    # result per prompt, which a sample id cannot carry. [["a"]] is no prompt at all.
    if isinstance(prompt, list) and len(prompt) == 1 and _one_prompt(prompt[0]):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt must not be empty")
        text = prompt.encode("utf-8")  # lone surrogates were refused by parse_body
        if len(text) > max_bytes:
            raise BadRequest(
                f"prompt is {len(text)} bytes of UTF-8 text, more than the limit of {max_bytes}"
            )
        return text
    if not isinstance(prompt, list):
        raise BadRequest(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        )
    if not prompt:
        raise BadRequest("prompt must not be an empty list")
    # The type scan runs in C (map/set); the per-item searches only name the culprit.
    types = set(map(type, prompt))
    if str in types or list in types:
        bad = next(
            (i for i, x in enumerate(prompt) if isinstance(x, list) and not _one_prompt(x)), None
        )
        if bad is not None:
            raise BadRequest(
                f"prompt[{bad}] must be a string or a list of token ids, got {quoted(prompt[bad])}"
            )
        raise BadRequest(
            f"prompt is a batch of {len(prompt)} prompts where a sample has one: send them "
            "as one POST /v1/completions (a prompt list) or POST /v1/samples/batch"
        )
    if len(prompt) > max_tokens:
        raise BadRequest(f"prompt has {len(prompt)} tokens, more than the limit of {max_tokens}")
    if types != {int}:
        bad = next(i for i, t in enumerate(prompt) if not _is_int(t))
        raise BadRequest(f"prompt[{bad}] must be an integer token id, got {quoted(prompt[bad])}")
    if min(prompt) < 0 or max(prompt) > _MAX_TOKEN_ID:
        raise BadRequest(f"prompt token ids must be in 0..{_MAX_TOKEN_ID}")
    return array.array("i", prompt)


def _one_prompt(x: object) -> bool:
    """Whether ``x`` is one prompt's shape: a string or a list of integers (checked in C)."""
    return isinstance(x, str) or (isinstance(x, list) and set(map(type, x)) <= {int})


def _parse_messages(messages: object, max_bytes: int) -> bytes:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of message objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object, got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}].role must be a string")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise BadRequest(f"messages[{i}].content must be a string, a list or null")
    packed = json.dumps(messages, separators=(",", ":"), ensure_ascii=False).encode()
    if len(packed) > max_bytes:
        raise BadRequest(
            f"messages are {len(packed)} bytes of JSON, more than the limit of {max_bytes}"
        )
    return packed


_Path = tuple[Any, str | int] | None  # (parent path, key or index); None: the body
_NESTED = (str, list, dict)
_SCALARS = frozenset({int, float, bool, type(None)})  # what JSON parses to, strings aside


def _surrogate_at(text: str) -> int | None:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def lone_surrogate(value: object) -> str | None:
    """Where ``value`` (parsed JSON) holds a lone UTF-16 surrogate, or None if nowhere.

    JSON escapes such as ``"\\ud800"`` parse into Python strings that no UTF-8 encoder
    accepts, so such a request could never be sent to vLLM. The answer names the first
    field at fault in document order (``prompt``, ``user``, ``messages[0].content``, or
    ``a key of logit_bias``) and the offset of the surrogate in it.
    """
    # Iterative, and a path is a chain of (parent, step) links spelled out only for the
    # field at fault: a token list of 32k ints costs no strings.
    todo: list[tuple[_Path, object]] = [(None, value)]
    while todo:
        where, v = todo.pop()
        if isinstance(v, str):
            at = _surrogate_at(v)
            if at is not None:
                return f"{_spell(where)} (offset {at})"
        elif isinstance(v, dict):
            for k in v:
                at = _surrogate_at(k)
                if at is not None:
                    return f"a key of {_spell(where)} (offset {at})"
            kids = [((where, k), x) for k, x in v.items() if isinstance(x, _NESTED)]
            todo += reversed(kids)
        elif isinstance(v, list):
            # A token list (32k ints) holds no string: skip it with one C-level scan.
            if _SCALARS.issuperset(map(type, v)):
                continue
            kids = [((where, i), x) for i, x in enumerate(v) if isinstance(x, _NESTED)]
            todo += reversed(kids)
    return None


def _spell(path: _Path) -> str:
    steps: list[str | int] = []
    while path is not None:
        path, step = path
        steps.append(step)
    out = ""
    for step in reversed(steps):
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else step)
    return out or "the body"


def _check_params(kind: str, body: dict[str, Any]) -> None:
    for field in ("max_tokens", "max_completion_tokens"):
        v = body.get(field)
        if v is not None and not (_is_int(v) and v >= 1):
            raise BadRequest(f"{field} must be a positive integer, got {quoted(v)}")
    n = body.get("n")
    if n is not None and not (_is_int(n) and 1 <= n <= MAX_N):
        raise BadRequest(f"n must be an integer from 1 to {MAX_N}, got {quoted(n)}")
    t = body.get("temperature")
    if t is not None and not (_is_number(t) and t >= 0):
        raise BadRequest(f"temperature must be a number >= 0, got {quoted(t)}")
    p = body.get("top_p")
    if p is not None and not (_is_number(p) and 0 < p <= 1):
        raise BadRequest(f"top_p must be a number in (0, 1], got {quoted(p)}")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise BadRequest(f"seed must be an integer, got {quoted(seed)}")
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise BadRequest("stop must be a string or a list of strings")
    for field in ("stream", "return_weight_versions"):
        if field in body and not isinstance(body[field], bool):
            raise BadRequest(f"{field} must be true or false, got {quoted(body[field])}")
    for field in ("model", "revision"):
        if body.get(field) is not None and not isinstance(body[field], str):
            raise BadRequest(f"{field} must be a string, got {type(body[field]).__name__}")
    other = "messages" if kind == "completion" else "prompt"
    if other in body:
        raise BadRequest(f"{other!r} is not a field of a {kind} request", param=other)


def parse_body(
    kind: str, body: object, max_prompt_tokens: int, max_prompt_bytes: int
) -> ParsedBody:
    """Validate an OpenAI request body of ``kind`` ("completion" or "chat").

    Raises :class:`BadRequest` naming the field at fault (any string of the body, keys
    too, with a lone surrogate: :func:`lone_surrogate`). The returned ``params`` are
    the body minus prompt/messages, ``stream``/``stream_options``, ``model``,
    ``revision`` and ``return_weight_versions`` (the dispatcher sets those itself).
    """
    if kind not in KINDS:
        raise BadRequest(f"kind must be one of {KINDS}, got {quoted(kind)}")
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    bad = lone_surrogate(body)
    if bad is not None:
        raise BadRequest(
            f"{bad} holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its "
            "pair), which is not valid Unicode text"
        )
    _check_params(kind, body)
    prompt: array.array[int] | bytes | None = None
    messages: bytes | None = None
    if kind == "completion":
        if "prompt" not in body:
            raise BadRequest("missing field 'prompt'")
        prompt = _parse_prompt(body["prompt"], max_prompt_tokens, max_prompt_bytes)
    else:
        if "messages" not in body:
            raise BadRequest("missing field 'messages'")
        messages = _parse_messages(body["messages"], max_prompt_bytes)
    revision: str | None = body.get("revision")
    if revision is None and isinstance(body.get("model"), str):
        revision = parse_model(body["model"])[1]
    params = {k: v for k, v in body.items() if k not in _STRIPPED}
    return ParsedBody(params, prompt, messages, revision)


def request_body(p: Pending, model: str) -> dict[str, Any]:
    """The JSON body to POST to vLLM for ``p``, served as model name ``model``."""
    body = dict(p.params)
    if p.kind == "chat":
        body["messages"] = json.loads(p.messages or b"[]")
    elif isinstance(p.prompt, array.array):
        body["prompt"] = p.prompt.tolist()
    elif p.prompt is not None:
        body["prompt"] = p.prompt.decode("utf-8")
    body["model"] = model
    body["return_weight_versions"] = True
    body["stream"] = False
    return body


def batch_key(p: Pending) -> str:
    """What completion samples must share to go in one send: the prompt form (text or
    token ids: a batch never mixes them) and the params, canonically encoded. Computed
    once per :class:`Pending` and cached on it (``Pending.batch_key``).

    Only for completions (a chat sample is never batched); raises TypeError/ValueError
    when the params are no JSON (the caller then sends the sample alone)."""
    if not p.batch_key:
        form = "text:" if isinstance(p.prompt, bytes) else "ids:"
        p.batch_key = form + json.dumps(p.params, sort_keys=True, separators=(",", ":"))
    return p.batch_key


def batch_request_body(ps: Sequence[Pending], model: str) -> dict[str, Any]:
    """The body of ONE send for the completion samples ``ps`` (same :func:`batch_key`):
    :func:`request_body` of the first with ``prompt`` the list of every prompt, in order."""
    body = request_body(ps[0], model)
    body["prompt"] = [
        p.prompt.tolist() if isinstance(p.prompt, array.array) else (p.prompt or b"").decode()
        for p in ps
    ]
    return body


def split_batch(answer: dict[str, Any], k: int, n: int) -> list[dict[str, Any]] | None:
    """Split vLLM's answer to a send of ``k`` prompts with ``n`` choices each into one
    body per prompt, in order; None when its choices are not exactly indexes
    ``0 .. k*n-1`` (each once), so no part of it can be told apart.

    Body ``i`` is the answer's top-level fields as they came (``id``, ``object``,
    ``created``, ``model``, ``usage``: the usage of the whole send, ...) with ``choices``
    the choices ``i*n .. i*n+n-1`` renumbered ``0 .. n-1``, plus ``"batch": {"size": k,
    "position": i}`` (so a reader can tell the usage is shared)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != k * n:
        return None
    parts: list[list[dict[str, Any]]] = [[] for _ in range(k)]
    seen: set[int] = set()
    for c in choices:
        i = c.get("index") if isinstance(c, dict) else None
        if type(i) is not int or not 0 <= i < k * n or i in seen:
            return None
        seen.add(i)
        parts[i // n].append(c)
    out = []
    for pos, part in enumerate(parts):
        part.sort(key=lambda c: c["index"])
        body = dict(answer)
        body["choices"] = [{**c, "index": j} for j, c in enumerate(part)]
        body["batch"] = {"size": k, "position": pos}
        out.append(body)
    return out


def weight_versions(body: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Each choice's ``weight_versions`` from a vLLM response (``[]`` where missing)."""
    choices = body.get("choices")
    if not isinstance(choices, list):
        return []
    out: list[list[dict[str, Any]]] = []
    for c in choices:
        wv = c.get("weight_versions") if isinstance(c, dict) else None
        out.append(wv if isinstance(wv, list) else [])
    return out


def commit_ok(
    p: Pending,
    choice_weight_versions: list[list[dict[str, Any]]],
    loaded_revision: str,
    epoch_at_send: int,
    epoch_now: int,
    label: str | None = None,
) -> bool:
    """The commit rule (module docstring): may this response be stored as ``p``'s result?

    ``label`` None checks the spans (``--weight-check spans``); a string is the label
    ``GET /weight_info`` gave after the response (``--weight-check label``), checked
    instead of the spans, which are then ignored.
    """
    if epoch_at_send != epoch_now or loaded_revision != p.revision:
        return False
    if not choice_weight_versions:
        return False
    if label is not None:
        return label == p.revision
    for spans in choice_weight_versions:
        # No spans means vLLM could not vouch for the weights: never commit on trust.
        if not spans:
            return False
        if any(not isinstance(s, dict) or s.get("version") != p.revision for s in spans):
            return False
    return True


def result_ok(
    p: Pending,
    body: dict[str, Any],
    loaded_revision: str,
    epoch_at_send: int,
    epoch_now: int,
    label: str | None = None,
) -> bool:
    """:func:`commit_ok` on a whole vLLM response, also refusing aborted choices and a
    wrong number of choices (``label`` as for :func:`commit_ok`).

    A sleep or pause with ``mode=abort`` ends a request with HTTP 200 and
    ``finish_reason: "abort"`` (partial text): never a result, whatever the epoch says.
    """
    choices = body.get("choices")
    if not isinstance(choices, list) or any(
        not isinstance(c, dict) or c.get("finish_reason") == "abort" for c in choices
    ):
        return False
    wanted = p.params.get("n") or 1
    if len(choices) != wanted:
        return False
    return commit_ok(p, weight_versions(body), loaded_revision, epoch_at_send, epoch_now, label)


def next_revision(store_pending_revisions: list[str], loaded: str | None) -> str | None:
    """The revision to serve next: the loaded one if it has work (no reload), else the
    one waiting longest (``store_pending_revisions`` is oldest first); None if idle."""
    if loaded is not None and loaded in store_pending_revisions:
        return loaded
    return store_pending_revisions[0] if store_pending_revisions else None


def load_retry_delay(failures: int, refused: int, pooled: bool, cap: float) -> float:
    """Seconds before a revision whose load failed is tried again on this replica.

    ``failures`` failed loads in a row, ``refused`` of them refused by a replica still
    healthy right after (the revision's fault). In pool mode a refused load backs off
    by 4x from 1 s up to ``cap`` (``--load-backoff-max``): a path this node cannot read
    costs its trainer a park at 0, 1, 5, 21, 85, 341 s, ... then one every ``cap``,
    where the old 30 s cap cost one every 30 s until the deadline. Any other failure
    (no answer, a replica that died with the load: the replica's fault, soon mended)
    and every single-node failure doubles from 1 s up to 30 s (single-node mode fails
    the requests after a few refusals instead)."""
    if pooled and refused > 0:
        return min(cap, LOAD_BACKOFF_MIN_S * 4.0 ** min(refused - 1, 64))
    return min(LOAD_BACKOFF_MAX_S, LOAD_BACKOFF_MIN_S * 2.0 ** min(max(failures, 1) - 1, 64))


def sleep_level(
    mode: str,
    loaded: str | None,
    wanted: Collection[str],
    newest: str | None,
    changing: bool = False,
) -> int:
    """vLLM's sleep level at a turn's end (``slicer-dispatch --sleep-level``).

    ``mode`` "1" or "2" is that level. "auto": level 2 (drop the weights) when the next
    wake will load other weights anyway, else level 1 (copy them to host RAM and back):

    * nothing known is loaded (``loaded`` None: a failed load, a level-2 wake not
      finished, a recovery): the next wake loads whatever it serves;
    * ``wanted`` (the revisions pending requests ask for) holds ``loaded``: level 1, as
      the next wake serves the loaded revision first (:func:`next_revision`);
    * ``wanted`` holds only other revisions: level 2;
    * nothing is pending: level 2 if a revision other than ``loaded`` is the newest
      published (``newest``), which the next unpinned requests take, or if the weights
      have been ``changing`` (each of the last turns loaded another revision: an RL loop,
      whose trainer publishes the next one while the replica sleeps); else level 1.
    """
    if mode in ("1", "2"):
        return int(mode)
    if loaded is None:
        return 2
    if loaded in wanted:
        return 1
    if wanted:
        return 2
    return 2 if changing or (newest is not None and newest != loaded) else 1


@dataclass(frozen=True)
class TurnPlan:
    """When a sampler turn ends.

    A turn ends when nothing is pending for this replica, or when another workload
    waits (WAITING seen) and ``turn_seconds`` have passed since the turn *started
    serving*. Counting from the start of serving (not from WAITING) bounds how long the
    waiter waits by ``turn_seconds`` plus grace, whenever it arrived; counting from
    serving (the caller passes the time the wake and any load finished, not the
    acquire) keeps a long weight load from eating the window it was done for.
    """

    turn_seconds: float = 30.0

    @staticmethod
    def should_end(
        now: float,
        turn_started: float,
        waiting_seen_at: float | None,
        pending_for_replica: int,
        turn_seconds: float,
    ) -> bool:
        """Whether the turn should end at ``now`` (see the class docstring)."""
        if pending_for_replica <= 0:
            return True
        return waiting_seen_at is not None and now - turn_started >= turn_seconds

    def ends_at(self, turn_started: float, waiting_seen_at: float | None) -> float | None:
        """When the turn must end if work remains (None: not while nobody waits)."""
        if waiting_seen_at is None:
            return None
        return turn_started + self.turn_seconds
