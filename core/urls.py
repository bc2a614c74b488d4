from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView
from rest_framework.routers import DefaultRouter

from asyncwork.api import DeadLetterViewSet
from asyncwork.dashboard import dashboard_view
from asyncwork.health import health_view, live_view
from asyncwork.metrics import metrics_view
from invoicing.api import InvoiceViewSet

api = DefaultRouter()
api.register("invoices", InvoiceViewSet, basename="invoice")
api.register("dead-letters", DeadLetterViewSet, basename="dead-letter")

urlpatterns = [
    # Before the admin's own URLs, which would take "dashboard/" for an app label.
    path("admin/dashboard/", admin.site.admin_view(dashboard_view), name="admin-dashboard"),
    path("admin/", admin.site.urls),
    path("webhooks/", include("webhooks.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/", include(api.urls)),
    path("health/", health_view, name="health"),
    path("health/live", live_view, name="health-live"),
    path("metrics", metrics_view, name="metrics"),
]
