from django.urls import path

from webhooks.stripe import StripeWebhookView

app_name = "webhooks"
urlpatterns = [path("stripe/", StripeWebhookView.as_view(), name="stripe")]
