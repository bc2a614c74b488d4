"""Tasks that exist only for tests, loaded into a worker process with ``-I tests.tasks``
(``WorkerProcess(include=...)``): jobs of the project's own task class that fail in ways the
project's tasks do not, on demand."""

from __future__ import annotations

from celery import shared_task

from asyncwork.jobs import JobTask, job_run
from asyncwork.tasks import ReliableTask

DIVIDE = "tests.divide"
FAILING_JOB = "tests-failing-job"


@shared_task(bind=True, base=ReliableTask, name=DIVIDE, max_retries=4)
def divide(self: ReliableTask, numerator: int, denominator: int) -> float:
    """A bug waiting for its input: ``denominator=0`` raises ZeroDivisionError, an exception
    class no task declares (neither permanent nor transient)."""
    return numerator / denominator


@shared_task(base=JobTask, name="tests.failing_job")
def failing_job() -> object:
    """A scheduled job whose body has a bug."""
    return job_run(name=FAILING_JOB, body=lambda: 1 / 0).result
