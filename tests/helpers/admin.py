"""The admin as an operator uses it: logged in as a given user, reading a change list row by
row, each cell by its column (the ``field-<name>`` class Django gives it), the messages at the
top and the actions offered, running an action, and submitting the form a page shows (an
action's confirmation)."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from typing import Any

from django.test import Client
from rest_framework.test import APIClient

EMPTY = "-"  # Django's display of an empty value


class _ResultList(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str]] = []
        self.messages: list[tuple[str, str]] = []  # (level, text)
        self._in_body = False
        self._in_messages = False
        self._cell: str | None = None
        self._message: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = (dict(attrs).get("class") or "").split()
        if tag == "tbody":
            self._in_body = True
        elif tag == "ul" and "messagelist" in classes:
            self._in_messages = True
        elif self._in_body and tag == "tr":
            self.rows.append({})
        elif self._in_body and tag in {"td", "th"} and self.rows:
            fields = [c.removeprefix("field-") for c in classes if c.startswith("field-")]
            self._cell = fields[0] if fields else None
            self._text = []
        elif self._in_body and tag == "input" and "action-select" in classes and self.rows:
            self.rows[-1]["pk"] = dict(attrs).get("value") or ""
        elif self._cell is not None and tag == "img":
            self._text.append(dict(attrs).get("alt") or "")  # a boolean column's icon
        elif self._in_messages and tag == "li":
            self._message = next(
                (c for c in classes if c in {"success", "warning", "error", "info"}), ""
            )
            self._text = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "tbody":
            self._in_body = False
        elif tag == "ul":
            self._in_messages = False
        elif tag in {"td", "th"} and self._cell is not None:
            self.rows[-1][self._cell] = " ".join("".join(self._text).split())
            self._cell = None
        elif tag == "li" and self._message is not None:
            self.messages.append((self._message, " ".join("".join(self._text).split())))
            self._message = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None or self._message is not None:
            self._text.append(data)


def parse(response: Any) -> _ResultList:
    assert response.status_code == 200, response.status_code
    page = _ResultList()
    page.feed(response.content.decode())
    return page


def rows(response: Any) -> list[dict[str, str]]:
    """The change list's rows: ``{column: text}``, plus ``pk`` from the row's checkbox."""
    return parse(response).rows


def messages(response: Any) -> list[tuple[str, str]]:
    """The messages shown on the page, as ``(level, text)``."""
    return parse(response).messages


def run_action(client: Client, url: str, action: str, pks: list[Any]) -> Any:
    """Tick ``pks`` on the change list at ``url``, choose ``action`` and press Go."""
    return client.post(url, {"action": action, "_selected_action": pks}, follow=True)


def admin_as(user: Any) -> Client:
    """A test client logged in as ``user``."""
    client = Client()
    client.force_login(user)
    return client


def api_as(user: Any) -> APIClient:
    """An API client authenticated as ``user``."""
    client = APIClient()
    client.force_authenticate(user)
    return client


def action_choices(response: Any) -> list[str]:
    """The actions the change list offers (the options of its action select, if any)."""
    assert response.status_code == 200
    page = response.content.decode()
    if 'name="action"' not in page:
        return []
    select = page[
        page.index('name="action"') : page.index("</select>", page.index('name="action"'))
    ]
    return [value for value in re.findall(r'<option value="([^"]*)"', select) if value]


class _Form(HTMLParser):
    def __init__(self, form_id: str) -> None:
        super().__init__()
        self.form_id = form_id
        self.found = False
        self.data: dict[str, list[str]] = {}
        self._inside = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        if tag == "form" and named.get("id") == self.form_id:
            self.found = self._inside = True
        elif self._inside and tag == "input" and named.get("type") != "submit":
            name = named.get("name")
            if name:
                self.data.setdefault(name, []).append(named.get("value") or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._inside = False


def form_data(response: Any, form_id: str) -> dict[str, list[str]]:
    """What submitting the form ``form_id`` on the page sends: each named input's values (the
    submit button's aside)."""
    assert response.status_code == 200, response.status_code
    form = _Form(form_id)
    form.feed(response.content.decode())
    assert form.found, f"no form #{form_id} on the page"
    return form.data
