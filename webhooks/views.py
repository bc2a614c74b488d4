"""POST /webhooks/stripe/: verify, store once, answer; the email is someone else's job."""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt

from webhooks.services import KEPT_HEADERS, webhook_event_record
from webhooks.stripe import WebhookRejected, event_parse, signature_verify

logger = logging.getLogger(__name__)


def _reject(reason: str, status: int) -> JsonResponse:
    logger.warning("webhook rejected: %s", reason, extra={"reason": reason, "status": status})
    return JsonResponse({"error": reason}, status=status)


@method_decorator(csrf_exempt, name="dispatch")
class StripeWebhookView(View):
    http_method_names = ["post"]

    def post(self, request: HttpRequest) -> JsonResponse:
        limit = settings.WEBHOOK_MAX_BODY_BYTES
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return _reject("invalid Content-Length", 400)
        if length > limit:
            return _reject(f"body larger than {limit} bytes", 413)
        payload = request.read(limit + 1)
        if len(payload) > limit:
            return _reject(f"body larger than {limit} bytes", 413)
        if not payload:
            return _reject("empty body", 400)
        try:
            signed_at = signature_verify(
                payload=payload,
                header=request.headers.get("Stripe-Signature"),
                secrets=settings.STRIPE_WEBHOOK_SECRETS,
                tolerance=settings.STRIPE_WEBHOOK_TOLERANCE,
            )
            event = event_parse(payload=payload, signed_at=signed_at)
        except WebhookRejected as exc:
            return _reject(exc.reason, exc.status)

        headers = {
            name: str(request.META[meta]).replace("\x00", "")[:2000]
            for meta, name in KEPT_HEADERS.items()
            if meta in request.META
        }
        try:
            recorded = webhook_event_record(
                event=event, body=payload.decode("utf-8"), headers=headers
            )
        except (OperationalError, InterfaceError) as exc:
            logger.error(
                "database unavailable; asking the provider to retry",
                extra={"event_id": event.id, "error": repr(exc)},
            )
            response = JsonResponse({"error": "temporarily unavailable"}, status=503)
            response["Retry-After"] = str(settings.WEBHOOK_RETRY_AFTER_SECONDS)
            return response
        return JsonResponse(
            {
                "received": True,
                "event_id": recorded.event_id,
                "duplicate": recorded.duplicate,
            }
        )
