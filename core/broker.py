"""kombu's Redis transport with one fix: an acknowledgement that fails releases its slot.

kombu's Redis ``QoS.ack`` removes the message from the unacknowledged index and only then
releases the worker's prefetch slot. When Redis does not answer in time (a stall, a failover),
the removal raises, kombu logs the error and swallows it, and the slot is never released: a
worker with prefetch 1 stays connected and fetches nothing, for good (PITFALLS: celery #8030,
#9054; the chaos suite's broker stall left 188 of 294 emails unsent this way;
``tests/invoicing/test_broker_stall.py``).

Here the slot is released whatever the removal did. Nothing is lost or doubled by it: a
message whose removal failed stays in the unacknowledged index, comes back after the
visibility timeout, and its redelivery finds the work done (the email's sent key).

Used when the broker URL is ``redis://`` (``CELERY_BROKER_TRANSPORT`` in ``core.settings``).
"""

from __future__ import annotations

from kombu.transport import redis, virtual


class QoS(redis.QoS):
    def ack(self, delivery_tag: str) -> None:
        try:
            self._remove_from_indices(delivery_tag).execute()  # type: ignore[attr-defined]
        finally:
            virtual.QoS.ack(self, delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        try:
            if requeue:
                self.restore_by_tag(delivery_tag, leftmost=True)
            else:
                self._remove_from_indices(delivery_tag).execute()  # type: ignore[attr-defined]
        finally:
            virtual.QoS.ack(self, delivery_tag)


class Channel(redis.Channel):
    QoS = QoS


class Transport(redis.Transport):
    Channel = Channel
