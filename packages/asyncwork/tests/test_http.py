"""``asyncwork.contrib.http.origin``: a URL's origin as every parser reads it, or ValueError."""

from __future__ import annotations

import pytest

from asyncwork.contrib.http import origin, origin_listed


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://API.Stripe.com/v1", "https://api.stripe.com"),
        ("https://api.stripe.com:443", "https://api.stripe.com"),
        ("http://127.0.0.1:9/", "http://127.0.0.1:9"),
        ("https://[::1]:8443/x", "https://[::1]:8443"),
    ],
)
def test_an_origin_is_lower_case_without_its_default_port(url: str, expected: str) -> None:
    assert origin(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        "ftp://example.com",
        "https://user:pw@example.com",
        "https://attacker.example\\@api.stripe.com",
        "https://exa\tmple.com",
        "https://example.com:99999",
        "https://",
        42,
    ],
)
def test_anything_else_is_refused(url: object) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the message is the caller's
        origin(url)


def test_a_listed_origin_has_no_path() -> None:
    assert origin_listed("https://proxy.example.com:8443/") == "https://proxy.example.com:8443"
    with pytest.raises(ValueError, match="proxy"):
        origin_listed("https://proxy.example.com/v1")
