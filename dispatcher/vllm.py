"""An async client of one vLLM replica: the calls of shared/VLLM_API.md, each bounded.

Every call is bounded *as a whole* by ``trio.fail_after`` (connect, send, every read
of the body), not per read: a replica that trickles one byte a minute still answers
within the bound or not at all (invariant 6). httpx's own timeouts are left off except
the connect timeout, so the whole-call bound is the only one that fires on a slow read.

Every failure is a :class:`ReplicaError`: ``status`` is vLLM's HTTP status, or None
when no answer came (timeout, refused connection, malformed JSON). The message carries
vLLM's own error message (``{"error": {"message": ...}}``).

Generation requests (:meth:`Replica.complete`, :meth:`Replica.complete_raw`) go over
:mod:`dispatcher.wire`, a lean keep-alive HTTP/1.1 pool (httpx costs more CPU per
request than the dispatcher's whole budget); control calls stay on httpx, one
connection each. A base URL wire cannot serve (https, user info), or an injected httpx
``transport`` (tests), sends generation requests through httpx too.

``epoch`` counts the events that invalidate requests in flight (sleep, weight load,
recovery); it is bumped *before* the call is sent, so a response that arrives after
such an event can never carry the epoch it was sent under (see ``core.commit_ok``).
``known_version`` is the revision this client itself loaded completely, or None when
unknown (first sight, after a broken load or a recovery): the turn loop must load
whenever it differs from the wanted revision, whatever ``/weight_info`` says, because
a broken reload can leave the old label on half-new weights. A replica restarted at the
same URL (its launcher restarted) serves its boot weights under ``"default"``: the turn
loop reads ``/weight_info`` at each wake and the health probe between turns, and
:meth:`Replica.forget` drops ``known_version`` when the label is not the one loaded.

``dropped`` says a level-2 sleep of this client discarded the weights and no load has
put real ones back since: the next wake must be the level-2 order (ANCHORS.md, vLLM's
sleep-mode docs): :meth:`Replica.wake_weights` (``/wake_up?tags=weights``), a whole
:meth:`Replica.load`, then :meth:`Replica.wake_kv_cache` (``/wake_up?tags=kv_cache``,
``/reset_prefix_cache``). Without the load vLLM serves garbage from the re-allocated
weights. ``kv_asleep`` is true between the first and the last step: vLLM still counts
as sleeping then, so a ``/sleep`` is a no-op that would leave the woken weights on the
GPU (the turn loop finishes the wake first). Neither is touched by :meth:`recover` or
:meth:`forget`: a restarted replica is woken in the same order, which suits any state.

``awake`` says this client last left the replica fully awake (a lazy release: nobody
else wanted the GPU, so the turn ended without a sleep). Someone else may have slept it
since (slicerd asked the launcher to park it): the next turn reads ``GET /is_sleeping``
and, if asleep, :meth:`Replica.sleep_state` (``GET /metrics``), and
:meth:`Replica.slept_by_other` records what that sleep left: level 1 kept the weights,
anything else (level 2, an unreadable state) counts as :attr:`dropped`.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio

from gpu_slicer.dispatcher import wire
from gpu_slicer.dispatcher.errors import ReplicaError
from gpu_slicer.proto.vllm_metrics import parse_sleep_state

__all__ = ["CONTROL_TIMEOUT_S", "MAX_IDLE_CONNECTIONS", "Replica", "parse_sleep_state"]

CONTROL_TIMEOUT_S = 30.0
# Idle keep-alive connections kept to the replica once a burst is over (--max-idle-
# connections): a burst of `concurrency` sends opens that many, and each idle one costs the
# replica a socket and a buffer until its keep-alive timeout closes it.
MAX_IDLE_CONNECTIONS = 32
_PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
_SLEEP_MODES = ("abort", "wait", "keep")


def _error_message(resp: httpx.Response) -> str:
    """vLLM's error text: ``error.message``, FastAPI's ``detail``, else the raw body."""
    return _error_text(resp.content, resp.reason_phrase)


def _error_text(raw: bytes, reason: str) -> str:
    """:func:`_error_message` of a raw response body and its reason phrase."""
    try:
        data = json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")[:500] or reason
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return _clean(str(err["message"])[:500])
        if "detail" in data:
            return _clean(str(data["detail"])[:500])
    return json.dumps(data)[:500]


def _clean(text: str) -> str:
    # A JSON "\ud800" escape parses into a lone surrogate that no UTF-8 encoder (SQLite's
    # included) accepts; the text is stored and served, so make it encodable.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class Replica:
    """One vLLM server at ``base_url`` (e.g. ``http://127.0.0.1:8000``); at most
    ``max_idle`` idle connections are kept to it (those past it close when their send
    ends)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
        max_idle: int = MAX_IDLE_CONNECTIONS,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.epoch = 0
        self.known_version: str | None = None
        self.dropped = False  # our level-2 sleep discarded the weights; none loaded since
        self.kv_asleep = False  # woken by wake_weights, wake_kv_cache not yet sent
        self.awake = False  # we left it fully awake (a lazy release); unknown: False
        # A control call failed or timed out: what vLLM holds (asleep? which weights?) is
        # unknown until settle() read it back; nothing is sent before.
        self.unknown = False
        # A wake failed or was cut off: the weights may be on the GPU without their KV
        # cache, which vLLM calls sleeping (a /sleep then does nothing); until a whole
        # wake or a sleep succeeds.
        self.half_woken = False
        self._wire = (
            None if transport is not None
            else wire.Pool.from_url(
                self.base_url, max_idle=max_idle, connect_timeout=connect_timeout
            )
        )  # fmt: skip
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            transport=transport,
            # Concurrency is bounded by the turn loop; here only idle connections are.
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=max_idle),
            timeout=httpx.Timeout(None, connect=connect_timeout),
        )

    async def aclose(self) -> None:
        """Close the connection pools."""
        if self._wire is not None:
            self._wire.close()
        await self._client.aclose()

    async def __aenter__(self) -> Replica:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- one bounded call ------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        timeout: float,
        *,
        json_body: Any = None,
        params: dict[str, Any] | None = None,
        keep_alive: bool = False,
    ) -> httpx.Response:
        """Send one request bounded by ``timeout`` s; a non-2xx answer raises.

        Control calls go out with ``Connection: close``: real vLLM (uvicorn) resets the
        connection after a 500 from an unhandled error, such as the bare
        ``finish_weight_update`` every recovery sends, and the next call that reused the
        pooled connection would fail with a connection reset. They are a few per turn;
        only generation requests (``keep_alive``) reuse connections.
        """
        what = f"{method} {self.base_url}{path}"
        headers = None if keep_alive else {"Connection": "close"}
        try:
            with trio.fail_after(timeout):
                resp = await self._client.request(
                    method, path, json=json_body, params=params, headers=headers
                )
        except trio.TooSlowError:
            raise ReplicaError(f"{what}: no answer within {timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise ReplicaError(f"{what}: {type(exc).__name__}: {exc}") from exc
        if not resp.is_success:
            raise ReplicaError(
                f"{what}: HTTP {resp.status_code}: {_error_message(resp)}", resp.status_code
            )
        return resp

    async def _json(self, method: str, path: str, timeout: float, **kw: Any) -> dict[str, Any]:
        resp = await self._call(method, path, timeout, **kw)
        return self._object(f"{method} {self.base_url}{path}", resp.content)

    @staticmethod
    def _object(what: str, raw: bytes) -> dict[str, Any]:
        # Strict UTF-8 without a BOM: the raw bytes are spliced into the front's answers as
        # they are, so only a document any JSON reader accepts may pass (json.loads on
        # bytes would also take a BOM and UTF-16/32).
        try:
            data = None if raw[:3] == b"\xef\xbb\xbf" else json.loads(raw.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError included
            data = None
        if not isinstance(data, dict):
            got = raw[:200].decode("utf-8", "replace")
            raise ReplicaError(f"{what}: expected a JSON object, got {got!r}")
        return data

    async def _post_wire(self, pool: wire.Pool, path: str, payload: bytes, timeout: float) -> bytes:
        """:meth:`_call` for a generation POST over ``pool``: the 2xx body, raw."""
        what = f"POST {self.base_url}{path}"
        try:
            with trio.fail_after(timeout):
                resp = await pool.post_json(path, payload)
        except trio.TooSlowError:
            raise ReplicaError(f"{what}: no answer within {timeout:g} s") from None
        except wire.WireError as exc:
            raise ReplicaError(f"{what}: {exc}") from exc
        if not 200 <= resp.status < 300:
            raise ReplicaError(
                f"{what}: HTTP {resp.status}: {_error_text(resp.body, resp.reason)}", resp.status
            )
        return resp.body

    async def _field(self, method: str, path: str, key: str, kind: type, timeout: float) -> Any:
        data = await self._json(method, path, timeout)
        value = data.get(key)
        if not isinstance(value, kind):
            raise ReplicaError(
                f"{method} {self.base_url}{path}: no {kind.__name__} {key!r} in {data}"[:500]
            )
        return value

    # -- the calls -------------------------------------------------------------------

    async def health(self, timeout: float = 10) -> bool:
        """Whether ``GET /health`` answers 200 within ``timeout`` (True while asleep).

        A probe: any failure (503 dead engine, refused connection, timeout) is False.
        """
        return await self.check_health(timeout) is None

    async def check_health(self, timeout: float = 10) -> str | None:
        """:meth:`health` saying why: None when ``GET /health`` answers 200 within
        ``timeout``, else the failure in words (``GET URL/health: HTTP 503: ...``)."""
        try:
            await self._call("GET", "/health", timeout)
        except ReplicaError as e:
            return str(e)
        return None

    async def _control(self, method: str, path: str, timeout: float, **kw: Any) -> dict[str, Any]:
        """:meth:`_json` for a call that changes the replica's state: a failure (no answer,
        an error, a timeout) leaves it :attr:`unknown` (it may have acted, in part)."""
        try:
            return await self._json(method, path, timeout, **kw)
        except BaseException:  # cancelled too: the call may be going on inside vLLM
            self.unknown = True
            raise

    async def wake(self, timeout: float = 300) -> None:
        """``POST /wake_up`` (all tags); raises unless the replica says it is awake."""
        try:
            data = await self._control("POST", "/wake_up", timeout)
        except BaseException:
            self.half_woken = True  # vLLM wakes the weights first, then the KV cache
            raise
        if data.get("status", "awake") != "awake":
            self.unknown = self.half_woken = True
            raise ReplicaError(f"POST {self.base_url}/wake_up: still {data.get('status')!r}")
        self.kv_asleep = self.half_woken = False
        self.awake = True

    async def wake_weights(self, timeout: float = 300) -> None:
        """The first step of a level-2 wake: ``POST /wake_up?tags=weights``. vLLM
        re-allocates the weights (garbage until a :meth:`load`) and stays asleep,
        scheduling included, until :meth:`wake_kv_cache`."""
        try:
            data = await self._control("POST", "/wake_up", timeout, params={"tags": "weights"})
        except BaseException:
            # Weights copied back in part, or not at all: only a whole load proves them,
            # and the next wake goes in the level-2 order (weights, load, KV cache). The
            # replica may be half-woken (weights without KV cache), which vLLM calls
            # sleeping: :attr:`half_woken` makes the turn's end wake it whole to sleep it.
            self.known_version, self.dropped, self.half_woken = None, True, True
            raise
        status = data.get("status")
        if status not in ("sleeping", "awake"):
            self.unknown = True
            raise ReplicaError(f"POST {self.base_url}/wake_up?tags=weights: {status!r}")
        self.kv_asleep = status == "sleeping"
        self.awake = status == "awake"

    async def wake_kv_cache(self, timeout: float = 300) -> None:
        """The last step of a level-2 wake, after the load: ``POST
        /wake_up?tags=kv_cache`` (vLLM is then awake and schedules again), then ``POST
        /reset_prefix_cache``. On a failure the weights count as unknown again (and
        :attr:`dropped`): the next turn wakes in the level-2 order and loads whole."""
        try:
            data = await self._control("POST", "/wake_up", timeout, params={"tags": "kv_cache"})
            if data.get("status", "awake") != "awake":
                raise ReplicaError(
                    f"POST {self.base_url}/wake_up?tags=kv_cache: still {data.get('status')!r}"
                )
            self.kv_asleep = False
            self.awake = True
            reset = await self._control("POST", "/reset_prefix_cache", timeout)
            if reset.get("success") is False:
                raise ReplicaError(f"POST {self.base_url}/reset_prefix_cache: not reset")
        except BaseException:  # cancelled too: the wake may be going on inside vLLM
            self.epoch += 1
            self.known_version = None
            self.dropped = True
            self.unknown = self.half_woken = True
            raise

    async def sleep(self, level: int = 1, mode: str = "abort", timeout: float = 300) -> None:
        """``POST /sleep?level=&mode=``; bumps the epoch first (requests in flight die).

        What it did is recorded only once vLLM said so: a sleep that failed or timed out
        leaves the replica :attr:`unknown` (it may be awake, asleep at this level, or
        slept since by someone else at another: slicerd has its launcher park a replica
        that still holds its memory, at the launcher's own level), never "asleep with
        its weights kept"."""
        if level not in (0, 1, 2) or mode not in _SLEEP_MODES:
            raise ValueError(f"sleep level must be 0..2 and mode one of {_SLEEP_MODES}")
        self.epoch += 1
        self.awake = False  # nothing is sent until a wake (or settle) says it is awake
        await self._control("POST", "/sleep", timeout, params={"level": level, "mode": mode})
        if level == 2:
            self.known_version = None  # level 2 drops the weights
            self.dropped = True
        self.kv_asleep = self.half_woken = False

    async def is_sleeping(self, timeout: float = CONTROL_TIMEOUT_S) -> bool:
        """``GET /is_sleeping`` (also true while paused)."""
        return bool(await self._field("GET", "/is_sleeping", "is_sleeping", bool, timeout))

    async def sleep_state(self, timeout: float = CONTROL_TIMEOUT_S) -> str | None:
        """What ``GET /metrics`` says of the engine's sleep (:func:`parse_sleep_state`):
        ``awake``, ``weights_offloaded`` (level 1), ``discard_all`` (level 2), ``paused``,
        or None when it cannot be read (no answer, no such metric)."""
        try:
            resp = await self._call("GET", "/metrics", timeout)
        except ReplicaError:
            return None
        return parse_sleep_state(resp.content.decode("utf-8", "replace"))

    def slept_by_other(self, state: str | None) -> None:
        """Record that someone else slept the replica (found asleep after we left it
        awake) in ``state`` (:meth:`sleep_state`): level 1 (``weights_offloaded``) or a
        pause kept the weights, so a plain wake serves them; anything else (level 2,
        unreadable) counts as :attr:`dropped`, so the next wake goes in the level-2 order
        and loads whole before anything is sent."""
        self.epoch += 1  # requests of before the sleep are dead
        self.awake = False
        if state not in ("weights_offloaded", "paused"):
            self.known_version = None
            self.dropped = True

    async def settle(self, timeout: float = CONTROL_TIMEOUT_S) -> str:
        """Read back what an :attr:`unknown` replica holds (after a failed control call):
        ``GET /is_sleeping``, the sleep state (``GET /metrics``) and ``GET /weight_info``,
        each bounded by ``timeout``; a read that fails raises (it stays unknown). The
        revision loaded stays :attr:`known_version` only when that proves its weights
        whole: the label is still ours and the sleep state one that keeps weights (awake,
        level 1, paused); anything else (level 2, an unreadable state, another label)
        counts as no weights loaded, in the level-2 order while asleep (wake the weights,
        load whole, then the KV cache). Returns what it found, in words (for the log)."""
        sleeping = await self.is_sleeping(timeout)
        state = await self.sleep_state(timeout)
        label = await self.weight_version(timeout)
        self.epoch += 1  # nothing sent before counts
        # A sleeping replica may be half-woken (weights without their KV cache): what a
        # failed wake left stays suspected; vLLM's answers cannot tell the two apart.
        self.awake, self.kv_asleep = not sleeping, self.kv_asleep and sleeping
        kept = state in ("awake", "weights_offloaded", "paused") and not self.dropped
        if self.known_version is not None and not (kept and label == self.known_version):
            self.known_version = None
        if self.known_version is None and sleeping:
            self.dropped = True  # the level-2 order suits any state of the weights
        self.unknown = False
        whole = "weights whole" if self.known_version else "weights unknown: loaded whole next"
        return f"is_sleeping={sleeping}, sleep state {state}, label {label!r}: {whole}"

    async def is_paused(self, timeout: float = CONTROL_TIMEOUT_S) -> bool:
        """``GET /is_paused`` (also true while asleep)."""
        return bool(await self._field("GET", "/is_paused", "is_paused", bool, timeout))

    async def model_root(self, timeout: float = CONTROL_TIMEOUT_S) -> str:
        """What vLLM was started with (``vllm serve MODEL``): ``GET /v1/models``' first
        card's ``root``, a directory or a hub name."""
        data = await self._json("GET", "/v1/models", timeout)
        cards = data.get("data")
        card = cards[0] if isinstance(cards, list) and cards else None
        root = card.get("root") if isinstance(card, dict) else None
        if not isinstance(root, str) or not root:
            raise ReplicaError(f"GET {self.base_url}/v1/models: no model root in {data}"[:500])
        return root

    async def weight_version(self, timeout: float = CONTROL_TIMEOUT_S) -> str:
        """The served weight label, ``GET /weight_info`` (``"default"`` until set)."""
        return str(await self._field("GET", "/weight_info", "weight_version", str, timeout))

    async def load(self, revision: str, path: str, timeout: float = 1800) -> None:
        """Load weights ``revision`` from directory ``path`` as a whole, within ``timeout``.

        ``collective_rpc reload_weights``, ``update_weight_version``,
        ``reset_prefix_cache`` (cached KV of the old weights must not serve the new ones),
        then ``/weight_info`` must say ``revision``. On any failure ``known_version``
        stays None: the weights may be half-loaded, so call :meth:`recover` and load
        again in a later turn.
        """
        self.epoch += 1
        self.known_version = None
        try:
            with trio.fail_after(timeout):
                await self._json(
                    "POST",
                    "/collective_rpc",
                    timeout,
                    json_body={"method": "reload_weights", "kwargs": {"weights_path": path}},
                )
                await self._json(
                    "POST", "/update_weight_version", timeout, json_body={"new_version": revision}
                )
                reset = await self._json("POST", "/reset_prefix_cache", timeout)
                if reset.get("success") is False:
                    raise ReplicaError(
                        f"POST {self.base_url}/reset_prefix_cache: the cache was not reset"
                    )
                got = await self.weight_version(timeout)
        except trio.TooSlowError:
            raise ReplicaError(
                f"load of revision {revision} from {path} on {self.base_url}: "
                f"not done within {timeout:g} s"
            ) from None
        if got != revision:
            raise ReplicaError(
                f"load of revision {revision} on {self.base_url}: /weight_info says {got!r}"
            )
        self.known_version = revision
        self.dropped = False

    async def finish_open_update(self, timeout: float = CONTROL_TIMEOUT_S) -> bool:
        """ONE bare ``POST /finish_weight_update``: True if it closed an open update,
        False on vLLM's 500 for "no update open". Only for :meth:`recover`."""
        try:
            await self._call("POST", "/finish_weight_update", timeout)
        except ReplicaError as exc:
            if exc.status == 500:
                return False
            raise
        return True

    async def recover(self, timeout: float = CONTROL_TIMEOUT_S) -> None:
        """First sight of the replica, or after our own load broke off (VLLM_API.md):
        close any open weight update with one bare finish, and count its version as
        unknown until a full :meth:`load`.

        A pause is not ended here: the turn's full :meth:`wake`, which always follows,
        ends it (vLLM resumes its scheduler once fully awake). ``/resume`` is never sent
        to a replica that may be asleep: ``/is_paused`` is also true while asleep, and
        resuming a slept vLLM would schedule requests on offloaded weights."""
        self.epoch += 1
        self.known_version = None
        await self.finish_open_update(timeout)

    def forget(self) -> None:
        """Count the loaded version as unknown (and every request in flight as sent to
        another replica) without a call: the process at ``base_url`` may be a new one
        (a failed probe, or weights other than ours), so the next turn recovers and
        loads the wanted revision whole."""
        self.epoch += 1
        self.known_version = None

    async def complete(self, kind: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        """POST ``body`` to ``/v1/completions`` (kind "completion") or
        ``/v1/chat/completions`` (kind "chat"); the response's JSON object."""
        return (await self.complete_raw(kind, body, timeout))[1]

    async def complete_raw(
        self, kind: str, body: dict[str, Any], timeout: float
    ) -> tuple[bytes, dict[str, Any]]:
        """:meth:`complete`, also returning vLLM's response bytes as they came (to store
        and serve without encoding them again): ``(raw, parsed object)``.

        ``body`` must be plain JSON: NaN or infinity raise ValueError, as with httpx."""
        path = _PATHS.get(kind)
        if path is None:
            raise ValueError(f"kind must be one of {tuple(_PATHS)}, got {kind!r}")
        if self._wire is None:
            raw = (await self._call("POST", path, timeout, json_body=body, keep_alive=True)).content
        else:
            # Encoded as httpx would (compact, UTF-8, no NaN), once.
            payload = json.dumps(
                body, ensure_ascii=False, separators=(",", ":"), allow_nan=False
            ).encode("utf-8")
            raw = await self._post_wire(self._wire, path, payload, timeout)
        return raw, self._object(f"POST {self.base_url}{path}", raw)
