"""The dead-letter queue: jobs that will not be retried any more, kept with their reason.

A dead letter is a ``DeadLetter`` row, written once per task id before the job's message is
acknowledged; operators read, replay, resolve and purge it, one by one or as a selection of those
still waiting (``selection``). Replay re-enqueues the original job through the outbox;
jobs are idempotent, so replaying one that has since succeeded does nothing.

What a dead letter is about belongs to the app owning its job: it declares
``@describer(task)`` to turn that task's dead letters into ``Subject``s (a label, a
recipient, an admin page, what became of the work), one query per kind of job on a page; and
``@replay_check(task)`` to say which would only fail again if replayed as they stand
(their cause unchanged): those are not replayed unless forced.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from asyncwork.audit import operator_action_record
from asyncwork.backend import Task, job_create, message_id, task_for
from asyncwork.db import insert_or_skip, text_storable
from asyncwork.models import DeadLetter, Job

logger = logging.getLogger(__name__)


def record(
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
        kwargs=kwargs,
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
    # Not replayed: their replay check says why they would only fail again (force overrides it).
    refused: dict[int, str] = field(default_factory=dict)
    # Replayed by force although their replay check refused them, and what it said.
    forced: dict[int, str] = field(default_factory=dict)


WAITING = Q(replayed_at__isnull=True, resolved_at__isnull=True)

# The most dead letters one request replays or resolves (the API's bulk action, the admin's
# actions): in one transaction with its Idempotency-Key, so that a request retried after a
# failure acts once, and answered well inside a web server's request timeout (gunicorn's 30 s
# kills the worker, rolling the work back). A larger selection is refused with a pointer to
# ``manage.py dlq``, which has no such deadline and commits a batch at a time: the recovery
# after an outage (thousands waiting) is one command that cannot time out, and a run cut short
# goes on where it stopped.
BULK_LIMIT = 1000


def replay(*, ids: list[int] | None = None, actor: str, force: bool = False) -> ReplayResult:
    """Re-enqueue the jobs of the given dead letters (all waiting if ``ids`` is None), each at most
    once (one replayed before is skipped, as is one resolved), recording each as an operator
    action of ``actor``. One its task's replay check refuses is not replayed unless ``force``;
    a forced replay records the refusal it overrode. One transaction, holding the letters' rows
    until it commits: give it a batch at a time (``manage.py dlq`` gives 500), a request at
    most ``BULK_LIMIT``."""
    refused: dict[int, str] = {}
    forced: dict[int, str] = {}
    with transaction.atomic():
        chosen = Q(pk__in=ids) if ids is not None else WAITING
        found = list(DeadLetter.objects.select_for_update().filter(chosen).order_by("pk"))
        skipped = [letter.pk for letter in found if letter.replayed_at is not None]
        resolved = [
            letter.pk
            for letter in found
            if letter.replayed_at is None and letter.resolved_at is not None
        ]
        why_not = refusals(
            letter for letter in found if letter.replayed_at is None and letter.resolved_at is None
        )
        now = timezone.now()
        replaying: list[DeadLetter] = []
        details: list[str] = []
        for letter in found:
            refusal = why_not.get(letter.pk)
            if letter.replayed_at is not None:
                detail = f"skipped: already replayed by {letter.replayed_by or '?'}"
            elif letter.resolved_at is not None:
                detail = f"skipped: resolved by {letter.resolved_by or '?'}; unresolve it first"
            elif refusal is not None and not force:
                refused[letter.pk] = refusal
                detail = f"refused: {refusal}"
            else:
                letter.replay_job = job_create(
                    task=letter.task, args=letter.args, kwargs=letter.kwargs, queue=letter.queue
                )
                letter.replayed_at = now
                letter.replayed_by = actor[:150]
                replaying.append(letter)
                detail = f"replayed: the job is job {letter.replay_job.pk}"
                if refusal is not None:
                    forced[letter.pk] = refusal
                    detail += f"; forced past its check, which said: {refusal}"
            details.append(detail)
        # One statement for all of them, not one each.
        DeadLetter.objects.bulk_update(replaying, ["replay_job", "replayed_at", "replayed_by"])
        for letter, detail in zip(found, details, strict=True):
            operator_action_record(
                action="dead_letter.replay", actor=actor, target=letter, detail=detail[:500]
            )
    replayed = [letter.pk for letter in replaying]
    if replayed:
        logger.info(
            "replayed %d dead letter(s)",
            len(replayed),
            extra={"dead_letter_ids": replayed, "actor": actor, "forced_ids": list(forced)},
        )
    return ReplayResult(
        replayed=replayed, skipped=skipped, resolved=resolved, refused=refused, forced=forced
    )


@dataclass(frozen=True)
class ResolveResult:
    changed: list[int]
    skipped: list[int]  # replayed, or already in the state asked for


def resolve(*, ids: list[int], actor: str, why: str) -> ResolveResult:
    """Mark the given dead letters resolved by ``actor`` because ``why``: they no longer wait (no
    alert, no degraded health, not in ``replay --all``). One replayed or resolved before is
    skipped. Each is recorded as an operator action. One transaction, as a replay's."""
    why = why.strip()
    if not why:
        raise ValueError("say why the dead letter is resolved")
    changed: list[DeadLetter] = []
    skipped: list[int] = []
    with transaction.atomic():
        found = DeadLetter.objects.select_for_update().filter(pk__in=ids).order_by("pk")
        now = timezone.now()
        for letter in found:
            if letter.replayed_at is not None or letter.resolved_at is not None:
                skipped.append(letter.pk)
                continue
            letter.resolved_at = now
            letter.resolved_by = actor[:150]
            letter.resolved_why = why[:500]
            changed.append(letter)
        # One statement for all of them, not one each.
        DeadLetter.objects.bulk_update(changed, ["resolved_at", "resolved_by", "resolved_why"])
        for letter in changed:
            operator_action_record(
                action="dead_letter.resolve", actor=actor, target=letter, detail=f"resolved: {why}"
            )
    return ResolveResult(changed=[letter.pk for letter in changed], skipped=skipped)


