"""The pool's Redis address: which URLs ``--queue`` takes (no client is loaded here, so
the option is checked without importing coredis)."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

__all__ = ["check_url"]


def check_url(url: str) -> str:
    """``url`` if it names a Redis this client can reach; ValueError saying why not."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"{url!r} names no socket path (unix:///PATH[?db=N])")
        db = parse_qs(parts.query).get("db", ["0"])[0]
    elif parts.scheme in ("redis", "rediss"):
        if not parts.hostname:
            raise ValueError(f"{url!r} names no host (redis://HOST[:PORT][/DB])")
        try:
            parts.port  # noqa: B018 - a bad port raises here
        except ValueError as e:
            raise ValueError(f"{url!r}: {e}") from None
        db = parts.path.strip("/") or "0"
    else:
        raise ValueError(f"{url!r} is not redis://HOST[:PORT][/DB] nor unix:///PATH[?db=N]")
    if not db.isdigit():
        raise ValueError(f"{url!r}: the database must be a number, got {db!r}")
    return url
