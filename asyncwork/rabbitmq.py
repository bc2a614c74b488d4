"""What RabbitMQ as the broker needs besides the queues' declarations (``asyncwork.queues``):
``dlq`` declared by every worker as it starts.

The consumed queues dead-letter a message delivered too often onto ``dlq``; RabbitMQ drops a
dead-lettered message that no queue is bound to take, and ``dlq`` is otherwise declared only
when the first dead letter's copy is published to it. Nothing here runs on Redis.
"""

from __future__ import annotations

from typing import Any

from celery import bootsteps
from django.conf import settings

from asyncwork import queues


class DeadLetterQueueDeclare(bootsteps.StartStopStep):
    """A worker's consumer step: declare ``dlq`` once connected, before consuming (and again
    after every reconnection, which a queue deleted meanwhile needs)."""

    requires = ("celery.worker.consumer.connection:Connection",)

    def include_if(self, parent: Any) -> bool:
        return bool(settings.BROKER_IS_RABBITMQ)

    def start(self, parent: Any) -> None:
        channel = parent.connection.channel()
        try:
            queues.dlq_declaration()(channel).declare()
        finally:
            channel.close()