def unresolve(*, ids: list[int], actor: str) -> ResolveResult:
    """Undo ``resolve``: the given resolved dead letters wait again. Each is recorded
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


def purge(*, older_than: timedelta, actor: str) -> int:
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


def waiting() -> QuerySet[DeadLetter]:
    """Neither replayed nor resolved: what the alert, health and ``replay --all`` count."""
    return DeadLetter.objects.filter(WAITING)


class SelectionInvalid(ValueError):
    """A filter of ``selection`` that cannot be read; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


TIME_FORMS = "an ISO date or date and time: 2026-12-03, 2026-12-03T17:00, 2026-12-03T17:00+01:00"


def _moment(name: str, value: datetime | str, *, end: bool) -> datetime:
    """``value`` as an aware datetime; a date alone is its day's start, or with ``end`` the next
    day's start (its end); without an offset, in the current time zone."""
    moment: datetime | None = None
    day: date | None = None
    if isinstance(value, datetime):
        moment = value
    else:
        text = value.strip()
        try:
            day = parse_date(text)
            moment = None if day is not None else parse_datetime(text)
        except ValueError:  # well formed but no such day or time: 2026-02-30
            pass
        if day is not None:
            try:
                moment = datetime.combine(day + timedelta(days=1 if end else 0), time.min)
            except OverflowError:  # the end of 9999-12-31, the next day's start, is no date
                raise SelectionInvalid(
                    name,
                    f"{value!r} is out of range: its end is past the year 9999 (leave "
                    f"{name} out for no end)",
                ) from None
        if moment is None:
            raise SelectionInvalid(name, f"{value!r} is not {TIME_FORMS}")
    return timezone.make_aware(moment) if timezone.is_naive(moment) else moment


