from django.apps import AppConfig


class PeriodicConfig(AppConfig):
    """Scheduled jobs (``jobs.job``), one leader beat (``beat.LeaderDatabaseScheduler``),
    retention and the dead-letter alert; needs ``django_celery_beat`` installed too."""

    name = "asyncwork.contrib.periodic"
    label = "asyncwork_periodic"
    verbose_name = "Async machinery: scheduled jobs"

    def ready(self) -> None:
        from django.apps import apps
        from django.db.models.signals import post_migrate

        from asyncwork.contrib.periodic import alert, retention  # noqa: F401  (their jobs)
        from asyncwork.contrib.periodic.jobs import schedules_sync_after_migrate

        # Scheduled jobs work after migrate alone: once per migrate, not per app. Sent by
        # asyncwork's app, whose models they use: Django sends post_migrate only for an app with
        # a models module, which this one has not.
        post_migrate.connect(
            schedules_sync_after_migrate,
            sender=apps.get_app_config("asyncwork"),
            dispatch_uid="asyncwork.schedules_sync",
        )
