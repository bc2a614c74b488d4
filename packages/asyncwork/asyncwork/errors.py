"""A job's failure as the job states it; the runner (``asyncwork.runner``) decides what follows:
``TransientError`` is retried with backoff, ``PermanentError`` dead-lettered at once,
``Deferred`` run again later without spending an attempt.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar


class TransientError(Exception):
    """A failure worth retrying: the dependency may answer next time. ``retry_after``: the
    seconds the dependency asked to be left alone (an HTTP 429's ``Retry-After``); the retry
    waits at least that long, up to the policy's longest wait."""

    def __init__(self, message: str = "", *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def __reduce__(self) -> Any:
        # Celery pickles the exception a job failed with; keyword-only arguments need this.
        return (functools.partial(type(self), retry_after=self.retry_after), (str(self),))


class Unreachable(TransientError):
    """The dependency did not answer (refused, reset, timed out, unavailable): what a circuit
    breaker counts. A refusal of one request (SMTP 451) is the dependency answering."""


class PermanentError(Exception):
    """A failure no retry can fix: dead-letter at once."""


class Deferred(Exception):
    """Run the job again in ``retry_in`` seconds plus up to ``jitter``, without spending an attempt,
    for at most ``deadline`` seconds after its first deferral."""

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
