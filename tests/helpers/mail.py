"""Pointing Django's email at a real SMTP server (``stack.smtp.SmtpServer``) for a test."""

from __future__ import annotations

from typing import Any

from stack.net import HOST


def use_smtp(settings: Any, port: int) -> None:
    """Django's email settings, for this test, at ``HOST``:``port`` over real SMTP: the test
    runner swaps in the locmem backend, and these tests talk SMTP for real."""
    settings.EMAIL_BACKEND = "asyncwork.contrib.mail.EmailBackend"
    settings.EMAIL_HOST = HOST
    settings.EMAIL_PORT = port
