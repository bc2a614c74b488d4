"""The peers benchmark's tasks (``bench.peers``): two bodies, each declared once per API the
arms use, so every arm runs the same code.

* ``noop(n, hold)``: waits ``hold`` seconds (0: none), then records its run;
* ``email(n)``: sends one email with Django's ``send_mail`` over Django's SMTP backend (a new
  connection per email, as the tutorial does), then records its run.

A run is recorded as one row per task number and arm in ``bench_peer_run`` (made by the
benchmark): its runs, the start of its first run and the end of its last, so the benchmark
reads completions, drain rates, latencies and double runs from PostgreSQL whatever the backend.

Declared with Django's ``@task`` on the ``peer`` alias (asyncwork, django-tasks-db,
django-tasks-fennel: ``bench.peers_settings``), procrastinate's ``@app.task`` and Celery's
``@shared_task`` (the tutorial's ``delay_on_commit``).
"""

from __future__ import annotations

import os
import time

from celery import shared_task
from django.core.mail import get_connection, send_mail
from django.db import connection
from django_tasks import task
from procrastinate.contrib.django import app as procrastinate_app

TABLE = "bench_peer_run"
ARM = os.environ.get("PEERS_ARM", "")
DJANGO_SMTP = "django.core.mail.backends.smtp.EmailBackend"


def _record(n: int, started: float) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {TABLE} (arm, n, runs, started, finished) VALUES (%s, %s, 1, %s, %s) "
            f"ON CONFLICT (arm, n) DO UPDATE SET runs = {TABLE}.runs + 1, "
            "finished = EXCLUDED.finished",
            [ARM, n, started, time.time()],
        )


def noop_body(n: int, hold: float = 0.0) -> None:
    started = time.time()
    if hold:
        time.sleep(hold)
    _record(n, started)


def email_body(n: int) -> None:
    started = time.time()
    send_mail(
        subject=f"Invoice {n} paid",
        message=f"Thank you for your payment for invoice {n}.",
        from_email=None,
        recipient_list=[f"{ARM}-{n}@peers.example.com"],
        connection=get_connection(DJANGO_SMTP),
    )
    _record(n, started)


@task(backend="peer")
def noop(n: int, hold: float = 0.0) -> None:
    noop_body(n, hold)


@task(backend="peer")
def email(n: int) -> None:
    email_body(n)


@procrastinate_app.task(name="bench.peer_tasks.procrastinate_noop")
def procrastinate_noop(n: int, hold: float = 0.0) -> None:
    noop_body(n, hold)


@procrastinate_app.task(name="bench.peer_tasks.procrastinate_email")
def procrastinate_email(n: int) -> None:
    email_body(n)


@shared_task(name="bench.peer_tasks.celery_noop")
def celery_noop(n: int, hold: float = 0.0) -> None:
    noop_body(n, hold)


@shared_task(name="bench.peer_tasks.celery_email")
def celery_email(n: int) -> None:
    email_body(n)
