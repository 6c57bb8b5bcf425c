"""The pool's Redis address and its password: which URLs ``--queue`` takes, the URL as it
may be shown (no password, in any form), and the password from a file or the environment
(no client is loaded here, so the options are checked without importing coredis).

A password can be given three ways; the first that gives one wins:

1. in the URL: ``redis://:PW@HOST``, ``redis://USER:PW@HOST``, ``unix://:PW@/PATH`` or a
   ``password=PW`` query parameter (coredis' rule: the query wins over the rest);
2. ``--queue-password-file PATH``: the file's first line (what a Kubernetes Secret
   mounted as a volume holds), so the password is in no command line (``ps``) and in no
   pod spec;
3. ``$SLICER_REDIS_PASSWORD``.

Whatever the form, :func:`redact` shows the URL with ``***`` in its place and
:func:`scrub` takes every password this process knows out of a text (an error from
Redis or from the client library), so no ``/status``, log line or error shows one.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qs, parse_qsl, quote, unquote, urlencode, urlsplit

import click

__all__ = [
    "PASSWORD_ENV",
    "check_password_file",
    "check_url",
    "has_password",
    "load_password",
    "password_from",
    "read_password_file",
    "redact",
    "scrub",
    "url_passwords",
]

PASSWORD_ENV = "SLICER_REDIS_PASSWORD"
MAX_PASSWORD_BYTES = 4096
_HIDDEN = "***"


def _unparsed_userinfo(url: str) -> tuple[str, str, str] | None:
    """(scheme, user info, rest) of a URL whose user info holds an unescaped ``/``, ``?``
    or ``#`` (a generated password often does): URL parsing ends the host part there, so
    it would find no user info and show the password as a host or a port. None when the
    parser sees every ``@`` of the authority."""
    scheme, sep, after = url.partition("://")
    if not sep or "@" not in after:
        return None
    try:
        netloc = urlsplit(url).netloc
    except ValueError:
        netloc = ""
    if after.count("@") == netloc.count("@"):
        return None
    userinfo, _, rest = after.rpartition("@")
    return scheme, userinfo, rest


def redact(url: str) -> str:
    """``url`` with every password in it (user info, ``password=`` query) as ``***``."""
    if (raw := _unparsed_userinfo(url)) is not None:
        scheme, userinfo, rest = raw
        user = userinfo.split(":", 1)[0] if ":" in userinfo else ""
        return f"{scheme}://{user}:{_HIDDEN}@{redact(f'{scheme}://{rest}').partition('://')[2]}"
    try:
        parts = urlsplit(url)
    except ValueError:
        return _HIDDEN  # not even a URL: show nothing of it
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0] if ":" in userinfo else ""
        # A bare "redis://SECRET@host" is read as a password by some clients: hidden too.
        netloc = f"{user}:{_HIDDEN}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() == "password" for k, _ in pairs):
            pairs = [(k, _HIDDEN if k.lower() == "password" else v) for k, v in pairs]
            query = urlencode(pairs, safe="*/")
    if (netloc, query) == (parts.netloc, parts.query):
        return url  # nothing hidden: exactly as given
    out = f"{parts.scheme}://{netloc}{parts.path}"  # urlunsplit drops "//" with no host
    return out + (f"?{query}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")


def url_passwords(url: str) -> list[str]:
    """Every password ``url`` holds, as written and percent-decoded (for :func:`scrub`)."""
    out: list[str] = []
    if (raw := _unparsed_userinfo(url)) is not None:
        userinfo = raw[1]
        out += [userinfo, userinfo.split(":", 1)[-1]]
        url = f"{raw[0]}://{raw[2]}"
    try:
        parts = urlsplit(url)
    except ValueError:
        return [url]
    if "@" in parts.netloc:
        userinfo = parts.netloc.rsplit("@", 1)[0]
        out.append(userinfo.split(":", 1)[1] if ":" in userinfo else userinfo)
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        if k.lower() == "password":
            out.append(v)
    for pair in [p for p in parts.query.split("&") if p.lower().startswith("password=")]:
        out.append(pair.split("=", 1)[1])
    return [p for p in {*out, *(unquote(p) for p in out)} if p]


def has_password(url: str) -> bool:
    """Whether ``url`` (one :func:`check_url` accepts) gives a password: ``:PW@`` or
    ``USER:PW@`` in its user info, or a ``password=`` query (a user name alone gives none)."""
    parts = urlsplit(url)
    if parts.password is not None:
        return True
    return any(k.lower() == "password" for k, _ in parse_qsl(parts.query, keep_blank_values=True))


def scrub(text: str, secrets: list[str]) -> str:
    """``text`` with each of ``secrets`` (and its percent-encoded form) as ``***``."""
    for s in sorted({*secrets, *(quote(s, safe="") for s in secrets)}, key=len, reverse=True):
        if s:
            text = text.replace(s, _HIDDEN)
    return text


def check_url(url: str) -> str:
    """``url`` if it names a Redis this client can reach; ValueError saying why not (the
    message shows the URL redacted)."""
    shown = repr(redact(url))
    if _unparsed_userinfo(url) is not None:
        raise ValueError(
            f"{shown}: its user info holds '/', '?' or '#' (percent-encode the password: "
            "%2F, %3F, %23; or give it with --queue-password-file)"
        )
    parts = urlsplit(url)
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"{shown} names no socket path (unix:///PATH[?db=N])")
        db = parse_qs(parts.query).get("db", ["0"])[0]
    elif parts.scheme in ("redis", "rediss"):
        if not parts.hostname:
            raise ValueError(f"{shown} names no host (redis://HOST[:PORT][/DB])")
        try:
            parts.port  # noqa: B018 - a bad port raises here
        except ValueError as e:
            raise ValueError(f"{shown}: {scrub(str(e), url_passwords(url))}") from None
        db = parts.path.strip("/") or "0"
    else:
        raise ValueError(f"{shown} is not redis://HOST[:PORT][/DB] nor unix:///PATH[?db=N]")
    if not db.isdigit():
        raise ValueError(f"{shown}: the database must be a number, got {redact(db)!r}")
    return url


def read_password_file(path: str) -> str:
    """The password in file ``path`` (its first line, without the line end); ValueError
    saying why there is none (the message never holds the file's content)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PASSWORD_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read the password file {path!r}: {e.strerror or e}") from None
    if len(data) > MAX_PASSWORD_BYTES:
        raise ValueError(f"the password file {path!r} is longer than {MAX_PASSWORD_BYTES} bytes")
    line = data.split(b"\n", 1)[0].rstrip(b"\r")
    if not line:
        raise ValueError(f"the password file {path!r} holds no password on its first line")
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"the password file {path!r} is not UTF-8 text") from None


def password_from(file_password: str | None) -> str | None:
    """The password to give the client when the URL holds none: ``--queue-password-file``'s
    (already read), else ``$SLICER_REDIS_PASSWORD``, else None."""
    if file_password is not None:
        return file_password
    return os.environ.get(PASSWORD_ENV) or None


def check_password_file(
    _ctx: click.Context, _param: click.Parameter, value: str | None
) -> str | None:
    """``--queue-password-file``: a path (read by :func:`load_password` when the command
    runs, not when its line is parsed)."""
    if value is not None and (not value or "\0" in value):
        raise click.BadParameter(f"{value!r} is not a file name")
    return value


def load_password(path: str | None) -> str | None:
    """The password of ``--queue-password-file`` ``path`` (None: no file given);
    click.BadParameter naming the option when the file cannot give one."""
    if path is None:
        return None
    try:
        return read_password_file(path)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--queue-password-file'") from None
