"""The test app's jobs, declared as a stranger declares them."""

from typing import Any

from django.db.models import F

from asyncwork.errors import PermanentError, TransientError
from asyncwork.tasks import RetryPolicy, reliable_task
from shop.models import Guest

GREET = "shop.greet"
QUICK_RETRY = RetryPolicy(attempts=3, backoff=1, backoff_max=1, jitter=False)


@reliable_task(name=GREET, retry=QUICK_RETRY)
def greet(self: Any, name: str) -> None:
    """Greets a guest once: a guest that is not there fails for good; one with failures left
    fails transiently (one fewer each time)."""
    guest = Guest.objects.filter(name=name).first()
    if guest is None:
        raise PermanentError(f"no guest named {name}")
    if Guest.objects.filter(pk=guest.pk, failures_left__gt=0).update(
        failures_left=F("failures_left") - 1
    ):
        raise TransientError(f"{name} is not answering")
    Guest.objects.filter(pk=guest.pk, greeted=0).update(greeted=1)
