from django.apps import AppConfig
from django.core import checks


class CoreConfig(AppConfig):
    name = "core"
    verbose_name = "Async machinery"

    def ready(self) -> None:
        from core import dashboard, health
        from core.checks import https_opt_out_check

        health.register_check("beat", health.check_beat, critical=False)
        dashboard.machinery_probes_register()
        checks.register(https_opt_out_check, checks.Tags.security, deploy=True)
