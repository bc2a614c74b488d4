"""The test app's tasks, declared as a stranger declares them: Django's ``@task``, with the
retry policy asyncwork's backend takes."""

import time

from django.db.models import F
from django_tasks import task

from asyncwork import PermanentError, TransientError
from shop.models import Guest


@task(max_attempts=3, backoff=0.5, backoff_max=0.5)
def greet(name: str) -> int:
    """Greets a guest once: a guest that is not there fails for good; one with failures left
    fails transiently (one fewer each time). Returns how often the guest has been greeted."""
    guest = Guest.objects.filter(name=name).first()
    if guest is None:
        raise PermanentError(f"no guest named {name}")
    if Guest.objects.filter(pk=guest.pk, failures_left__gt=0).update(
        failures_left=F("failures_left") - 1
    ):
        raise TransientError(f"{name} is not answering")
    Guest.objects.filter(pk=guest.pk, greeted=0).update(greeted=1)
    return Guest.objects.get(pk=guest.pk).greeted


@task
def fail_with_a_bug() -> None:
    """Fails as a bug does: not a failure the task states, so it fails at once."""
    raise ValueError("a bug")


@task(max_attempts=2, time_limit=60)
def wait_then_greet(name: str, seconds: float) -> None:
    """Marks its start, waits, then greets: a worker killed while it waits leaves it running."""
    Guest.objects.filter(name=name).update(failures_left=F("failures_left") + 100)
    time.sleep(seconds)
    Guest.objects.filter(name=name).update(greeted=F("greeted") + 1)
