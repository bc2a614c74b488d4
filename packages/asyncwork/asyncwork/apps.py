from django.apps import AppConfig


class AsyncWorkConfig(AppConfig):
    name = "asyncwork"
    verbose_name = "Async machinery"

    def ready(self) -> None:
        from asyncwork import checks  # noqa: F401  (its system checks)
