"""Log lines that say which piece of work, task and attempt they belong to.

Inside a log context (``log_context``, opened where work comes in, and by the Celery signals
below for each task run) every record carries the fields the ``LOG_CONTEXT_FIELDS`` setting
names (an application's ids, say an event's and an invoice's), and inside a task its ``task_id``
and ``attempt``. A context is kept with each job (``Job.context``) and crosses the broker in a
``log_context`` header, so an id given where the work came in reaches the worker that does it,
and every retry. Leaving a context restores
the one before; a field a call passes itself wins. ``ContextFilter`` adds the fields
(``settings.LOGGING``); ``asyncwork.contrib.logging``'s formatters write them.

Text that came from storage or from a request is made safe for a terminal before a log line or a
command shows it (``printable``): a dead letter's reason can quote a recipient address the
provider sent, an operator's ``why`` is whatever was typed into a form, and a terminal obeys the
control characters in them (ESC starts a sequence that retitles the window, clears the screen or
rewrites what was printed before; a line break forges the next line). Every such string a
command of the machinery or of the application prints passes through ``printable`` once, where
it is formatted; so does every part of a text log line.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from functools import cache
from typing import Any

from celery import current_task
from celery.signals import before_task_publish, task_postrun, task_prerun

from asyncwork.settings import asyncwork_settings


@cache
def context_fields() -> tuple[str, ...]:
    """The fields a log context may hold (read once, at first use)."""
    return tuple(asyncwork_settings.LOG_CONTEXT_FIELDS)


@cache
def line_fields() -> tuple[str, ...]:
    """The fields a text line appends, in this order."""
    return (*context_fields(), "task_id", "attempt")


HEADER = "log_context"

# The attempt of the job this thread runs (asyncwork.runner), for its log lines: set by the run
# once it has claimed its job, cleared as the task ends (``task_postrun``), after Celery's own
# line about the run.
_attempt: ContextVar[int | None] = ContextVar("attempt", default=None)


def attempt_set(number: int) -> None:
    """This run's log lines, to the end of its task, carry ``attempt=number``."""
    _attempt.set(number)


_context: ContextVar[dict[str, Any] | None] = ContextVar("log_context", default=None)


@contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Open a log context holding ``fields`` (and the enclosing context's) for the block."""
    token = _context.set({**(_context.get() or {}), **_known(fields)})
    try:
        yield
    finally:
        _context.reset(token)


def log_context_current() -> dict[str, Any]:
    """The open log context's fields (none outside one), for work that runs later."""
    return dict(_context.get() or {})


def log_context_bind(**fields: Any) -> None:
    """Add ``fields`` to the open log context; outside one, do nothing."""
    current = _context.get()
    if current is not None:
        _context.set({**current, **_known(fields)})


def _known(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if k in context_fields() and v is not None}


class ContextFilter(logging.Filter):
    """Adds the log context's fields, and a task's ``task_id`` and ``attempt``, to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, value in (_context.get() or {}).items():
            if getattr(record, name, None) is None:
                setattr(record, name, value)
        if current_task:
            request = current_task.request
            if getattr(record, "task_id", None) is None and request.id:
                record.task_id = request.id
        if getattr(record, "attempt", None) is None and (number := _attempt.get()) is not None:
            record.attempt = number
        return True


# A run's token, by task id and thread: a redelivered message can run twice at once.
_tokens: dict[tuple[str, int], Token[dict[str, Any] | None]] = {}


def _context_publish(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """``before_task_publish``: the context travels in a header (a re-publish keeps its own)."""
    fields = _context.get()
    if fields and headers is not None and HEADER not in headers:
        headers[HEADER] = dict(fields)


def _context_task_start(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    """``task_prerun``: open the run's context from its header (and any eager caller's context)."""
    carried = getattr(getattr(task, "request", None), HEADER, None)
    fields = {**(_context.get() or {}), **(_known(carried) if isinstance(carried, dict) else {})}
    _tokens[(task_id or "", threading.get_ident())] = _context.set(fields)


def _context_task_end(task_id: str | None = None, **_: Any) -> None:
    """``task_postrun``: close the task run's context."""
    _attempt.set(None)
    token = _tokens.pop((task_id or "", threading.get_ident()), None)
    if token is None:
        return
    try:
        _context.reset(token)
    except ValueError:  # set in another context (not expected): leave none open
        _context.set(None)


def printable(text: str) -> str:
    """``text`` unchanged when every character in it is printable; else its escaped form, quoted
    as Python writes it (``'x\\x1b]0;pwned\\x07@example.com'``), so that no C0 or C1 control,
    DEL, line break or other invisible format character reaches the terminal and what was
    stored is still there to read."""
    return text if text.isprintable() else repr(text)


def celery_signals_connect() -> None:
    """Connect the receivers above; idempotent (``dispatch_uid``)."""
    before_task_publish.connect(
        _context_publish, weak=False, dispatch_uid="asyncwork.logging.publish"
    )
    task_prerun.connect(_context_task_start, weak=False, dispatch_uid="asyncwork.logging.start")
    task_postrun.connect(_context_task_end, weak=False, dispatch_uid="asyncwork.logging.end")
