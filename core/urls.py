from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView
from rest_framework.routers import DefaultRouter

from asyncwork.api import DeadLetterViewSet
from invoicing.api import InvoiceViewSet
from invoicing.bounces import email_tracking_urlpatterns

api = DefaultRouter()
api.register("invoices", InvoiceViewSet, basename="invoice")
api.register("dead-letters", DeadLetterViewSet, basename="dead-letter")

urlpatterns = [
    # health/, health/live, metrics and admin/dashboard/: before the admin's own URLs.
    path("", include("asyncwork.urls")),
    path("admin/", admin.site.urls),
    path("webhooks/", include("webhooks.urls")),
    # The email provider's tracking webhooks (bounces, complaints), verified by django-anymail:
    # webhooks/email/<provider>/tracking/ (invoicing.bounces).
    path("webhooks/email/", include((email_tracking_urlpatterns(), "anymail"))),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/", include(api.urls)),
]
