"""Log formatters for a project's ``LOGGING``: the standard text format plus the log context's
fields (``asyncwork.logging``), or one JSON object per line, both masking every email address in
the finished line unless told not to (``mask_pii``), in linear time, keeping at most
``TEXT_MAX`` of a message and of a traceback (``j***@example.com``: the domain tells a provider's
trouble from one mailbox's). A text line is one line, whatever a client or a provider put in it:
its message, each line of its traceback and each field's value pass through ``printable``, so no
control character reaches the terminal or the log file (JSON escapes them itself). And
``SuspiciousRequestFilter``, which makes Django's refusal of a suspicious request one WARNING line
and a count; ``RoutineRunFilter``, which keeps Celery's lines about a scheduled job's runs at
DEBUG."""

from __future__ import annotations

import logging
import re
from typing import Any

from celery import current_app
from pythonjsonlogger.json import JsonFormatter as JsonFormatterBase

from asyncwork.contrib.monitoring.metrics import suspicious_requests
from asyncwork.logging import line_fields, printable


class SuspiciousRequestFilter(logging.Filter):
    """On ``django.security.<kind>``: a refused request (already a 400) becomes one WARNING line
    without traceback, counted by kind (a class name, never client text: few label values)."""

    def filter(self, record: logging.LogRecord) -> bool:
        suspicious_requests().labels(kind=record.name.rpartition(".")[2]).inc()
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info, record.exc_text = None, None
        return True


class RoutineRunFilter(logging.Filter):
    """On ``celery.worker.strategy`` and ``celery.app.trace``: Celery's INFO lines about a run of a
    task marked ``routine`` (a scheduled job's "received", "succeeded" and expected-failure
    lines) become DEBUG lines, dropped unless the logger logs DEBUG. The job's own line says
    that it ran and what it found, at INFO only when it found something, and a failure is its
    ERROR line (``asyncwork.contrib.periodic.jobs.job_run``): an idle worker writes nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        data = getattr(record, "data", None)  # Celery's context of the line: the task's name...
        if record.levelno != logging.INFO or not isinstance(data, dict):
            return True
        if not getattr(current_app.tasks.get(str(data.get("name"))), "routine", False):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


# An address in log text, matched generously (a false positive costs readability, a miss costs a
# customer's address): a separator; a local part (a run of non-separators, or a quoted string,
# plain or JSON-escaped, quotes paired); an at-sign (@, %40, or %2540, at which a run backs off to
# its last one); a domain of dot-separated labels. Linear time: a match starts only at a separator,
# and every piece is possessive or atomic, so nothing is retried from another start or split.
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
    """``jenny.rosen@example.com`` -> ``j***@example.com``, for every address in ``text``."""
    if "@" not in text and "%40" not in text and "%2540" not in text:  # the common case
        return text
    return _EMAIL.sub(_masked, " " + text)[1:]


# Characters kept of a record's message, and of its traceback: a client controls part of what is
# logged, and masking costs time per character.
TEXT_MAX = 8 * 1024
_WHITESPACE = re.compile(r"\s")


def text_bounded(text: str) -> str:
    """``text``, or over ``TEXT_MAX`` characters its first and last halves with a note of what was
    left out. Each half is cut at whitespace, so no address is left cut too short to be masked."""
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
    """``record``, or a copy with message and traceback ``text_bounded``."""
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


def record_printable(record: logging.LogRecord) -> logging.LogRecord:
    """``record``, or a copy with its message and each line of its traceback ``printable``."""
    message, trace = record.getMessage(), record.exc_text or ""
    shown = printable(message)
    shown_trace = "\n".join(printable(line) for line in trace.split("\n"))
    if shown == message and shown_trace == trace:
        return record
    escaped = logging.makeLogRecord(record.__dict__)
    escaped.msg, escaped.args = shown, None
    if trace:
        escaped.exc_info, escaped.exc_text = None, shown_trace
    return escaped


class TextFormatter(logging.Formatter):
    """The standard format plus `` name=value`` per context field present."""

    def __init__(self, *args: Any, mask_pii: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mask_pii = mask_pii

    def format(self, record: logging.LogRecord) -> str:
        record = record_printable(record_bounded(record, self))
        line = super().format(record)
        suffix = " ".join(
            f"{name}={printable(str(value))}"
            for name in line_fields()
            if (value := getattr(record, name, None)) is not None
        )
        if suffix:
            # Before a traceback, if any: the fields belong to the line, not to its last frame.
            first, newline, rest = line.partition("\n")
            line = f"{first} {suffix}{newline}{rest}"
        return pii_mask(line) if self.mask_pii else line


class JsonFormatter(JsonFormatterBase):
    """python-json-logger's formatter; the mask holds no quote nor backslash: JSON stays valid."""

    def __init__(self, *args: Any, mask_pii: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mask_pii = mask_pii

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record_bounded(record, self))
        return pii_mask(line) if self.mask_pii else line
