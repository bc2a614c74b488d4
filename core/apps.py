from django.apps import AppConfig
from django.core import checks


class CoreConfig(AppConfig):
    name = "core"
    verbose_name = "Project"

    def ready(self) -> None:
        from core.checks import https_opt_out_check

        checks.register(https_opt_out_check, checks.Tags.security, deploy=True)
