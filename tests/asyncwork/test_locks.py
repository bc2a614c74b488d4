"""Who holds a lock: the process that took it (host and pid), never the PostgreSQL backend
serving it, and never a record left by a holder that is gone."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
from django.db import connection

from asyncwork.contrib.periodic.locks import NAMESPACE, Holder, lock_holder, lock_key
from asyncwork.models import LockHolder
from stack.net import wait_until
from stack.process import ROOT
from tests.helpers.processes import worker_env

pytestmark = pytest.mark.django_db(transaction=True)

NAME = "job:dlq-alert"


@contextmanager
def process_holding(name: str) -> Iterator[subprocess.Popen[str]]:
    """A separate OS process (manage.py shell) holding the lock ``name`` until it is killed."""
    script = (
        "import time; from asyncwork.contrib.periodic.locks import advisory_lock;"
        f"cm = advisory_lock({name!r}); held = cm.__enter__();"
        "print('held' if held else 'busy', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "shell", "--no-imports", "-c", script],
        cwd=ROOT,
        env=worker_env(0),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_the_holder_is_the_process_that_took_the_lock() -> None:
    with process_holding(NAME) as proc:
        holder = lock_holder(NAME)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objid = %s",
                [lock_key(NAME) % 2**32],
            )
            (backend_pid,) = cursor.fetchone()
    # proc is the Python process itself (no shell between), which took the lock.
    assert holder == Holder(host=socket.gethostname(), pid=proc.pid)
    assert backend_pid != proc.pid  # what was shown before: PostgreSQL's backend
    assert str(holder) == f"pid {proc.pid} on host {socket.gethostname()}"
    assert wait_until(lambda: lock_holder(NAME) is None, timeout=5)


def test_a_record_left_by_a_holder_that_is_gone_is_never_shown() -> None:
    with process_holding(NAME) as proc:
        pass  # killed: its session ends, the lock goes, its record stays
    assert LockHolder.objects.get(name=NAME).pid == proc.pid
    assert wait_until(lambda: lock_holder(NAME) is None, timeout=5)

    # A session that takes the lock without recording itself (code older than the record):
    # the stale record of the dead process must not be shown as its holder.
    params = connection.get_connection_params()
    for django_only in ("cursor_factory", "context", "prepare_threshold"):
        params.pop(django_only, None)
    with psycopg.connect(**params, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s, %s)", [NAMESPACE, lock_key(NAME)])
        holder = lock_holder(NAME)
    assert holder == Holder(host=None, pid=None)
    assert str(holder) == "held (holder not recorded)"
