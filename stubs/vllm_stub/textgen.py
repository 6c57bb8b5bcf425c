"""Deterministic fake tokenization and sampling.

A "token" is a word. The prompt's tokens are its whitespace-separated words hashed
into a 32000-id vocabulary (or the token ids given). Generated token ``i`` of choice
``index`` is a word from a fixed list picked by a hash of (prompt ids, weights
identity, seed, index, i): the same request against the same weights always gives the
same text, loading other weights changes it, and the weight_version label (which is
not the content) does not.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = ["VOCAB_SIZE", "WORDS", "Token", "next_token", "prompt_key", "tokenize"]

VOCAB_SIZE = 32000
_WORDS_TEXT = (
    "the of and to in is was for on that with as by at from it his an were are which "
    "this be had not or have one their first new has but after also two its they been "
    "who more other her all when during there time into year only most can some would "
    "over city may between about world later such many states three used school where "
    "while both these before through known since under part made then them being each "
    "area years early river several well during four around along war team until long "
    "state high including however work film best season people same national north game "
    "like second another named because million family major way against center number "
    "home life public members did following series around group five each south name "
    "because called became local west east government small old based within end music"
)
WORDS = tuple(_WORDS_TEXT.split())


@dataclass(frozen=True)
class Token:
    """One generated token: its id and its text (a word with a leading space)."""

    id: int
    text: str


def _h(*parts: object) -> int:
    data = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def tokenize(text: str) -> list[int]:
    """The fake token ids of ``text`` (one per whitespace-separated word)."""
    return [_h("tok", w) % VOCAB_SIZE for w in text.split()]


def prompt_key(ids: list[int]) -> int:
    """A short hash of a prompt's token ids."""
    return _h("prompt", *ids)


def next_token(key: int, identity: str, seed: int, index: int, i: int) -> Token:
    """Token ``i`` of choice ``index`` for prompt ``key`` under the given weights."""
    word = WORDS[_h(key, identity, seed, index, i) % len(WORDS)]
    return Token(id=WORDS.index(word), text=" " + word)
