from django.apps import AppConfig
from django.core import checks


class CoreConfig(AppConfig):
    name = "core"
    verbose_name = "Async machinery"

    def ready(self) -> None:
        from django.db.models.signals import post_migrate

        from core import dashboard, health
        from core.checks import https_opt_out_check
        from core.jobs import schedules_sync_after_migrate

        health.register_check("beat", health.check_beat, critical=False)
        dashboard.machinery_probes_register()
        checks.register(https_opt_out_check, checks.Tags.security, deploy=True)
        # Scheduled jobs work after migrate alone; sender=self: once per migrate, not per app.
        post_migrate.connect(
            schedules_sync_after_migrate, sender=self, dispatch_uid="core.schedules_sync"
        )
