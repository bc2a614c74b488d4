"""The peers benchmark's settings (``bench.peers``): the benchmarks' settings with the other
backends' apps installed, and the task alias ``peer`` on the backend of the arm the process
belongs to (``PEERS_BACKEND``). The application's own tasks keep ``default``."""

import os
from typing import Any

from bench.settings import *  # noqa: F403
from bench.settings import INSTALLED_APPS, TASKS

INSTALLED_APPS = [
    *INSTALLED_APPS,
    "django_tasks_db",
    "procrastinate.contrib.django",
    "django_tasks_fennel",
]
PEER_BACKENDS: dict[str, dict[str, Any]] = {
    "asyncwork": {"BACKEND": "asyncwork.backend.OutboxBackend", "QUEUES": ["default"]},
    "db": {"BACKEND": "django_tasks_db.DatabaseBackend", "QUEUES": ["default"]},
    "fennel": {"BACKEND": "django_tasks_fennel.CeleryBackend"},
    # The arms that do not go through Django's task API (procrastinate, the tutorial).
    "none": {"BACKEND": "django_tasks.backends.dummy.DummyBackend"},
}
TASKS = {
    **TASKS,
    "peer": PEER_BACKENDS[os.environ.get("PEERS_BACKEND", "none")],
}
PROCRASTINATE_IMPORT_PATHS = ["bench.peer_tasks"]
