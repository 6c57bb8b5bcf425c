"""The Redis password never shows: ``redact`` and ``scrub`` over every URL form, and
``check_url``'s errors (what the dispatcher and ``slicer-pool`` print at start)."""

from __future__ import annotations

import pytest

from gpu_slicer.dispatcher.poolurl import check_url, has_password, redact, scrub, url_passwords

SECRET = "s3cr"  # every password below contains it


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://alice:s3cret@h/1", "redis://alice:***@h/1"),
        ("redis://s3cret@h/0", "redis://:***@h/0"),  # a bare one is a password too
        ("redis://h/0?password=s3cret&db=2", "redis://h/0?password=***&db=2"),
        ("redis://h/0?PASSWORD=s3cr%20et", "redis://h/0?PASSWORD=***"),
        ("unix://:s3cret@/run/redis.sock?db=0", "unix://:***@/run/redis.sock?db=0"),
        # An unescaped '#', '?' or '/' in it ends the host part for a URL parser, which
        # then sees no user info at all and used to show the URL as given.
        ("redis://:s3cr#et@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://u:s3c?ret@h/0".replace("s3c", SECRET), "redis://u:***@h/0"),
        ("redis://u:s3cr/et@h:1/0", "redis://u:***@h:1/0"),
    ],
)
def test_redact_hides_the_password_in_every_form(url: str, shown: str) -> None:
    assert redact(url) == shown
    assert SECRET not in redact(url)
    assert all(SECRET in p for p in url_passwords(url)) and url_passwords(url)
    assert SECRET not in scrub(f"error connecting to {url}: refused", url_passwords(url))


def test_a_url_without_a_password_is_shown_as_given() -> None:
    for url in ("redis://h:6379/0", "unix:///run/redis.sock?db=3", "rediss://h/0"):
        assert redact(url) == url and url_passwords(url) == []


@pytest.mark.parametrize(
    "url", ["redis://:s3cr#et@h:6379/0", "redis://u:s3cr?et@h/0", "redis://u:s3cr/et@h/0"]
)
def test_check_url_refuses_an_unescaped_password_without_showing_it(url: str) -> None:
    with pytest.raises(ValueError, match="percent-encode the password") as e:
        check_url(url)
    assert SECRET not in str(e.value)


def test_check_url_errors_never_show_the_password() -> None:
    with pytest.raises(ValueError) as e:
        check_url("redis://:s3cret@h:notaport/0")
    assert SECRET not in str(e.value) and "***" in str(e.value)
    assert check_url("redis://:s3cret@h:6379/0") == "redis://:s3cret@h:6379/0"


@pytest.mark.parametrize(
    ("url", "has"),
    [
        ("redis://:pw@h/0", True),
        ("redis://alice:pw@h/0", True),
        ("redis://h/0?password=pw", True),
        ("redis://alice@h/0", False),  # an ACL user alone: the file's password goes with it
        ("unix://default@/run/redis.sock?db=0", False),
        ("redis://h/0", False),
    ],
)
def test_only_a_password_in_the_url_overrides_the_file_or_the_environment(
    url: str, has: bool
) -> None:
    assert has_password(url) is has
