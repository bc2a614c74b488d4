"""The Celery queues, named in one place.

``default`` and ``email`` are consumed by ``celery -A core worker``. ``dlq`` is not: nothing
consumes it unless an operator asks, so its depth in the broker is the number of dead letters
waiting for a human.
"""

from kombu import Queue

DEFAULT = "default"
EMAIL = "email"
DLQ = "dlq"

# What a worker started with no -Q consumes.
CONSUMED = (Queue(DEFAULT), Queue(EMAIL))

# Where each task is published: the one place a task's queue is decided.
ROUTES = {
    "invoicing.send_invoice_email": {"queue": EMAIL},
    "invoicing.resend_invoice_email": {"queue": EMAIL},
}


def queue_for(task_name: str) -> str:
    return ROUTES.get(task_name, {}).get("queue", DEFAULT)
