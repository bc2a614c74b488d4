"""A worker's periodic database thread (asyncwork.periodic): a tick the database refuses is
logged once per outage, its connection replaced, and the thread carries on; on PostgreSQL."""

from __future__ import annotations

import logging
import threading

import pytest
from django.db import connection

from asyncwork.periodic import PeriodicThread
from stack.net import wait_until

pytestmark = pytest.mark.django_db(transaction=True)

logger = logging.getLogger("tests.periodic")


class Counting(PeriodicThread):
    """Counts a row on each tick; the table exists only while ``table_there`` is set."""

    def __init__(self) -> None:
        super().__init__(
            name="tests-periodic",
            interval=0.05,
            logger=logger,
            failed="count not read: %s",
            recovered="count read again",
            at_once=True,
        )
        self.table_there = threading.Event()
        self.counted: list[int] = []
        self.stopped_on_its_connection = False

    def _count(self) -> int:
        table = "django_migrations" if self.table_there.is_set() else "no_such_table"
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT count(*) FROM {table}")
            return int(cursor.fetchone()[0])

    def tick(self) -> None:
        count = self.guarded(self._count, -1)
        self.counted.append(count)

    def at_stop(self) -> None:
        self.stopped_on_its_connection = connection.connection is not None


def test_a_refused_tick_is_logged_once_per_outage_and_the_thread_carries_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    thread = Counting()
    with caplog.at_level(logging.INFO, logger="tests.periodic"):
        thread.start()
        try:
            assert wait_until(lambda: thread.counted.count(-1) >= 5, timeout=10)
            thread.table_there.set()
            assert wait_until(lambda: thread.counted and thread.counted[-1] > 0, timeout=10)
            ticks = len(thread.counted)
            assert wait_until(lambda: len(thread.counted) >= ticks + 3, timeout=10)
        finally:
            thread.stop()
    assert not thread.thread.is_alive()
    messages = [record.getMessage() for record in caplog.records]
    assert sum(m.startswith("count not read:") for m in messages) == 1
    assert "no_such_table" in next(m for m in messages if m.startswith("count not read:"))
    assert messages.count("count read again") == 1
    assert thread.stopped_on_its_connection
