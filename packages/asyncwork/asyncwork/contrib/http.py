"""Who is asking: the client address every per-client decision uses (the ``/metrics``
allow-list, an application's own limits), and whether the request came over HTTPS.

``X-Forwarded-For`` and ``X-Forwarded-Proto`` count only from a peer in ``TRUSTED_PROXIES``;
from any other, the client is the peer. Every address given is one PostgreSQL accepts (IPv4
through a dual-stack socket is IPv4; an IPv6 scope is dropped).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable
from functools import lru_cache

from django.http import HttpRequest, HttpResponseBase

from asyncwork.settings import asyncwork_settings

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@lru_cache(maxsize=16)
def networks(entries: tuple[str, ...]) -> tuple[Network, ...]:
    """A setting's entries as networks (validated at start-up by core/settings.py)."""
    return tuple(ipaddress.ip_network(entry.strip(), strict=False) for entry in entries)


def address_parse(value: str | None) -> Address | None:
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


# Few peers and few clients, and ipaddress is slow: answers are cached, boundedly.
_ANSWERS_KEPT = 1024


@lru_cache(maxsize=_ANSWERS_KEPT)
def _peer(remote_addr: str, trusted_entries: tuple[str, ...]) -> tuple[str | None, bool]:
    """The peer's address (None if not one), and whether it is a trusted proxy."""
    address = address_parse(remote_addr)
    if address is None:
        return None, False
    return str(address), address_within(address, networks(trusted_entries))


@lru_cache(maxsize=_ANSWERS_KEPT)
def _forwarded_client(forwarded: str, trusted_entries: tuple[str, ...]) -> str | None:
    """From the right, the first entry that is not a trusted proxy (nginx's
    ``real_ip_recursive``), else the leftmost; None for a non-address or an empty header.
    Entries left of it are the client's own writing and never count."""
    trusted = networks(trusted_entries)
    client = None
    for entry in reversed(forwarded.split(",")):
        client = address_parse(entry)
        if client is None or not address_within(client, trusted):
            break
    return None if client is None else str(client)


def peer_is_trusted_proxy(request: HttpRequest) -> bool:
    return _peer(request.META.get("REMOTE_ADDR") or "", tuple(asyncwork_settings.TRUSTED_PROXIES))[
        1
    ]


def client_address(request: HttpRequest) -> str | None:
    trusted = tuple(asyncwork_settings.TRUSTED_PROXIES)
    peer, from_proxy = _peer(request.META.get("REMOTE_ADDR") or "", trusted)
    if not from_proxy:
        return peer
    return _forwarded_client(request.META.get("HTTP_X_FORWARDED_FOR", ""), trusted) or peer


class ForwardedProtoMiddleware:
    """First in ``MIDDLEWARE``: drops ``X-Forwarded-Proto`` from an untrusted peer before
    anything reads it, so a plain-HTTP client cannot pass as HTTPS."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        if "HTTP_X_FORWARDED_PROTO" in request.META and not peer_is_trusted_proxy(request):
            del request.META["HTTP_X_FORWARDED_PROTO"]
        return self.get_response(request)
