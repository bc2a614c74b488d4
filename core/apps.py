from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "core"
    verbose_name = "Project"

    def ready(self) -> None:
        from core import checks  # noqa: F401  (its system checks)
        from core.startup import settings_refuse

        # Every manage.py command stops on a refused setting, in one line (manage.py).
        settings_refuse()
