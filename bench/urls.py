"""The project's URLs plus the benchmarks' own views, served with
``bench.settings`` by the same gunicorn, settings and middleware as the webhook:

* ``POST /bench/noop/``: the baseline every ingest figure is compared with, so the difference
  between the two is the webhook's own work;
* ``POST /bench/tutorial/webhook/``: the tutorial arm's webhook (``bench.tutorial``).
"""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from bench import tutorial
from core.urls import urlpatterns as base


@csrf_exempt
@require_POST
def noop(request: HttpRequest) -> JsonResponse:
    """Read the body, as the webhook does, and answer without verifying or storing anything."""
    return JsonResponse({"received": True, "bytes": len(request.body)})


urlpatterns = [
    *base,
    path("bench/noop/", noop, name="bench-noop"),
    path("bench/tutorial/webhook/", tutorial.stripe_webhook, name="bench-tutorial-webhook"),
]
