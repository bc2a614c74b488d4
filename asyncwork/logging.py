"""Log lines that say which event, invoice, task and attempt they belong to, without threading
those through every call.

What it guarantees:

* Inside a **log context** (``log_context``: the webhook view opens one per delivery, and the
  Celery signals below one per task run), every record that reaches the console handler
  carries the context's ``event_id`` and ``invoice_id``; ``log_context_bind`` adds a field to
  the open context (the invoicing service binds ``invoice_id`` once it knows it). Leaving the
  context restores the one before it, so nothing leaks into the next request or task run.
  Outside any context ``log_context_bind`` does nothing: a field bound by, say, an admin
  action would otherwise stay on every later line of that thread.
* Inside a **Celery task** every record also carries ``task_id`` (the request id, which an
  outbox-published job shares with its outbox row, ``outbox-<id>``, across all its retries)
  and ``attempt`` (``retries + 1``; a deferral spends no attempt, so it keeps the number).
* The context crosses the broker: a task published inside a context carries its fields in a
  ``log_context`` message header, and the task's own context starts from them. An event's
  ``event_id`` therefore reaches the worker that sends its email, and every retry of it. (A
  job the relay publishes later, outside the request, has ``invoice_id`` only.)
* A field a call passes itself (``extra={"invoice_id": ...}``) wins over the context's.

``ContextFilter`` is installed on the console handler in ``settings.LOGGING``: with
``LOG_FORMAT=json`` the fields are top-level keys of each JSON object (python-json-logger
emits every non-standard record attribute); ``TextFormatter`` appends them as
``event_id=evt_... invoice_id=12 task_id=outbox-7 attempt=2``, only those present.

Celery is told to leave logging alone (``celery_logging_keep``): ``django.setup()``, which
Celery's Django fix-up runs in every worker and beat process before it would configure its
own, has already applied ``settings.LOGGING``; without the receiver Celery would replace the
root handlers with its own, and the worker's lines would carry neither the JSON format nor
these fields. A worker or beat logs at the more verbose of ``LOG_LEVEL`` and its
``--loglevel``.

Personal data: unless ``LOG_PII=1``, both formatters mask every email address in the finished
line (``jenny@example.com`` -> ``j***@example.com``), wherever it came from: a message, an
``extra`` field, an exception's text (an SMTP server's "550 <jenny@...> unknown"), a
traceback, or Celery's own lines about a task; a quoted local part (``"jenny
rosen"@example.com``) and a percent-encoded at-sign (``jenny%40example.com`` in a URL,
``%2540`` in a URL inside a query string) too. The domain stays, as operators need it to tell
a mail provider's trouble from one mailbox's. The database keeps the full address: the admin
and the API, not the logs, are where an operator reads it. Masking takes time linear in the
line's length, whatever a client put in it (a Host header, a path), and a record keeps at most
``TEXT_MAX`` (8 KiB) of its message and of its traceback, their first and last halves.

A request Django refuses as suspicious (``SuspiciousRequestFilter``, on
``django.security.DisallowedHost`` in ``settings.LOGGING``: a Host not in ``ALLOWED_HOSTS``)
is one WARNING line, without a traceback, and a count in ``/metrics``.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from typing import Any

from celery import current_task
from celery.signals import before_task_publish, setup_logging, task_postrun, task_prerun
from pythonjsonlogger.json import JsonFormatter as JsonFormatterBase

from asyncwork.metrics import suspicious_request_count

# The fields a log context may hold, and their order on a text line.
CONTEXT_FIELDS = ("event_id", "invoice_id")
FIELDS = (*CONTEXT_FIELDS, "task_id", "attempt")
HEADER = "log_context"

_context: ContextVar[dict[str, Any] | None] = ContextVar("log_context", default=None)


@contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Open a log context holding ``fields`` (and the enclosing context's) until the block
    ends."""
    token = _context.set({**(_context.get() or {}), **_known(fields)})
    try:
        yield
    finally:
        _context.reset(token)


def log_context_bind(**fields: Any) -> None:
    """Add ``fields`` to the open log context; outside one, do nothing."""
    current = _context.get()
    if current is not None:
        _context.set({**current, **_known(fields)})


def log_context_fields() -> dict[str, Any]:
    """The open context's fields (empty outside one)."""
    return dict(_context.get() or {})


def _known(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if k in CONTEXT_FIELDS and v is not None}


