"""The project's URLs plus a no-op POST view: the baseline every ingest figure is compared with.

Served with ``DJANGO_ROOT_URLCONF=bench.urls`` by the same gunicorn, settings and middleware as
the webhook, so the difference between the two is the webhook's own work.
"""

from __future__ import annotations

from django.http import HttpRequest, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from core.urls import urlpatterns as base


@csrf_exempt
@require_POST
def noop(request: HttpRequest) -> JsonResponse:
    """Read the body, as the webhook does, and answer without verifying or storing anything."""
    return JsonResponse({"received": True, "bytes": len(request.body)})


urlpatterns = [*base, path("bench/noop/", noop, name="bench-noop")]
