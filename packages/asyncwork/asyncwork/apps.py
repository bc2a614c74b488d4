from django.apps import AppConfig


class AsyncWorkConfig(AppConfig):
    name = "asyncwork"
    verbose_name = "Async machinery"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        # Importing the declaring modules declares the machinery's own jobs and probes, ahead of
        # any app's.
        from asyncwork import (  # noqa: F401
            checks,
            deadletters,
            gauges,
            outbox,
            rescue,
            retention,
        )
        from asyncwork.jobs import schedules_sync_after_migrate

        # Scheduled jobs work after migrate alone; sender=self: once per migrate, not per app.
        post_migrate.connect(
            schedules_sync_after_migrate, sender=self, dispatch_uid="asyncwork.schedules_sync"
        )