class ContextFilter(logging.Filter):
    """Adds the log context's fields, and the current task's ``task_id`` and ``attempt``, to
    every record that passes (it never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = _context.get()
        if fields:
            for name, value in fields.items():
                if getattr(record, name, None) is None:
                    setattr(record, name, value)
        if current_task:
            request = current_task.request
            if getattr(record, "task_id", None) is None and request.id:
                record.task_id = request.id
            if getattr(record, "attempt", None) is None:
                record.attempt = (request.retries or 0) + 1
        return True


class SuspiciousRequestFilter(logging.Filter):
    """On a ``django.security.<kind>`` logger (Django names it after the ``SuspiciousOperation``
    it caught, and logs there once per request, at ERROR with the traceback): the request was
    a client's mistake or a probe, already answered 400, not a fault of the server. Its record
    becomes one WARNING line, without the traceback (the message says what was refused), and is
    counted in ``invoicing_http_suspicious_requests_total{kind}``."""

    def filter(self, record: logging.LogRecord) -> bool:
        suspicious_request_count(record.name.rpartition(".")[2])
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
        return True


# An address as it appears in log text: a local part, an at-sign, and a domain with at least one
# dot. Deliberately generous (non-ASCII letters, JSON's \\u escapes of them, "<...>" around it):
# masking a false positive costs a little readability, missing one costs a customer's address in
# a log store.
#
# * The local part is a whole run of anything but separators, starting at a separator (the text
#   gets a space in front, so one at its start has one too), or a quoted string: "jenny
#   rosen"@example.com, or \"jenny rosen\"@example.com as JSON writes it. Quotes pair up both
#   escaped or neither, so a match never starts or ends inside a JSON escape.
# * The at-sign is "@", or percent-encoded once (%40: a URL) or twice (%2540: a URL carried in a
#   query string, as the admin login's ?next= carries a search). An encoded one sits inside a
#   run (jenny%40example.com): the run backs off to its last at-sign.
# * The domain is the rest of the run: labels of anything but separators and dots, with a dot
#   between two of them.
#
# Linear time, whatever the line holds: a match starts only at a separator, and every piece is
# possessive, or atomic once its at-sign is found, so no character is tried again from another
# start or another split (an unanchored, backtracking pattern costs the square of a run's
# length: seconds for one 32 KB line).
_SEP = r"""\s@<>()\[\],;:"'`=/"""
_AT = r"@|%(?:25)?40"
_LABEL = rf"[^{_SEP}.]++"
_EMAIL = re.compile(
    rf"""
    (?P<pre>[{_SEP}])
    (?>
        (?:
            (?P<local>[^{_SEP}]+)
            | "(?P<quoted>[^"\\\r\n]++)"
            | \\"(?P<quoted_json>(?:[^"\\\r\n]++|\\u[0-9a-fA-F]{{4}})++)\\"
        )
        (?P<at>{_AT})
    )
    (?P<domain>\.*+{_LABEL}(?:\.++{_LABEL})++\.*+)
    """,
    re.VERBOSE,
)


def _masked(match: re.Match[str]) -> str:
    pre, local, quoted, quoted_json, at, domain = match.groups()
    first = (local or quoted or quoted_json)[0]
    # Keep the first letter, not a backslash: "\\***" would break a JSON escape.
    keep = first if first.isalnum() else ""
    return f"{pre}{keep}***{at}{domain}"


def pii_mask(text: str) -> str:
    """``jenny.rosen@example.com`` -> ``j***@example.com``, for every address in ``text``
    (``"jenny rosen"@example.com`` and ``jenny%40example.com`` too)."""
    if "@" not in text and "%40" not in text and "%2540" not in text:  # the common case
        return text
    return _EMAIL.sub(_masked, " " + text)[1:]


# A record keeps at most this many characters of its message, and of its traceback: the first
# and the last half of each, cut at whitespace. A client controls some of what is logged (a
# path, a Host header of up to 8 KB), and masking costs time in proportion to the line.
TEXT_MAX = 8 * 1024
_WHITESPACE = re.compile(r"\s")


def text_bounded(text: str) -> str:
    """``text`` itself, or, over ``TEXT_MAX`` characters, its first and last halves with a note
    of how much was left out between them. Each half is cut at whitespace, which no address
    holds: no part of one is left at a cut, too short to be recognised and masked."""
    if len(text) <= TEXT_MAX:
        return text
    half = TEXT_MAX // 2
    head, tail = text[:half], text[-half:]
    last = _WHITESPACE.search(head[::-1])
    head = head[: len(head) - last.start()] if last else ""
    first = _WHITESPACE.search(tail)
    tail = tail[first.start() :] if first else ""
    return f"{head}[... {len(text) - len(head) - len(tail)} characters left out ...]{tail}"


