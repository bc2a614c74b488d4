"""Invoices and the one-email-per-invoice key."""

from __future__ import annotations

from django.db import models


class Invoice(models.Model):
    class Status(models.TextChoices):
        DRAFT = "draft"
        OPEN = "open"
        PAID = "paid"
        UNCOLLECTIBLE = "uncollectible"
        VOID = "void"

    provider_invoice_id = models.CharField(max_length=255, unique=True)
    number = models.CharField(max_length=255, blank=True)
    customer_email = models.CharField(max_length=320, blank=True)
    # The provider's customer, whose email is read when the invoice carries none.
    provider_customer_id = models.CharField(max_length=255, blank=True)
    # An operator's correction, kept apart from customer_email, which the provider's events set.
    recipient_override = models.EmailField(max_length=320, blank=True)
    customer_name = models.CharField(max_length=255, blank=True)
    amount_paid = models.BigIntegerField(default=0, help_text="Integer minor units.")
    currency = models.CharField(max_length=3, blank=True)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.OPEN)
    hosted_invoice_url = models.URLField(max_length=2000, blank=True)
    paid_at = models.DateTimeField(null=True, blank=True)
    # The provider's time of the last state applied: an older event changes nothing.
    provider_updated_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        indexes = [models.Index(fields=["status", "paid_at"], name="invoice_status_paid_idx")]
        permissions = [
            ("resend_invoice_email", "Can resend invoice email"),
            ("correct_invoice_recipient", "Can correct invoice recipient"),
        ]

    def __str__(self) -> str:
        return self.number or self.provider_invoice_id

    @property
    def recipient(self) -> str:
        """Where the emails go: the operator's correction, else the provider's address."""
        return self.recipient_override or self.customer_email


class EmailDelivery(models.Model):
    """One email's UNIQUE idempotency key and its claim: a worker sends only while holding it."""

    class State(models.TextChoices):
        PENDING = "pending", "Pending (requested, not yet claimed)"
        SENDING = "sending", "Sending"
        SENT = "sent", "Sent"
        FAILED = "failed", "Failed"
        BOUNCED = "bounced", "Bounced (the provider reported it undelivered)"

    key = models.CharField(max_length=255, unique=True)
    invoice = models.ForeignKey(Invoice, on_delete=models.CASCADE, related_name="emails")
    state = models.CharField(max_length=10, choices=State.choices)
    attempts = models.PositiveIntegerField(default=0)
    claimed_by = models.CharField(max_length=255, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    message_id = models.CharField(max_length=255)
    sent_at = models.DateTimeField(null=True, blank=True)
    recipient = models.CharField(
        max_length=320, blank=True, help_text="The address its last attempt was for."
    )
    # The provider's id of the message last sent (anymail's message_id; none over SMTP): a
    # bounce naming another message is not this one's.
    provider_message_id = models.CharField(max_length=255, blank=True)
    bounced_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    requested_by = models.CharField(max_length=150, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "email deliveries"
        indexes = [
            # The claims in flight, read every few seconds by the rescue: a few rows.
            models.Index(
                fields=["updated_at"],
                name="emaildelivery_sending_idx",
                condition=models.Q(state="sending"),
            )
        ]

    def __str__(self) -> str:
        return f"{self.key} ({self.state})"
