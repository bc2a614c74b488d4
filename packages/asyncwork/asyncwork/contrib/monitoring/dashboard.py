"""The operator's dashboard, ``/admin/dashboard/``: the figures of every probe that has them
(``asyncwork.contrib.monitoring.probes``), each linking to the list it counts. Read-only, for staff
who may view the
machinery's lists.
"""

from __future__ import annotations

import time

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_safe

from asyncwork.contrib.monitoring.probes import probes_read

# What a staff user needs to see the dashboard: the lists it summarises.
VIEW_PERMISSIONS = (
    "asyncwork.view_deadletter",
    "asyncwork.view_job",
    "asyncwork.view_scheduledjob",
)


@never_cache
@require_safe
def dashboard_view(request: HttpRequest) -> HttpResponse:
    """Served through ``admin.site.admin_view`` (staff only; others go to the login page)."""
    if not request.user.has_perms(VIEW_PERMISSIONS):
        raise PermissionDenied
    started = time.perf_counter()
    readings = probes_read("figures")
    context = {
        **admin.site.each_context(request),
        "title": "Dashboard",
        "readings": readings,
        "probes_ms": round((time.perf_counter() - started) * 1000, 1),
    }
    return TemplateResponse(request, "admin/asyncwork/dashboard.html", context)
