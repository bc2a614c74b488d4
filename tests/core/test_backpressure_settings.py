"""The backpressure settings: a value that would fail on the first request (or
silently never shed) stops start-up instead, with a message naming it."""

from __future__ import annotations

import pytest

from tests.helpers.environment import PRODUCTION, manage

pytestmark = pytest.mark.slow  # each test reads the settings in a process of its own


@pytest.mark.parametrize(
    ("soft", "hard", "says"),
    [
        ("100", "10", "(100) must be at most ASYNCWORK['BACKPRESSURE_HARD_MARK'] (10)."),
        ("0", "10", "is 0: it must be a whole number, 1 or more."),
    ],
)
def test_marks_out_of_order_are_refused(soft: str, hard: str, says: str) -> None:
    marks = {"BACKPRESSURE_SOFT_MARK": soft, "BACKPRESSURE_HARD_MARK": hard}
    result = manage("check", env={**PRODUCTION, **marks})
    assert result.returncode != 0
    assert result.stderr.splitlines() == [
        f"Configuration error: ASYNCWORK['BACKPRESSURE_SOFT_MARK'] {says}"
    ]
