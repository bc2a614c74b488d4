from django.apps import AppConfig
from django.core import checks


class CoreConfig(AppConfig):
    name = "core"
    verbose_name = "Async machinery"

    def ready(self) -> None:
        from core import health
        from core.beat import beat_check
        from core.checks import https_opt_out_check

        health.register_check("beat", beat_check, critical=False)
        checks.register(https_opt_out_check, checks.Tags.security, deploy=True)
