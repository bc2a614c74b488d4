"""The dead-letter queue: jobs that will not be retried any more, kept with their reason.

A dead letter is a ``DeadLetter`` row, written once per task id before the job's message is
acknowledged; operators read, replay and purge it. Replay re-enqueues the original job through
the outbox; jobs are idempotent, so replaying one that has since succeeded does nothing.

What a dead letter is about belongs to the app owning its job: it declares
``@dead_letter_describer(task)`` to turn that task's dead letters into ``Subject``s (a label, a
recipient, an admin page), one query per kind of job on a page.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.core.cache import cache
from django.core.mail import mail_admins
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from asyncwork.audit import operator_action_record
from asyncwork.db import insert_or_skip, text_storable
from asyncwork.jobs import job
from asyncwork.models import DeadLetter
from asyncwork.outbox import outbox_enqueue
from asyncwork.settings import asyncwork_settings

logger = logging.getLogger(__name__)

ALERT_PERIOD_SECONDS = 3600  # the alert repeats at most hourly while letters wait


def dead_letter_record(
    *,
    task: str,
    task_id: str,
    args: list[Any],
    kwargs: dict[str, Any],
    queue: str,
    reason: str,
    exc: BaseException,
    traceback: str,
    attempts: int,
    first_failed_at: datetime | None = None,
    log_traceback: bool = False,
) -> DeadLetter | None:
    """Record a dead letter once per task id and log one ERROR line (with ``exc``'s traceback only
    if ``log_traceback``; the row keeps it anyway). Returns the row, or None when this task id
    was already dead-lettered (a redelivery after the worker died before acknowledging)."""
    now = timezone.now()
    letter = DeadLetter(
        task=task,
        task_id=task_id,
        args=args,
        kwargs={k: v for k, v in kwargs.items() if k != "outbox_id"},
        queue=queue,
        reason=reason,
        exception_class=f"{type(exc).__module__}.{type(exc).__qualname__}",
        exception_message=text_storable(str(exc))[:10_000],
        traceback=traceback[:50_000],
        attempts=attempts,
        first_failed_at=first_failed_at or now,
        last_failed_at=now,
    )
    if not insert_or_skip(letter, conflict_fields=["task_id"]):
        return None
    # On one log line (an SMTP reply can span several), bounded.
    failure = " ".join(f"{type(exc).__name__}: {exc}".split())
    logger.error(
        "job dead-lettered: dead letter #%d, %s[%s] args=%s reason=%s after %d attempt(s): %s",
        letter.pk,
        task,
        task_id,
        json.dumps(args),
        reason,
        attempts,
        failure if len(failure) <= 500 else failure[:499] + "…",
        exc_info=exc if log_traceback else None,
        extra={
            "dead_letter_id": letter.pk,
            "task_name": task,
            "task_id": task_id,
            "job_args": args,
            "reason": reason,
            "attempts": attempts,
            "exception_class": letter.exception_class,
        },
    )
    return letter


@dataclass(frozen=True)
class ReplayResult:
    replayed: list[int]
    skipped: list[int]  # already replayed
    resolved: list[int] = field(default_factory=list)  # resolved: unresolve one to replay it


WAITING = Q(replayed_at__isnull=True, resolved_at__isnull=True)


def dead_letter_replay(*, ids: list[int] | None = None, actor: str) -> ReplayResult:
    """Re-enqueue the jobs of the given dead letters (all waiting if ``ids`` is None), each at most
    once (one replayed before is skipped, as is one resolved), recording each as an operator
    action of ``actor``."""
    replayed: list[int] = []
    with transaction.atomic():
        chosen = Q(pk__in=ids) if ids is not None else WAITING
        found = list(DeadLetter.objects.select_for_update().filter(chosen).order_by("pk"))
        skipped = [letter.pk for letter in found if letter.replayed_at is not None]
        resolved = [
            letter.pk
            for letter in found
            if letter.replayed_at is None and letter.resolved_at is not None
        ]
        for letter in found:
            if letter.replayed_at is not None:
                detail = f"skipped: already replayed by {letter.replayed_by or '?'}"
            elif letter.resolved_at is not None:
                detail = f"skipped: resolved by {letter.resolved_by or '?'}; unresolve it first"
            else:
                letter.replay_outbox = outbox_enqueue(
                    task=letter.task, args=letter.args, kwargs=letter.kwargs
                )
                letter.replayed_at = timezone.now()
                letter.replayed_by = actor[:150]
                letter.save(update_fields=["replay_outbox", "replayed_at", "replayed_by"])
                replayed.append(letter.pk)
                detail = f"replayed: the job is outbox message {letter.replay_outbox.pk}"
            operator_action_record(
                action="dead_letter.replay", actor=actor, target=letter, detail=detail
            )
    if replayed:
        logger.info(
            "replayed %d dead letter(s)",
            len(replayed),
            extra={"dead_letter_ids": replayed, "actor": actor},
        )
    return ReplayResult(replayed=replayed, skipped=skipped, resolved=resolved)


@dataclass(frozen=True)
class ResolveResult:
    changed: list[int]
    skipped: list[int]  # replayed, or already in the state asked for


def dead_letter_resolve(*, ids: list[int], actor: str, why: str) -> ResolveResult:
    """Mark the given dead letters resolved by ``actor`` because ``why``: they no longer wait (no
    alert, no degraded health, not in ``replay --all``). One replayed or resolved before is
    skipped. Each is recorded as an operator action."""
    why = why.strip()
    if not why:
        raise ValueError("say why the dead letter is resolved")
    changed: list[int] = []
    skipped: list[int] = []
    with transaction.atomic():
        found = DeadLetter.objects.select_for_update().filter(pk__in=ids).order_by("pk")
        for letter in found:
            if letter.replayed_at is not None or letter.resolved_at is not None:
                skipped.append(letter.pk)
                continue
            letter.resolved_at = timezone.now()
            letter.resolved_by = actor[:150]
            letter.resolved_why = why[:500]
            letter.save(update_fields=["resolved_at", "resolved_by", "resolved_why"])
            changed.append(letter.pk)
            operator_action_record(
                action="dead_letter.resolve", actor=actor, target=letter, detail=f"resolved: {why}"
            )
    return ResolveResult(changed=changed, skipped=skipped)


def dead_letter_unresolve(*, ids: list[int], actor: str) -> ResolveResult:
    """Undo ``dead_letter_resolve``: the given resolved dead letters wait again. Each is recorded
    as an operator action, with the resolution it undid."""
    changed: list[int] = []
    skipped: list[int] = []
    with transaction.atomic():
        found = DeadLetter.objects.select_for_update().filter(pk__in=ids).order_by("pk")
        for letter in found:
            if letter.resolved_at is None:
                skipped.append(letter.pk)
                continue
            undone = f"unresolved: was resolved by {letter.resolved_by}: {letter.resolved_why}"
            letter.resolved_at = None
            letter.resolved_by = ""
            letter.resolved_why = ""
            letter.save(update_fields=["resolved_at", "resolved_by", "resolved_why"])
            changed.append(letter.pk)
            operator_action_record(
                action="dead_letter.unresolve", actor=actor, target=letter, detail=undone
            )
    return ResolveResult(changed=changed, skipped=skipped)


def dead_letter_purge(*, older_than: timedelta, actor: str) -> int:
    """Delete dead letters created before ``now - older_than``; returns how many. Each is recorded
    as an operator action of ``actor`` in the deleting transaction."""
    cutoff = timezone.now() - older_than
    with transaction.atomic():
        doomed = list(
            DeadLetter.objects.select_for_update().filter(created_at__lt=cutoff).order_by("pk")
        )
        for letter in doomed:
            operator_action_record(
                action="dead_letter.purge",
                actor=actor,
                target=letter,
                detail=f"purged: older than {older_than.days} day(s), "
                + ("replayed" if letter.replayed_at else "never replayed"),
            )
        DeadLetter.objects.filter(pk__in=[letter.pk for letter in doomed]).delete()
    return len(doomed)


def dead_letters_waiting() -> QuerySet[DeadLetter]:
    """Neither replayed nor resolved: what the alert, health and ``replay --all`` count."""
    return DeadLetter.objects.filter(WAITING)


@job("dlq-alert", every=timedelta(minutes=5))
def dlq_alert() -> int:
    """Alert (ERROR line and mail to ADMINS) when waiting dead letters reach the threshold, at most
    once per period. Returns the depth."""
    depth = dead_letters_waiting().count()
    if depth >= asyncwork_settings.DLQ_ALERT_THRESHOLD and cache.add(
        "dlq-alert-sent", depth, timeout=ALERT_PERIOD_SECONDS
    ):
        logger.error(
            "DLQ depth %d has reached the alert threshold %d",
            depth,
            asyncwork_settings.DLQ_ALERT_THRESHOLD,
            extra={"dlq_depth": depth},
        )
        mail_admins(
            f"Dead-letter queue depth {depth}",
            f"{depth} job(s) wait in the dead-letter queue.\n"
            "Inspect: python manage.py dlq list\nReplay: python manage.py dlq replay ID",
            fail_silently=True,
        )
    return depth


@dataclass(frozen=True)
class Subject:
    """What a dead letter's job was about, as the app owning the job describes it."""

    kind: str  # what it is, e.g. "invoice"
    label: str  # which one, e.g. its number
    recipient: str = ""  # who it was for, if anyone
    url: str = ""  # its admin page

    def __str__(self) -> str:
        return f"{self.kind} {self.label}".strip()


