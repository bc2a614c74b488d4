"""The backpressure settings: a value that would fail on the first request (or
silently never shed) stops start-up instead, with a message naming it."""

from __future__ import annotations

import pytest

from tests.helpers.environment import PRODUCTION, manage

pytestmark = pytest.mark.slow  # each test reads the settings in a process of its own


@pytest.mark.parametrize(("soft", "hard"), [("100", "10"), ("0", "10")])
def test_marks_out_of_order_are_refused(soft: str, hard: str) -> None:
    marks = {"BACKPRESSURE_SOFT_MARK": soft, "BACKPRESSURE_HARD_MARK": hard}
    result = manage("check", env={**PRODUCTION, **marks})
    assert result.returncode != 0
    assert "BACKPRESSURE_SOFT_MARK <= BACKPRESSURE_HARD_MARK" in result.stderr
