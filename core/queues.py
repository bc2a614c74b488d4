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
