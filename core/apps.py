from django.apps import AppConfig


class CoreConfig(AppConfig):
    name = "core"
    verbose_name = "Project"

    def ready(self) -> None:
        from core import checks  # noqa: F401  (its system checks)
