"""What a job's failure is, as the job says it: the retry doctrine of ``ReliableTask``
(``asyncwork.tasks``) keys on these classes.

``TransientError`` is retried with backoff, ``PermanentError`` is dead-lettered at once, and
``Deferred`` (a dependency known to be down) runs the job again later without spending an
attempt. A job raises them; it does not decide what happens next.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar


class TransientError(Exception):
    """A failure worth retrying: the dependency may answer next time."""


class Unreachable(TransientError):
    """A transient failure in which the dependency itself did not answer: refused, reset,
    timed out, or said it is not available at all. What a circuit breaker counts; a transient
    refusal of one request (an SMTP 451 for this message) is the dependency answering."""


class PermanentError(Exception):
    """A failure no retry can fix: dead-letter at once."""


class Deferred(Exception):
    """The job must not run now, through no fault of its own: run it again in ``retry_in``
    seconds plus up to ``jitter`` seconds of full jitter, without spending an attempt, for at
    most ``deadline`` seconds after its first deferral (``ReliableTask.defer``)."""

    dead_letter_reason: ClassVar[str]

    def __init__(self, message: str, *, retry_in: float, jitter: float, deadline: float) -> None:
        super().__init__(message)
        self.retry_in = retry_in
        self.jitter = jitter
        self.deadline = deadline

    def __reduce__(self) -> Any:
        # Celery pickles the exception a job failed with; keyword-only arguments need this.
        rebuild = functools.partial(
            type(self), retry_in=self.retry_in, jitter=self.jitter, deadline=self.deadline
        )
        return (rebuild, (str(self),))


class ProviderUnavailable(Deferred):
    """A provider's circuit breaker is open: calling it now would only add to its load."""

    dead_letter_reason = "provider_unavailable"  # DeadLetter.Reason.PROVIDER_UNAVAILABLE


class RedeliveredTooOften(PermanentError):
    """The broker delivered this job's message as often as a job may be delivered, every
    earlier delivery ending with no outcome (the worker running it died, or lost the broker):
    a poison message, not run again but dead-lettered (RabbitMQ, which counts deliveries)."""

    dead_letter_reason = "redelivery_limit"  # DeadLetter.Reason.REDELIVERY_LIMIT
