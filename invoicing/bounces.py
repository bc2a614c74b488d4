"""Bounces close the loop: an email the provider accepted and later could not deliver.

The configured provider's tracking webhook reaches ``webhooks/email/<provider>/tracking/``,
where django-anymail verifies it as that provider signs it (Postmark: HTTP basic auth with
``ANYMAIL_WEBHOOK_SECRET``; with none set, the webhook is off) and sends the ``tracking``
signal. A bounce, rejection or complaint
of one of our emails (found by the delivery key the send put in the message's metadata) marks
its delivery ``bounced`` and raises a dead letter of the email's job, "bounced: <the provider's
reason>", which an operator handles like any other: correct the recipient, then replay.

Every webhook can arrive twice, late or out of order. The dead letter's task id is the
provider's event, so a repeat records nothing more; a bounce must name the address and the
provider's message id of the email last sent under its key, so one for an address or a message
since replaced (the recipient corrected and the email sent again) changes nothing, and so does
one forged from the key alone.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from anymail import urls as anymail_urls
from anymail.signals import AnymailTrackingEvent, EventType, tracking
from django.conf import settings
from django.db import transaction
from django.dispatch import receiver
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import URLPattern
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from asyncwork import deadletters
from asyncwork.contrib.mail import RecipientRejected, address_spec, header_text
from asyncwork.models import DeadLetter
from invoicing.models import EmailDelivery
from invoicing.tasks import (
    DELIVERY_KEY_METADATA,
    invoice_email_key,
    resend_invoice_email,
    send_invoice_email,
)

logger = logging.getLogger(__name__)

# The tracking events that say the email did not reach its recipient, or should not again.
UNDELIVERED = {
    EventType.BOUNCED: "bounced",
    EventType.REJECTED: "rejected",
    EventType.COMPLAINED: "complained",
}


def _same_address(a: str, b: str) -> bool:
    try:
        return address_spec(a).lower() == address_spec(b).lower()
    except ValueError:
        return a.strip().lower() == b.strip().lower()


def bounce_reason(event: AnymailTrackingEvent, *, kind: str) -> str:
    """``bounced: <the provider's description> (<the receiving server's reply>)``, one line."""
    said = [str(part) for part in (event.description, event.mta_response) if part]
    if not said and event.reject_reason:
        said = [str(event.reject_reason)]
    words = said[0] + (f" ({said[1]})" if len(said) > 1 else "") if said else "no reason given"
    return header_text(f"{kind}: {words}")[:2000]


def email_undelivered_record(
    *, key: str, kind: str, reason: str, recipient: str, message_id: str, event_id: str
) -> DeadLetter | None:
    """Mark the delivery under ``key`` undelivered and dead-letter its email's job, in one
    transaction; None when there is nothing to do: no such delivery, a repeat of this event, or
    an event that is not about the email last sent under the key. The key alone is guessable (it
    counts up), so the event must also name the address that email went to and, when the
    provider gives one, the message id it answered the send with."""
    with transaction.atomic():
        delivery = EmailDelivery.objects.select_for_update().filter(key=key).first()
        if delivery is None:
            logger.warning("email %s for an unknown delivery key", kind, extra={"key": key})
            return None
        about = {"invoice_id": delivery.invoice_id, "key": key}
        if not recipient:
            logger.warning("email %s naming no recipient; ignored", kind, extra=about)
            return None
        if not delivery.recipient or not _same_address(recipient, delivery.recipient):
            logger.info("email %s for an address no longer sent to; ignored", kind, extra=about)
            return None
        if message_id and message_id != delivery.provider_message_id:
            logger.info(
                "email %s for a message no longer the last sent; ignored", kind, extra=about
            )
            return None
        if delivery.key == invoice_email_key(delivery.invoice_id):
            task, args = send_invoice_email.module_path, [delivery.invoice_id]
        else:
            task, args = resend_invoice_email.module_path, [delivery.pk]
        letter = deadletters.record(
            task=task,
            task_id=f"{kind}:{event_id}"[:255],
            args=args,
            kwargs={},
            queue=send_invoice_email.queue_name,
            reason=DeadLetter.Reason.PERMANENT,
            exc=RecipientRejected(reason),
            traceback="",
            attempts=delivery.attempts,
        )
        if letter is None:
            return None  # this event was recorded before
        # Sending: sent again since (a replay); that send's mark then finds it bounced.
        if delivery.state in (
            EmailDelivery.State.SENDING,
            EmailDelivery.State.SENT,
            EmailDelivery.State.BOUNCED,
        ):
            delivery.state = EmailDelivery.State.BOUNCED
            delivery.bounced_at = timezone.now()
            delivery.last_error = reason
            delivery.save(update_fields=["state", "bounced_at", "last_error", "updated_at"])
    return letter


def tracking_provider() -> str:
    """The provider whose tracking webhook is served: ``EMAIL_BACKEND``'s when it is one of
    anymail's (``anymail.backends.<provider>.EmailBackend``), else none."""
    module, _, _ = settings.EMAIL_BACKEND.rpartition(".")
    package, _, provider = module.rpartition(".")
    return provider if package == "anymail.backends" else ""


@functools.cache
def _tracking_views() -> dict[str, Callable[..., HttpResponse]]:
    """anymail's tracking webhook views by provider (``<provider>/tracking/``)."""
    return {
        str(p.pattern).partition("/")[0]: p.callback
        for p in anymail_urls.urlpatterns
        if isinstance(p, URLPattern) and (p.name or "").endswith("_tracking_webhook")
    }


@csrf_exempt
def email_tracking(request: HttpRequest, provider: str) -> HttpResponse:
    """``webhooks/email/<provider>/tracking/``: the configured provider's tracking webhook,
    verified by anymail as that provider signs it; every other provider's is 404, and so is the
    configured one while ``ANYMAIL_WEBHOOK_SECRET`` is unset (anymail alone would take anyone's
    post, only warning). A failed verification is anymail's ``AnymailWebhookValidationFailure``,
    a ``SuspiciousOperation``: Django answers 400, and the logging settings make it one WARNING
    line and a count (``SuspiciousRequestFilter``)."""
    view = _tracking_views().get(provider) if provider == tracking_provider() else None
    if view is None:
        return JsonResponse(
            {"error": "no email tracking webhook here for this provider (EMAIL_BACKEND)"},
            status=404,
        )
    if not getattr(settings, "ANYMAIL", {}).get("WEBHOOK_SECRET"):
        return JsonResponse(
            {"error": "email tracking webhooks are off: ANYMAIL_WEBHOOK_SECRET is not set"},
            status=404,
        )
    return view(request)


@receiver(tracking, dispatch_uid="invoicing.bounces")
def email_tracking_receive(
    sender: Any, event: AnymailTrackingEvent, esp_name: str, **_: Any
) -> None:
    """anymail's ``tracking`` signal, sent from the verified webhook: bounces, rejections and
    complaints of our emails are recorded; every other event is left alone."""
    kind = UNDELIVERED.get(event.event_type)
    if kind is None:
        return
    key = (event.metadata or {}).get(DELIVERY_KEY_METADATA)
    if not isinstance(key, str) or not key:
        logger.info("email %s without our delivery key; ignored", kind, extra={"esp": esp_name})
        return
    # The provider's own event id; else the message and kind, which a repeat shares.
    event_id = f"{esp_name}:{event.event_id or f'{event.message_id}:{event.recipient}'}"
    email_undelivered_record(
        key=key,
        kind=kind,
        reason=bounce_reason(event, kind=kind),
        recipient=event.recipient or "",
        message_id=event.message_id or "",
        event_id=event_id.lower(),
    )
