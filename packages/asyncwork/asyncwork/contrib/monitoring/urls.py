"""The machinery's URLs, for a project's ``urls.py`` to include ahead of the admin's:
``path("", include("asyncwork.contrib.monitoring.urls"))``. ``health/`` (readiness),
``health/live`` (liveness),
``metrics`` (Prometheus) and the operator's dashboard at ``admin/dashboard/``, which must come
before the admin's own URLs (they would take "dashboard/" for an app label)."""

from django.contrib import admin
from django.urls import path

from asyncwork.contrib.monitoring.dashboard import dashboard_view
from asyncwork.contrib.monitoring.health import health_view, live_view
from asyncwork.contrib.monitoring.metrics import metrics_view

urlpatterns = [
    path("admin/dashboard/", admin.site.admin_view(dashboard_view), name="admin-dashboard"),
    path("health/", health_view, name="health"),
    path("health/live", live_view, name="health-live"),
    path("metrics", metrics_view, name="metrics"),
]