# The dead letters of one task -> their subjects, by dead letter pk.
SubjectsFn = Callable[[Sequence[DeadLetter]], Mapping[int, Subject]]

_describers: dict[str, SubjectsFn] = {}


def dead_letter_describer(task: str) -> Callable[[SubjectsFn], SubjectsFn]:
    """Declare the decorated function the describer of ``task``'s dead letters: given all those
    shown at once, it returns what each is about, by pk."""

    def declare(subjects: SubjectsFn) -> SubjectsFn:
        _describers[task] = subjects
        return subjects

    return declare


def dead_letter_subjects(letters: Iterable[DeadLetter]) -> dict[int, Subject]:
    """What each of ``letters`` is about, by pk, asking each describer once. A failing describer is
    logged and leaves its letters undescribed, so dead letters stay readable."""
    by_task: dict[str, list[DeadLetter]] = {}
    for letter in letters:
        by_task.setdefault(letter.task, []).append(letter)
    subjects: dict[int, Subject] = {}
    for task, group in by_task.items():
        describer = _describers.get(task)
        if describer is None:
            continue
        try:
            subjects.update(describer(group))
        except Exception:
            logger.exception("describing the dead letters of %s failed", task)
    return subjects


def dead_letter_failure(letter: DeadLetter) -> str:
    """Why the job failed, on one line: its stored message, or the exception's class."""
    words = " ".join(letter.exception_message.split())
    return words or letter.exception_class.rpartition(".")[2] or letter.get_reason_display()


