"""The benchmarks' settings: ``core.settings`` serving the benchmarks' extra views beside the
real ones (bench/urls.py), and any Django setting a benchmark gives in ``BENCH_SETTINGS`` (JSON;
``bench.worker_rss --max-tasks-per-child``; ``DATABASE``: keys of the default database's;
``ASYNCWORK``: keys of the machinery's)."""

import json
import os

from core.settings import *  # noqa: F403

ROOT_URLCONF = "bench.urls"
_given = json.loads(os.environ.get("BENCH_SETTINGS", "{}"))
# "DATABASE": keys of DATABASES["default"] (its OPTIONS merged), and "ASYNCWORK": keys of
# ASYNCWORK, for a lever (bench.peers).
_database = _given.pop("DATABASE", {})
DATABASES["default"]["OPTIONS"].update(_database.pop("OPTIONS", {}))  # noqa: F405
DATABASES["default"].update(_database)  # noqa: F405
ASYNCWORK.update(_given.pop("ASYNCWORK", {}))  # noqa: F405
globals().update(_given)
