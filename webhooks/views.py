"""POST /webhooks/stripe/: verify, shed under backpressure, store once, answer.

Every answer other than 200 stores nothing; a 200 is sent only after the event committed, and
says whether a handler acted on the delivery (``handled``): its handler runs in the transaction
that stores the event, so the answer knows without waiting for anything it enqueued."""

from __future__ import annotations

import logging

from django.conf import settings
from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, JsonResponse
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt

from asyncwork.contrib.backpressure import backpressure_shed
from asyncwork.db import text_storable
from asyncwork.logging import log_context
from webhooks.stripe import (
    KEPT_HEADERS,
    Event,
    WebhookRejected,
    event_parse,
    other_api_version_count,
    signature_verify,
    webhook_delivery_count,
    webhook_event_record,
)

logger = logging.getLogger(__name__)

# Stripe retries on its own schedule; this spaces out any other sender.
RETRY_AFTER_SECONDS = 30


def _reject(reason: str, status: int) -> JsonResponse:
    webhook_delivery_count("rejected", reason)
    logger.warning("webhook rejected: %s", reason, extra={"reason": reason, "status": status})
    response = JsonResponse({"error": reason}, status=status)
    # Logged above: keeps django.request from adding "Bad Request: ..." (log_response's flag).
    response._has_been_logged = True  # type: ignore[attr-defined]
    return response


def _retry_later(error: str) -> JsonResponse:
    """Not taken, nothing stored: the provider is to deliver it again later."""
    response = JsonResponse({"error": error}, status=503)
    response["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return response


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
        # Every line logged from here on, down to the outbox publish, carries the event id.
        with log_context(event_id=event.id):
            return self._take(request, event=event, payload=payload)

    def _take(self, request: HttpRequest, *, event: Event, payload: bytes) -> JsonResponse:
        """Shed, or store once and acknowledge, a verified event."""
        # Only now is the type known, and nothing is stored yet.
        shed = backpressure_shed(essential=event.handled)
        if shed is not None:
            webhook_delivery_count("shed", str(shed))
            logger.warning(
                "webhook shed under backpressure (%s); the provider will redeliver it",
                shed,
                extra={"event_id": event.id, "event_type": event.type, "level": str(shed)},
            )
            return _retry_later("overloaded")

        headers = {
            name: text_storable(str(request.META[meta]))[:2000]
            for meta, name in KEPT_HEADERS.items()
            if meta in request.META
        }
        try:
            recorded = webhook_event_record(
                event=event, body=payload.decode("utf-8"), headers=headers
            )
        except (OperationalError, InterfaceError) as exc:
            webhook_delivery_count("unavailable")
            logger.error(
                "database unavailable; asking the provider to retry",
                extra={"event_id": event.id, "error": repr(exc)},
            )
            return _retry_later("temporarily unavailable")
        webhook_delivery_count("duplicate" if recorded.duplicate else "accepted")
        if not recorded.duplicate and event.handled:
            # Only an event acted on: an ignored one, whatever it says, changes no series.
            other_api_version_count(event.api_version)
        return JsonResponse(
            {
                "received": True,
                "event_id": recorded.event_id,
                "type": event.type,
                "duplicate": recorded.duplicate,
                # A duplicate changes nothing: the first delivery's answer said whether it acted.
                "handled": event.handled and not recorded.duplicate,
            }
        )
