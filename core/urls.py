from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView
from rest_framework.routers import DefaultRouter

from asyncwork.contrib.api import DeadLetterViewSet
from invoicing.api import InvoiceViewSet
from invoicing.bounces import email_tracking

api = DefaultRouter()
api.register("invoices", InvoiceViewSet, basename="invoice")
api.register("dead-letters", DeadLetterViewSet, basename="dead-letter")

urlpatterns = [
    # health/, health/live, metrics and admin/dashboard/: before the admin's own URLs.
    path("", include("asyncwork.contrib.monitoring.urls")),
    path("admin/", admin.site.urls),
    path("webhooks/", include("webhooks.urls")),
    # The email provider's tracking webhook (bounces, complaints), verified by django-anymail.
    path("webhooks/email/<str:provider>/tracking/", email_tracking, name="email-tracking"),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/", include(api.urls)),
]
