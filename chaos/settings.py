"""The chaos run's settings: ``core.settings`` with the timing scaled down (chaos.config.TIMING)
so a run takes minutes, and the settings of the nets switched off (``CHAOS_SETTINGS``, JSON,
from ``python -m chaos --without``); every process of the run (web, workers, beat) loads them."""

import json
import os

from chaos.config import TIMING
from core.settings import *  # noqa: F403
from core.settings import CELERY_BROKER_TRANSPORT_OPTIONS

globals().update(TIMING)
globals().update(json.loads(os.environ.get("CHAOS_SETTINGS", "{}")))
if "visibility_timeout" in CELERY_BROKER_TRANSPORT_OPTIONS:  # Redis
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        **CELERY_BROKER_TRANSPORT_OPTIONS,
        "visibility_timeout": TIMING["CELERY_VISIBILITY_TIMEOUT"],
    }
