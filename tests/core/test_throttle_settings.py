"""The throttle and backpressure settings: a value that would fail on the first request (or
silently never shed) stops start-up instead, with a message naming it."""

from __future__ import annotations

import pytest

from tests.helpers.environment import PRODUCTION, manage

pytestmark = pytest.mark.slow  # each test runs manage.py check in a process of its own


@pytest.mark.parametrize("rate", ["lots", "0/min", "10/week", "-5/s", "5"])
def test_a_malformed_throttle_rate_is_refused(rate: str) -> None:
    result = manage("check", env={**PRODUCTION, "WEBHOOK_THROTTLE_RATE": rate})
    assert result.returncode != 0
    assert "WEBHOOK_THROTTLE_RATE must look like 6000/min" in result.stderr


@pytest.mark.parametrize("rate", ["100/s", "6000/min", "100000/hour", "1/day", ""])
def test_well_formed_throttle_rates_are_accepted(rate: str) -> None:
    result = manage("check", env={**PRODUCTION, "WEBHOOK_THROTTLE_RATE": rate})
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("soft", "hard"), [("100", "10"), ("0", "10")])
def test_marks_out_of_order_are_refused(soft: str, hard: str) -> None:
    marks = {"BACKPRESSURE_SOFT_MARK": soft, "BACKPRESSURE_HARD_MARK": hard}
    result = manage("check", env={**PRODUCTION, **marks})
    assert result.returncode != 0
    assert "BACKPRESSURE_SOFT_MARK <= BACKPRESSURE_HARD_MARK" in result.stderr