def selection(
    *,
    reason: str | None = None,
    task: str | None = None,
    since: datetime | str | None = None,
    until: datetime | str | None = None,
) -> QuerySet[DeadLetter]:
    """The dead letters still waiting, by id, narrowed by each filter given: ``reason`` (a
    ``DeadLetter.Reason`` value), ``task`` (its name), created at or after ``since`` and before
    ``until`` (datetimes, or text in ISO 8601: a date alone is that day's start for ``since`` and
    its end for ``until``; without an offset, the current time zone). What a bulk replay or
    resolve acts on, from the command line, the API and the admin alike. Raises
    ``SelectionInvalid`` naming a filter it cannot read."""
    letters = waiting()
    if reason is not None:
        if reason not in DeadLetter.Reason.values:
            choices = ", ".join(DeadLetter.Reason.values)
            raise SelectionInvalid("reason", f"{reason!r} is not one of {choices}")
        letters = letters.filter(reason=reason)
    if task is not None:
        if not task.strip():
            raise SelectionInvalid("task", "give a task name, as dlq list --json shows it")
        letters = letters.filter(task=task.strip())
    start = None if since is None else _moment("since", since, end=False)
    end = None if until is None else _moment("until", until, end=True)
    if start is not None and end is not None and end <= start:
        raise SelectionInvalid("until", "must be later than since: nothing is in between")
    if start is not None:
        letters = letters.filter(created_at__gte=start)
    if end is not None:
        letters = letters.filter(created_at__lt=end)
    return letters.order_by("pk")


@dataclass(frozen=True)
class Subject:
    """What a dead letter's job was about, as the app owning the job describes it."""

    kind: str  # what it is, e.g. "invoice"
    label: str  # which one, e.g. its number
    recipient: str = ""  # who it was for, if anyone
    url: str = ""  # its admin page
    # What became of the job's work now, in words, e.g. "email sent 2026-12-03 17:02 UTC".
    outcome: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.label}".strip()


# The dead letters of one task -> their subjects, by dead letter pk.
SubjectsFn = Callable[[Sequence[DeadLetter]], Mapping[int, Subject]]

_describers: dict[str, SubjectsFn] = {}


def _path(task: Task[Any, Any] | str) -> str:
    return task if isinstance(task, str) else task.module_path


def describer(*tasks: Task[Any, Any] | str) -> Callable[[SubjectsFn], SubjectsFn]:
    """Declare the decorated function the describer of the dead letters of ``tasks`` (tasks, or
    the names of Celery tasks): given all those shown at once, it returns what each is about, by
    pk."""

    def declare(subjects: SubjectsFn) -> SubjectsFn:
        _describers.update(dict.fromkeys(map(_path, tasks), subjects))
        return subjects

    return declare


def _by_task(letters: Iterable[DeadLetter]) -> dict[str, list[DeadLetter]]:
    by_task: dict[str, list[DeadLetter]] = {}
    for letter in letters:
        by_task.setdefault(letter.task, []).append(letter)
    return by_task


def subjects(letters: Iterable[DeadLetter]) -> dict[int, Subject]:
    """What each of ``letters`` is about, by pk, asking each describer once. A failing describer is
    logged and leaves its letters undescribed, so dead letters stay readable."""
    described: dict[int, Subject] = {}
    for task, group in _by_task(letters).items():
        describe = _describers.get(task)
        if describe is None:
            continue
        try:
            described.update(describe(group))
        except Exception:
            logger.exception("describing the dead letters of %s failed", task)
    return described


# The dead letters of one task about to be replayed -> why replaying each as it stands would only
# fail again, by pk; a letter not in it may be replayed.
ReplayCheckFn = Callable[[Sequence[DeadLetter]], Mapping[int, str]]

_replay_checks: dict[str, ReplayCheckFn] = {}


def replay_check(*tasks: Task[Any, Any] | str) -> Callable[[ReplayCheckFn], ReplayCheckFn]:
    """Declare the decorated function the replay check of the dead letters of ``tasks``: given
    all those about to be replayed at once, it returns, by pk, why replaying one as it stands
    would only fail again (what it failed on is unchanged), in words saying what to do first. A
    refused letter is not replayed unless forced."""

    def declare(check: ReplayCheckFn) -> ReplayCheckFn:
        _replay_checks.update(dict.fromkeys(map(_path, tasks), check))
        return check

    return declare


def refusals(letters: Iterable[DeadLetter]) -> dict[int, str]:
    """Why each of ``letters`` would only fail again if replayed now, by pk (none: replay it),
    asking each replay check once. A letter whose task is not in this code is refused, saying so;
    a check that fails is logged and refuses its letters, saying so: nothing is replayed
    unchecked unless forced."""
    refused: dict[int, str] = {}
    for task, group in _by_task(letters).items():
        try:
            task_for(task)
        except LookupError as exc:  # it would only fail again, saying this
            refused.update(dict.fromkeys((letter.pk for letter in group), str(exc)))
            continue
        check = _replay_checks.get(task)
        if check is None:
            continue
        try:
            said = check(group)
        except Exception as exc:
            logger.exception("the replay check of %s failed", task)
            failed = f"its replay check failed ({type(exc).__name__}: {exc}), so it is unchecked"
            said = {letter.pk: failed for letter in group}
        refused.update({pk: why for pk, why in said.items() if why})
    return refused


