"""This application's ``ASYNCWORK``: it passes the machinery's checks and keeps the metric names
the application always had; the distribution's README lists every setting (the checks
themselves: packages/asyncwork/tests/test_settings.py)."""

from __future__ import annotations

from typing import Any

from asyncwork.checks import asyncwork_settings_check
from asyncwork.settings import metric_name, settings_table
from stack.process import ROOT


def test_this_applications_settings_pass_and_keep_its_metric_names(settings: Any) -> None:
    assert asyncwork_settings_check() == []
    assert metric_name("dlq_depth") == "invoicing_dlq_depth"


def test_the_distributions_readme_lists_every_setting_with_its_default() -> None:
    readme = (ROOT / "packages" / "asyncwork" / "README.md").read_text()
    block = readme.split("checks it -->\n", 1)[1].split("\n<!-- end settings -->", 1)[0]
    assert block == settings_table()
