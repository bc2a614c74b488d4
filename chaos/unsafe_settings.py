"""The control arm's worker settings: ``chaos.settings`` with at-least-once switched off.

Tasks are acknowledged when a worker starts them, not when they finish, and a task whose
worker dies is not requeued: the two Celery settings are where ``asyncwork.install`` sets both
for every task. With the workers' rescue and their republish
of what the broker lost switched off too (``chaos.unsafe_celery``), a killed worker's job and
every message a Redis restart drops are gone: the suite must see those losses, or it could not
see one in the safe arm either.
"""

from chaos.settings import *  # noqa: F403

CELERY_TASK_ACKS_LATE = False
CELERY_TASK_REJECT_ON_WORKER_LOST = False
