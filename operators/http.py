"""Who is asking: the client address every per-client decision uses, whether the request came
over HTTPS, and the username a login attempt names.

One rule for the whole application (the ``/metrics`` allow-list, the admin login limit): a
request whose peer (``REMOTE_ADDR``, the socket's) is not one of ``TRUSTED_PROXIES`` comes from
that peer, whatever its ``X-Forwarded-For`` says. From a trusted
proxy, ``X-Forwarded-For`` is read from the right, skipping the entries that are trusted
proxies themselves (nginx's ``real_ip_recursive``): the first that is not is the client, and
with every entry trusted, the leftmost. Everything left of the client's entry is whatever the
client wrote, so it never counts; an entry that is not an address, or no header, gives the
peer. ``X-Forwarded-Proto`` counts (Django's ``SECURE_PROXY_SSL_HEADER``) only from a trusted
proxy too: ``ForwardedProtoMiddleware`` drops it from any other peer.

IPv4 clients seen through a dual-stack socket (``::ffff:192.0.2.1``) are their IPv4 address,
and an IPv6 scope (``%eth0``) is dropped: every address given is one PostgreSQL accepts.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from functools import lru_cache
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.http import HttpRequest, HttpResponseBase

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@lru_cache(maxsize=16)
def networks(entries: tuple[str, ...]) -> tuple[Network, ...]:
    """The networks of a setting's comma-separated entries (addresses or CIDRs; core/settings.py
    has refused a bad one at start-up), parsed once per distinct setting."""
    return tuple(ipaddress.ip_network(entry.strip(), strict=False) for entry in entries)


def address_parse(value: str | None) -> Address | None:
    """``value`` as an IP address, or None when it is not one."""
    text = (value or "").strip().partition("%")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return address.ipv4_mapped
    return address


def address_within(address: Address, within: Iterable[Network]) -> bool:
    return any(address in network for network in within)


# Requests come from few peers (the proxies) for few clients (Stripe sends from a dozen
# addresses), and parsing an address costs microseconds (ipaddress is pure Python): the
# answers are kept per peer and per header, a bounded number of each.
_ANSWERS_KEPT = 1024


@lru_cache(maxsize=_ANSWERS_KEPT)
def _peer(remote_addr: str, trusted_entries: tuple[str, ...]) -> tuple[str | None, bool]:
    """The peer's address as text (None if it is not one), and whether it is a trusted
    proxy."""
    address = address_parse(remote_addr)
    if address is None:
        return None, False
    return str(address), address_within(address, networks(trusted_entries))


@lru_cache(maxsize=_ANSWERS_KEPT)
def _forwarded_client(forwarded: str, trusted_entries: tuple[str, ...]) -> str | None:
    """The client a trusted proxy's ``X-Forwarded-For`` names: from the right, the first entry
    that is not a trusted proxy, else the leftmost; None for an entry that is not an address
    or an empty header."""
    trusted = networks(trusted_entries)
    client = None
    for entry in reversed(forwarded.split(",")):
        client = address_parse(entry)
        if client is None or not address_within(client, trusted):
            break
    return None if client is None else str(client)


def peer_is_trusted_proxy(request: HttpRequest) -> bool:
    """True when the request's peer (the socket's address) is one of ``TRUSTED_PROXIES``."""
    return _peer(request.META.get("REMOTE_ADDR") or "", tuple(settings.TRUSTED_PROXIES))[1]


def client_address(request: HttpRequest) -> str | None:
    """The client's IP address, or None when the socket gives none (a test request without
    ``REMOTE_ADDR``)."""
    trusted = tuple(settings.TRUSTED_PROXIES)
    peer, from_proxy = _peer(request.META.get("REMOTE_ADDR") or "", trusted)
    if not from_proxy:
        return peer
    return _forwarded_client(request.META.get("HTTP_X_FORWARDED_FOR", ""), trusted) or peer


class ForwardedProtoMiddleware:
    """First in ``MIDDLEWARE``: a request whose peer is not a trusted proxy loses its
    ``X-Forwarded-Proto`` before Django's ``SecurityMiddleware`` (the HTTPS redirect, HSTS) and
    ``request.is_secure()`` (Secure cookies, CSRF's referer check) read it, so a plain-HTTP
    client cannot pass as HTTPS by sending it. ``X-Forwarded-For`` stays: ``client_address``
    ignores it from such a peer, and the webhook keeps it with the delivery's headers."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        if "HTTP_X_FORWARDED_PROTO" in request.META and not peer_is_trusted_proxy(request):
            del request.META["HTTP_X_FORWARDED_PROTO"]
        return self.get_response(request)


def login_username(request: HttpRequest, credentials: dict[str, Any] | None = None) -> str | None:
    """The username a login attempt names, as django-axes files it (``AXES_USERNAME_CALLABLE``):
    axes' own rule, cut to its 255-character column and without NUL. Django's login form does
    not bound the username it authenticates, so a scanner's longer one reached PostgreSQL and
    was a 500."""
    field = get_user_model().USERNAME_FIELD
    source = credentials if credentials else getattr(request, "data", request.POST)
    username = source.get(field)
    if username is None:
        return None
    return str(username).replace("\x00", "")[:255]
