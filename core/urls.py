from django.contrib import admin
from django.urls import include, path

from asyncwork.dashboard import dashboard_view
from asyncwork.health import health_view, live_view
from asyncwork.metrics import metrics_view

urlpatterns = [
    # Before the admin's own URLs, which would take "dashboard/" for an app label.
    path("admin/dashboard/", admin.site.admin_view(dashboard_view), name="admin-dashboard"),
    path("admin/", admin.site.urls),
    path("webhooks/", include("webhooks.urls")),
    path("api/", include("core.api_urls")),
    path("health/", health_view, name="health"),
    path("health/live", live_view, name="health-live"),
    path("metrics", metrics_view, name="metrics"),
]
