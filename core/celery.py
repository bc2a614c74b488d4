"""The Celery application: ``celery -A core worker|beat`` need no flags; configuration is
``core.settings``' ``CELERY_`` options."""

import os
from typing import Any

from celery import Celery

from asyncwork.install import celery_install
from core.startup import settings_load_or_exit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "core.settings")

app = Celery("core")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.on_configure.connect
def _settings_load(**_: Any) -> None:
    """Before the first configuration read (in the CLI, while click parses): settings that do
    not load stop the command with one line, not a traceback through click."""
    settings_load_or_exit()


# The machinery's queues, routes, bootsteps and signal receivers; the consumed queues are set
# once every app declared its own (CoreConfig.ready).
celery_install(app)
app.autodiscover_tasks()
