from django.apps import AppConfig


class AsyncWorkConfig(AppConfig):
    name = "asyncwork"
    verbose_name = "Async machinery"

    def ready(self) -> None:
        # Its system checks, and the runner: the Celery task that runs jobs, registered on
        # import, and the receivers of each pool process, which read the models.
        from asyncwork import checks, runner  # noqa: F401

        runner.celery_signals_connect()
