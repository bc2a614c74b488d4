from datetime import timedelta

from django.apps import AppConfig


class AsyncWorkConfig(AppConfig):
    name = "asyncwork"
    verbose_name = "Async machinery"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        from asyncwork import dashboard, gauges, rescue, retention
        from asyncwork.deadletters import dlq_alert
        from asyncwork.jobs import job_register, schedules_sync_after_migrate
        from asyncwork.outbox import outbox_relay

        # The machinery's own probes and metrics come first; each app registers its own after.
        dashboard.machinery_probes_register()
        gauges.machinery_sources_register()
        # The machinery's own jobs; each app declares its own in its ready().
        job_register("outbox-relay", outbox_relay, every=timedelta(seconds=15))
        job_register("dlq-alert", dlq_alert, every=timedelta(minutes=5))
        job_register(
            "retention-purge", retention.retention_purge, cron={"minute": "17", "hour": "3"}
        )
        # The rescue of claims whose owner's heartbeat lapsed; each app registers its own.
        job_register("workers-rescue", rescue.workers_rescue, every=rescue.RESCUE_EVERY)
        retention.retention_register("outbox_messages", retention.outbox_messages_purge)
        # Scheduled jobs work after migrate alone; sender=self: once per migrate, not per app.
        post_migrate.connect(
            schedules_sync_after_migrate, sender=self, dispatch_uid="asyncwork.schedules_sync"
        )
