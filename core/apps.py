from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "core"
    verbose_name = "Async machinery"

    def ready(self) -> None:
        from core import health
        from core.beat import beat_check

        health.register_check("beat", beat_check, critical=False)