def duration_short(seconds: float) -> str:
    """``12 s``, ``5 m``, ``3 h``, ``4 d``: an age at a glance (rounded down)."""
    seconds = max(0, int(seconds))
    for unit, size, below in (("s", 1, 60), ("m", 60, 3600), ("h", 3600, 48 * 3600)):
        if seconds < below:
            return f"{seconds // size} {unit}"
    return f"{seconds // 86400} d"


def dead_letter_age(letter: DeadLetter, *, now: datetime | None = None) -> str:
    """How long ago the job was dead-lettered, e.g. ``3 h``."""
    return duration_short(((now or timezone.now()) - letter.created_at).total_seconds())


def dead_letter_replay_state(letter: DeadLetter) -> str:
    """``waiting``, ``replayed by <actor> at <time>``, or ``resolved by <actor> at <time>: <why>``
    (the operator's own words)."""
    if letter.replayed_at is not None:
        when = timezone.localtime(letter.replayed_at).strftime("%Y-%m-%d %H:%M %Z")
        return f"replayed by {letter.replayed_by or '?'} at {when}"
    if letter.resolved_at is not None:
        when = timezone.localtime(letter.resolved_at).strftime("%Y-%m-%d %H:%M %Z")
        return f"resolved by {letter.resolved_by or '?'} at {when}: {letter.resolved_why}"
    return "waiting"
