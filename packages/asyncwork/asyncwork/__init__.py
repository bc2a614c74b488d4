"""At-least-once background work for Django and Celery, on PostgreSQL, behind Django's own task
API: ``TASKS = {"default": {"BACKEND": "asyncwork.backend.OutboxBackend"}}``, then ``@task``
and ``.enqueue()`` as Django documents them. What ``import asyncwork`` offers (README.md says why
each):

* ``install``: the machinery in the project's Celery app;
* the failures a task states: ``TransientError`` (retried), ``Unreachable`` (retried, and what
  a circuit breaker counts), ``PermanentError`` (failed at once), ``Deferred`` (run later,
  no attempt spent);
* the dead letters and what an operator does with them: ``DeadLetter``, ``replay``,
  ``resolve``, ``unresolve``, and what an app says of its own: ``describer``,
  ``replay_check``;
* ``Job``, the row each enqueued task is.

The rest is the machinery's own, or opt-in under ``asyncwork.contrib``. Names are loaded when
first used: the models only exist once Django's apps are ready. ``install`` alone is loaded with
the package: its module has its name, and importing that module would otherwise make
``asyncwork.install`` the module rather than the function.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "DeadLetter",
    "Deferred",
    "Job",
    "PermanentError",
    "TransientError",
    "Unreachable",
    "describer",
    "install",
    "replay",
    "replay_check",
    "resolve",
    "unresolve",
]

_WHERE = {
    "DeadLetter": "asyncwork.models",
    "Deferred": "asyncwork.errors",
    "Job": "asyncwork.models",
    "PermanentError": "asyncwork.errors",
    "TransientError": "asyncwork.errors",
    "Unreachable": "asyncwork.errors",
    "describer": "asyncwork.deadletters",
    "replay": "asyncwork.deadletters",
    "replay_check": "asyncwork.deadletters",
    "resolve": "asyncwork.deadletters",
    "unresolve": "asyncwork.deadletters",
}

if TYPE_CHECKING:
    from asyncwork.deadletters import describer, replay, replay_check, resolve, unresolve
    from asyncwork.errors import Deferred, PermanentError, TransientError, Unreachable
    from asyncwork.models import DeadLetter, Job


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'asyncwork' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


# Last: its module imports submodules of this package.
from asyncwork.install import install  # noqa: E402
