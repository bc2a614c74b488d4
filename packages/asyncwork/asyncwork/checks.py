"""System checks of the ``ASYNCWORK`` setting (registered by ``AsyncWorkConfig.ready``): each
message names the key, what it holds and what it must hold."""

from __future__ import annotations

import difflib
import ipaddress
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, register

from asyncwork.settings import SETTINGS

_MUST = {
    "positive": "a number greater than 0",
    "non-negative": "a number, 0 or more",
    "count": "a whole number, 1 or more",
    "port": "a port number, 0 to 65535 (0: off)",
    "text": "a string",
    "flag": "True or False",
    "networks": "a list of addresses or networks (like 10.0.0.2 or 10.0.0.0/24)",
    "names": "a list of field names (identifiers)",
}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _network(entry: Any) -> bool:
    if not isinstance(entry, str):
        return False
    try:
        ipaddress.ip_network(entry.strip(), strict=False)
    except ValueError:
        return False
    return True


def _fits(kind: str, value: Any) -> bool:
    if kind == "positive":
        return _is_number(value) and value > 0
    if kind == "non-negative":
        return _is_number(value) and value >= 0
    if kind == "count":
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if kind == "port":
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535
    if kind == "text":
        return isinstance(value, str)
    if kind == "flag":
        return isinstance(value, bool)
    if kind == "networks":
        return isinstance(value, list | tuple) and all(_network(entry) for entry in value)
    return isinstance(value, list | tuple) and all(
        isinstance(name, str) and name.isidentifier() for name in value
    )


@register()
def asyncwork_settings_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    given = getattr(settings, "ASYNCWORK", {})
    if not isinstance(given, dict):
        return [Error("ASYNCWORK must be a dict of the machinery's settings.", id="asyncwork.E001")]
    errors: list[CheckMessage] = []
    for key in given:
        if key not in SETTINGS:
            close = difflib.get_close_matches(str(key), SETTINGS, n=1)
            errors.append(
                Error(
                    f"ASYNCWORK[{key!r}] is not a setting of asyncwork.",
                    hint=f"Did you mean {close[0]!r}?" if close else "See asyncwork/settings.py.",
                    id="asyncwork.E002",
                )
            )
    for key, setting in SETTINGS.items():
        value = given.get(key, setting.default)
        if not _fits(setting.kind, value):
            errors.append(
                Error(
                    f"ASYNCWORK[{key!r}] is {value!r}: it must be {_MUST[setting.kind]}.",
                    id="asyncwork.E003",
                )
            )
    soft = given.get("BACKPRESSURE_SOFT_MARK", SETTINGS["BACKPRESSURE_SOFT_MARK"].default)
    hard = given.get("BACKPRESSURE_HARD_MARK", SETTINGS["BACKPRESSURE_HARD_MARK"].default)
    if _is_number(soft) and _is_number(hard) and soft > hard:
        errors.append(
            Error(
                f"ASYNCWORK['BACKPRESSURE_SOFT_MARK'] ({soft}) must be at most "
                f"ASYNCWORK['BACKPRESSURE_HARD_MARK'] ({hard}).",
                id="asyncwork.E004",
            )
        )
    return errors