def record_bounded(record: logging.LogRecord, formatter: logging.Formatter) -> logging.LogRecord:
    """``record`` when its message and traceback are within ``TEXT_MAX``; otherwise a copy with
    both ``text_bounded`` (the other handlers see the record as it came)."""
    if record.exc_info and not record.exc_text:  # cached on the record, as logging does
        record.exc_text = formatter.formatException(record.exc_info)
    message = record.getMessage()
    if len(message) <= TEXT_MAX and len(record.exc_text or "") <= TEXT_MAX:
        return record
    bounded = logging.makeLogRecord(record.__dict__)
    bounded.msg, bounded.args = text_bounded(message), None
    if record.exc_text:
        bounded.exc_info, bounded.exc_text = None, text_bounded(record.exc_text)
    return bounded


class TextFormatter(logging.Formatter):
    """The standard format, then `` name=value`` for each context field the record has; the
    message and traceback bounded (``record_bounded``); email addresses masked unless
    ``mask_pii`` is False (``LOG_PII=1``)."""

    def __init__(self, *args: Any, mask_pii: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mask_pii = mask_pii

    def format(self, record: logging.LogRecord) -> str:
        record = record_bounded(record, self)
        line = super().format(record)
        suffix = " ".join(
            f"{name}={value}"
            for name in FIELDS
            if (value := getattr(record, name, None)) is not None
        )
        if suffix:
            # Before a traceback, if any: the fields belong to the line, not to its last frame.
            first, newline, rest = line.partition("\n")
            line = f"{first} {suffix}{newline}{rest}"
        return pii_mask(line) if self.mask_pii else line


class JsonFormatter(JsonFormatterBase):
    """python-json-logger's formatter (every field a top-level key), the message and traceback
    bounded (``record_bounded``), with email addresses masked in the finished object unless
    ``mask_pii`` is False (``LOG_PII=1``). Masking the serialised text keeps it valid JSON: the
    replacement holds no quote or backslash."""

    def __init__(self, *args: Any, mask_pii: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mask_pii = mask_pii

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record_bounded(record, self))
        return pii_mask(line) if self.mask_pii else line


# --- Celery --------------------------------------------------------------------------------------

# A run's token, by task id and thread: a redelivered message can run twice at once.
_tokens: dict[tuple[str, int], Token[dict[str, Any] | None]] = {}


def _context_publish(headers: dict[str, Any] | None = None, **_: Any) -> None:
    """``before_task_publish``: the publishing context's fields travel with the message; a
    retry or deferral re-publishes the header it arrived with."""
    fields = _context.get()
    if fields and headers is not None and HEADER not in headers:
        headers[HEADER] = dict(fields)


def _context_task_start(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    """``task_prerun``: a task run opens a log context, seeded from its message header (and,
    for a task applied eagerly inside a context, from that context)."""
    carried = getattr(getattr(task, "request", None), HEADER, None)
    fields = {**(_context.get() or {}), **(_known(carried) if isinstance(carried, dict) else {})}
    _tokens[(task_id or "", threading.get_ident())] = _context.set(fields)


def _context_task_end(task_id: str | None = None, **_: Any) -> None:
    """``task_postrun``: close the task run's context."""
    token = _tokens.pop((task_id or "", threading.get_ident()), None)
    if token is None:
        return
    try:
        _context.reset(token)
    except ValueError:  # set in another context (not expected): leave none open
        _context.set(None)


def celery_logging_keep(loglevel: int | str | None = None, **_: Any) -> None:
    """``setup_logging``: a receiver means Celery configures no logging of its own. Its
    ``--loglevel`` still counts where it asks for more than ``LOG_LEVEL`` (the demo runs with
    ``LOG_LEVEL=WARNING`` and a worker at ``-l INFO``, whose "ready." line it waits for)."""
    level = logging.getLevelName(loglevel.upper()) if isinstance(loglevel, str) else loglevel
    root = logging.getLogger()
    if isinstance(level, int) and level and level < root.getEffectiveLevel():
        root.setLevel(level)


def celery_signals_connect() -> None:
    """Connect the receivers above (idempotent: each has a ``dispatch_uid``)."""
    setup_logging.connect(celery_logging_keep, weak=False, dispatch_uid="asyncwork.logging.keep")
    before_task_publish.connect(
        _context_publish, weak=False, dispatch_uid="asyncwork.logging.publish"
    )
    task_prerun.connect(_context_task_start, weak=False, dispatch_uid="asyncwork.logging.start")
    task_postrun.connect(_context_task_end, weak=False, dispatch_uid="asyncwork.logging.end")
