"""Who is asking: the client address every per-client decision uses (the ``/metrics``
allow-list, an application's own limits); and the origin of a URL a setting names (``origin``),
read as every parser reads it.

``X-Forwarded-For`` counts only from a peer in ``TRUSTED_PROXIES``; from any other, the client
is the peer. Every address given is one PostgreSQL accepts (IPv4
through a dual-stack socket is IPv4; an IPv6 scope is dropped).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from django.http import HttpRequest

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


_DEFAULT_PORTS = {"http": 80, "https": 443}
# A host name, an IPv4 address or a bracketed IPv6 one, and perhaps a port: nothing two parsers
# read differently ("https://attacker.example\@api.stripe.com" is api.stripe.com to urlsplit
# and attacker.example to urllib3, which makes the requests; urlsplit drops tabs and newlines).
_AUTHORITY = re.compile(r"(?:[a-z0-9.-]+|\[[0-9a-f:.]+\])(?::[0-9]{1,5})?", re.IGNORECASE)


def origin(url: Any) -> str:
    """The origin of an http or https URL, lower-case and without a default port; ValueError for
    anything else, a user or password in it included."""
    if not isinstance(url, str) or not (url.isascii() and url.isprintable()) or " " in url:
        raise ValueError(f"{url!r} is not a URL")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not _AUTHORITY.fullmatch(parts.netloc):
        raise ValueError(f"{url!r} is not an http or https URL of a host")
    host = parts.hostname
    port = parts.port  # ValueError for one out of range
    if not host:
        raise ValueError(f"{url!r} is not an http or https URL of a host")
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}" + (f":{port}" if port not in (None, _DEFAULT_PORTS[scheme]) else "")


def origin_listed(entry: str) -> str:
    """An entry of ``PROVIDER_API_ALLOWED_ORIGINS`` as an origin: a scheme, a host and perhaps
    a port, nothing else; ValueError for anything more or less."""
    parts = urlsplit(entry)
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(entry)
    return origin(entry)
