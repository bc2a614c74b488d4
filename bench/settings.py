"""The benchmarks' settings: ``core.settings`` serving the benchmarks' extra views beside the
real ones (bench/urls.py), and any Django setting a benchmark gives in ``BENCH_SETTINGS`` (JSON;
``bench.worker_rss --max-tasks-per-child``)."""

import json
import os

from core.settings import *  # noqa: F403

ROOT_URLCONF = "bench.urls"
globals().update(json.loads(os.environ.get("BENCH_SETTINGS", "{}")))
