"""The Celery application: ``celery -A core worker`` and ``celery -A core beat`` need no flags.

Configuration lives in ``core.settings`` under the ``CELERY_`` prefix, each non-default option
commented there.
"""

import os

from celery import Celery

from core import queues

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "core.settings")

app = Celery("core")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.conf.task_default_queue = queues.DEFAULT
app.conf.task_queues = queues.CONSUMED
app.conf.task_routes = queues.ROUTES
app.autodiscover_tasks()
# Scheduled jobs live in each app's jobs.py.
app.autodiscover_tasks(related_name="jobs")