@dataclass(frozen=True)
class ReplayOutcome:
    """What became of a replayed dead letter's job, as the machinery knows it."""

    state: str  # one of the OUTCOME_* below
    text: str  # in words
    again: DeadLetter | None = None  # the dead letter the replay became, if it did


OUTCOME_UNPUBLISHED = "unpublished"  # its job waits to be published
OUTCOME_PUBLISHED = "published"  # the job was queued: it waits its turn
OUTCOME_RUNNING = "running"  # the job runs now
OUTCOME_SUCCEEDED = "succeeded"  # the job ran to its end
OUTCOME_RETRYING = "retrying"  # the job failed again and waits out a retry's backoff
OUTCOME_DEAD_LETTERED = "dead-lettered"  # it failed for good again: ``again``
OUTCOME_CLEARED = "cleared"  # its job was purged, long finished


def _when(moment: datetime) -> str:
    return timezone.localtime(moment).strftime("%Y-%m-%d %H:%M %Z")


def replay_outcomes(letters: Iterable[DeadLetter]) -> dict[int, ReplayOutcome]:
    """What became of the job of each replayed one of ``letters``, by pk, read from the replay's
    job (``select_related("replay_job")``: no query) and, for those that failed again, their
    dead letters (one query, however many letters)."""
    replayed = [letter for letter in letters if letter.replayed_at is not None]
    failed = [
        message_id(letter.replay_job.pk)
        for letter in replayed
        if letter.replay_job is not None and letter.replay_job.status == Job.Status.FAILED
    ]
    again = {x.task_id: x for x in DeadLetter.objects.filter(task_id__in=failed)} if failed else {}
    outcomes: dict[int, ReplayOutcome] = {}
    for letter in replayed:
        job = letter.replay_job
        if job is None:
            outcome = ReplayOutcome(OUTCOME_CLEARED, "replayed; its job has since been purged")
        elif job.status == Job.Status.FAILED:
            found = again.get(message_id(job.pk))
            outcome = ReplayOutcome(
                OUTCOME_DEAD_LETTERED,
                f"dead-lettered again as dead letter #{found.pk}" if found else "failed again",
                found,
            )
        elif job.status == Job.Status.SUCCESSFUL:
            when = _when(job.finished_at) if job.finished_at else "?"
            outcome = ReplayOutcome(OUTCOME_SUCCEEDED, f"job {job.pk} succeeded {when}")
        elif job.status == Job.Status.RUNNING:
            outcome = ReplayOutcome(OUTCOME_RUNNING, f"job {job.pk} is running")
        elif job.errors:
            due = f"; a retry is due {_when(job.due_at)}" if job.due_at else ""
            outcome = ReplayOutcome(OUTCOME_RETRYING, f"job {job.pk} failed again{due}")
        elif job.published_at is None:
            outcome = ReplayOutcome(OUTCOME_UNPUBLISHED, f"job {job.pk} not yet published")
        else:
            outcome = ReplayOutcome(
                OUTCOME_PUBLISHED, f"job {job.pk} published {_when(job.published_at)}: waiting"
            )
        outcomes[letter.pk] = outcome
    return outcomes


def failure(letter: DeadLetter) -> str:
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


def age(letter: DeadLetter, *, now: datetime | None = None) -> str:
    """How long ago the job was dead-lettered, e.g. ``3 h``."""
    return duration_short(((now or timezone.now()) - letter.created_at).total_seconds())


def replay_state(letter: DeadLetter) -> str:
    """``waiting``, ``replayed by <actor> at <time>``, or ``resolved by <actor> at <time>: <why>``
    (the operator's own words)."""
    if letter.replayed_at is not None:
        return f"replayed by {letter.replayed_by or '?'} at {_when(letter.replayed_at)}"
    if letter.resolved_at is not None:
        when = _when(letter.resolved_at)
        return f"resolved by {letter.resolved_by or '?'} at {when}: {letter.resolved_why}"
    return "waiting"
