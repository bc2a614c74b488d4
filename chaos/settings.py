"""The chaos run's settings: ``core.settings`` with the timing scaled down (chaos.config.TIMING
and TIMING_ASYNCWORK) so a run takes minutes; every process of the run (web, workers, beat)
loads them."""

from chaos.config import TIMING, TIMING_ASYNCWORK, VISIBILITY_TIMEOUT
from core.settings import *  # noqa: F403
from core.settings import ASYNCWORK, CELERY_BROKER_TRANSPORT_OPTIONS

globals().update(TIMING)
ASYNCWORK = {**ASYNCWORK, **TIMING_ASYNCWORK}
if "visibility_timeout" in CELERY_BROKER_TRANSPORT_OPTIONS:  # Redis
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        **CELERY_BROKER_TRANSPORT_OPTIONS,
        "visibility_timeout": VISIBILITY_TIMEOUT,
    }
