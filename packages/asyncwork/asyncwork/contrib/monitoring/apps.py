from django.apps import AppConfig


class MonitoringConfig(AppConfig):
    """``/health/``, ``/metrics``, the dashboard, ``manage.py pipeline_status``."""

    name = "asyncwork.contrib.monitoring"
    label = "asyncwork_monitoring"
    verbose_name = "Async machinery: monitoring"

    def ready(self) -> None:
        from asyncwork.contrib.monitoring import gauges, metrics  # noqa: F401  (the probes)

        metrics.receivers_connect()
