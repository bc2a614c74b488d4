"""The operator's dashboard (``/admin/dashboard/``) as a test reads it: each probe's figures,
error and cost, as the page shows them."""

from __future__ import annotations

from html.parser import HTMLParser

from django.test import Client

DASHBOARD = "/admin/dashboard/"

Figures = dict[str, dict[str, dict[str, str]]]


class Dashboard(HTMLParser):
    """``{probe name: {figure label: {"label", "value", "href", "status"}}}``, plus each
    probe's error and cost, as the page shows them."""

    def __init__(self) -> None:
        super().__init__()
        self.figures: Figures = {}
        self.errors: dict[str, str] = {}
        self.ms: dict[str, float] = {}
        self._probe = ""
        self._row: dict[str, str] | None = None
        self._capture = ""  # what the text being read is: label, value, error or ms
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        classes = (attributes.get("class") or "").split()
        if tag == "div" and (attributes.get("id") or "").startswith("probe-"):
            self._probe = (attributes.get("id") or "").removeprefix("probe-")
            self.figures[self._probe] = {}
        elif tag == "tr" and "figure" in classes:
            status = [c.removeprefix("status-") for c in classes if c.startswith("status-")]
            self._row = {"status": status[0], "href": ""}
        elif tag == "th" and self._row is not None:
            self._capture, self._text = "label", []
        elif tag == "td" and "error" in classes:
            self._capture, self._text = "error", []
        elif tag == "td" and self._row is not None:
            self._capture, self._text = "value", []
        elif tag == "a" and self._capture == "label" and self._row is not None:
            self._row["href"] = attributes.get("href") or ""
        elif tag == "span" and "ms" in classes:
            self._capture, self._text = "ms", []

    def handle_endtag(self, tag: str) -> None:
        if tag not in {"th", "td", "span"} or not self._capture:
            if tag == "tr" and self._row is not None:
                self.figures[self._probe][self._row["label"]] = self._row
                self._row = None
            return
        text = " ".join("".join(self._text).split())
        if self._capture == "ms":
            self.ms[self._probe] = float(text.removesuffix(" ms"))
        elif self._capture == "error":
            self.errors[self._probe] = text
        elif self._row is not None:
            self._row[self._capture] = text
        self._capture = ""

    def handle_data(self, data: str) -> None:
        self._text.append(data)


def dashboard(client: Client) -> Dashboard:
    response = client.get(DASHBOARD)
    assert response.status_code == 200, response.status_code
    assert response["Cache-Control"].startswith("max-age=0")
    page = Dashboard()
    page.feed(response.content.decode())
    return page
